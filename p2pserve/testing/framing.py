"""A framing attacker for tests and benchmarks: throwaway client keys accusing honest peers.

It holds no peer. It opens ordinary sessions on honest peers and files what they signed as
evidence: tokens sampled at a temperature with different seeds (the witnesses with one, the
accused with another), and the accused's positions run one by one against the witnesses'
prefill of the same inputs (honest rounding), each published raw under fresh DHT keys, skipping
the validation an honest client runs before it publishes. What it shows is in docs/trust.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from p2pserve.client.connection import HopConnection
from p2pserve.client.hop import Hop
from p2pserve.config import ClientConfig, DHTConfig
from p2pserve.dht.evidence import Evidence, InputChain, Mismatch, SignedClaim, make_claim, output_digest, row_digests
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import encode_record
from p2pserve.dht.swarm import Swarm
from p2pserve.protocol import SamplingParams
from p2pserve.transport.frames import tensor_to_wire

PROMPT = [1, 5, 9, 13]


class FramingAttacker:
    """Signed replies of honest peers (``transport``: the attacker's own client node), turned into cases."""

    def __init__(self, transport, model_id: str, dtype: str, reply_keys: dict[str, str]):
        self.transport, self.model_id, self.dtype, self.keys = transport, model_id, dtype, reply_keys
        self.limits = ClientConfig().frame_limits

    async def run(self, hop: Hop, steps: list[list[int]], sampling: SamplingParams, sid: str):
        """Send ``steps`` (token rows) in turn on a session over ``hop``; the signed claim of the
        last reply (with the key ``hop``'s peer announces), its output bytes, and the history."""
        conn = HopConnection(self.transport, hop, self.limits, 60)
        await conn.open(self.model_id, sid, 64, sampling)
        chain, position, history = InputChain(), 0, b""
        try:
            for i, rows in enumerate(steps):
                ids = torch.tensor(rows)
                reply, hidden = await conn.forward(i, position, ids)
                data = bytes(tensor_to_wire(ids)[1])
                history += data
                commitment, at, position = chain.extend(row_digests(data, len(rows))), position, position + len(rows)
        finally:
            await conn.close()
        out = bytes(tensor_to_wire(hidden)[1]) if hidden is not None else b""
        claim = make_claim(model=self.model_id, peer_id=hop.peer_id, session_id=sid, start=hop.start, end=hop.end,
                           position=at, count=len(steps[-1]), commitment=commitment,
                           output=output_digest(out, None if hidden is not None else reply.token),
                           kind="hidden" if hidden is not None else "token", dtype=self.dtype, sampling=sampling)
        return SignedClaim(claim, reply.signature, self.keys.get(hop.peer_id, "")), out, history

    async def cases(self, honest: Sequence[Hop], split: int) -> tuple[list[Mismatch], list[Mismatch]]:
        """(seed cases, rounding cases) against each of ``honest`` (whole-model hops), the others
        as witnesses; the rounding cases run layers [0, ``split``)."""
        seeds, rounding = [], []
        for i, accused in enumerate(honest):
            witnesses = [h for h in honest if h is not accused]
            hot = lambda seed: SamplingParams(temperature=1.5, seed=seed)  # noqa: E731
            signed_w = [await self.run(w, [PROMPT], hot(100), f"w{i}-{j}") for j, w in enumerate(witnesses)]
            for seed in range(1, 40):
                a = await self.run(accused, [PROMPT], hot(seed), f"a{i}-{seed}")
                if a[0].claim.output != signed_w[0][0].claim.output:
                    break
            seeds.append(_case(a, signed_w))
            part = lambda h: Hop(h.peer_id, 0, split, h.maddrs)  # noqa: E731
            one_by_one = await self.run(part(accused), [[t] for t in PROMPT], SamplingParams(), f"s{i}")
            prefill = [await self.run(part(w), [PROMPT[:-1], PROMPT[-1:]], SamplingParams(), f"p{i}-{j}")
                       for j, w in enumerate(witnesses)]
            rounding.append(_case(one_by_one, prefill))
        return seeds, rounding


def _case(accused, witnesses) -> Mismatch:
    return Mismatch(accused=accused[0], witnesses=[w[0] for w in witnesses],
                    outputs=[accused[1], *[w[1] for w in witnesses]] if accused[1] else [], history=accused[2])


def publish_from_fresh_keys(dht: DHTConfig, cases: list[Mismatch], reporters: int, key_dir: str, name: str) -> int:
    """``cases`` (at most 8) stored raw under ``reporters`` fresh DHT keys; how many stores succeeded."""
    import asyncio

    stored = 0
    for r in range(reporters):
        node = Swarm.create(dataclasses.replace(dht, key_path=f"{key_dir}/{name}{r}.key"))
        try:
            record = Evidence(model=dht.model, reporter_id=node.peer_id, cases=cases[:8], timestamp=time.time())
            stored += bool(asyncio.run(node._put(RecordKind.EVIDENCE, encode_record(record), 600)))
        finally:
            node.shutdown()
    return stored
