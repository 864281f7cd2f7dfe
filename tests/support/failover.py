"""A pipeline over fake peers, for the client failover and session-owner tests."""

from __future__ import annotations

import asyncio

from p2pserve.client.failover import FailoverState
from p2pserve.client.hop import Hop
from p2pserve.client.pipeline import Pipeline
from p2pserve.config import ClientConfig
from p2pserve.testing import FakeClock, FakePeerNetwork

SPANS = {"a1": (0, 4), "a2": (0, 4), "b1": (4, 8), "b2": (4, 8)}


def network(spans=SPANS) -> tuple[FakePeerNetwork, list[Hop]]:
    net = FakePeerNetwork(num_layers=8)
    return net, [net.add(p, *span) for p, span in spans.items()]


def make_pipeline(net, routes, config=ClientConfig(max_retries=3, stale_route_pause_s=0.0), clock=None) -> Pipeline:
    state = FailoverState(config, clock or FakeClock())
    return Pipeline(net.client(), routes, "fake-model", 8, max_length=256, config=config, state=state)


def run(coro):
    return asyncio.run(coro)


async def generate(pipeline, prompt, n, after_token=None):
    """``n`` greedy steps after ``prompt``; ``after_token(i)`` runs after the i-th token."""
    out, pending = [], prompt
    try:
        for i in range(n):
            tok = await pipeline.step(pending)
            out.append(tok)
            pending = [tok]
            if after_token is not None:
                after_token(i + 1)
        return out
    finally:
        await pipeline.close()
