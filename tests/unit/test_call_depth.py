"""The call path of one decode token, from the public API down to ``write_frame``, stays shallow.

How it is counted: the client runs for real over an in-memory transport against three fake
peers. ``write_frame`` (as the session stream calls it) is replaced by a spy that, whenever a
decode Forward (one token) is written, walks the Python stack from its caller up to the public
entry point (``AsyncClient.generate`` or ``ReplyStream.__anext__``) and counts the p2pserve frames
on the way, entry included, plus one for ``write_frame`` itself (the spy stands in for it).
asyncio's own frames sit above the entry point (the task driving the coroutine), so they are not
in between; frames of other packages would be skipped anyway.
"""

from __future__ import annotations

import asyncio
import sys

import pytest

import p2pserve.transport.session_stream as session_stream
from p2pserve.client.api import AsyncClient
from p2pserve.config import ClientConfig
from p2pserve.protocol import Forward
from p2pserve.testing import FakePeerNetwork

MAX_DEPTH = 6
ENTRIES = {("p2pserve.client.api", "generate"), ("p2pserve.client.reply", "__anext__")}


def decode_depths(monkeypatch, drive) -> list[tuple[str, int]]:
    """(entry point, frames) at every decode Forward written while ``drive(client)`` runs."""
    real = session_stream.write_frame
    seen: list[tuple[str, int]] = []

    def spy(writer, message, payload=b""):
        if isinstance(message, Forward) and message.tensor.shape[0] == 1:
            depth, frame = 1, sys._getframe(1)  # 1: write_frame itself
            while frame is not None:
                module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
                if module.startswith("p2pserve."):
                    depth += 1
                if (module, name) in ENTRIES:
                    seen.append((f"{module}.{name}", depth))
                    break
                frame = frame.f_back
            else:
                raise AssertionError("no public entry point on the stack")
        return real(writer, message, payload)

    monkeypatch.setattr(session_stream, "write_frame", spy)
    net = FakePeerNetwork(num_layers=8)
    hops = [net.add("peerA", 0, 3), net.add("peerB", 3, 6), net.add("peerC", 6, 8)]

    async def main():
        peers = [f"{h.maddrs[0]}@{h.start}:{h.end}" for h in hops]
        async with AsyncClient(peers=peers, model_info=net.model_info(), transport=net.client(), seed=0,
                               config=ClientConfig(direct=False)) as client:
            await drive(client)

    asyncio.run(main())
    return seen


@pytest.mark.parametrize("api", ["generate", "generate_stream"])
def test_a_decode_token_is_at_most_six_calls_deep(monkeypatch, api):
    async def drive(client):
        if api == "generate":
            reply = await client.generate([1, 2, 3], max_new_tokens=5, ignore_eos=True)
            assert len(reply.tokens) == 5 and len(reply.route) == 3
        else:
            async for _ in client.generate_stream([1, 2, 3], max_new_tokens=5, ignore_eos=True):
                pass

    seen = decode_depths(monkeypatch, drive)
    assert len(seen) == 4 * 3  # 4 decode steps (the first step is the prefill), 3 hops each
    depth = max(d for _, d in seen)
    print(f"\n{api}: a decode token's call depth to write_frame is {depth} ({seen[0][0]} -> ... -> write_frame)")
    assert depth <= MAX_DEPTH
