"""The call path of one decode token, from the public API down to ``write_frame``, crosses few layers.

What is counted, and why: the modules a decode token passes through, not its Python frames.
The client runs for real over an in-memory transport against three fake peers. ``write_frame``
(as the session stream calls it) is replaced by a spy that, whenever a decode Forward (one
token) is written, walks the Python stack from its caller up to the public entry point
(``AsyncClient.generate`` or ``ReplyStream.__anext__``) and counts the runs of consecutive
p2pserve frames in one module (entry included), plus one for ``write_frame``'s own module.

A frame count forbade helpers: splitting a function in two made the path one deeper, so code
was duplicated to stay under the cap. A helper in the same module adds no layer here; a token
hopping through one more module does (api -> generation -> pipeline -> connection -> frames
today), and that is what makes a hot path hard to follow and slow to change. asyncio's own
frames sit above the entry point (the task driving the coroutine), so they are not in between;
frames of other packages are skipped.
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

MAX_LAYERS = 5
ENTRIES = {("p2pserve.client.api", "generate"), ("p2pserve.client.reply", "__anext__")}


def decode_depths(monkeypatch, drive) -> list[tuple[str, int]]:
    """(entry point, layers) at every decode Forward written while ``drive(client)`` runs."""
    real = session_stream.write_frame
    seen: list[tuple[str, int]] = []

    def spy(writer, message, payload=b""):
        if isinstance(message, Forward) and message.tensor.shape[0] == 1:
            modules, frame = ["p2pserve.transport.frames"], sys._getframe(1)  # write_frame's own module
            while frame is not None:
                module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
                if module.startswith("p2pserve.") and module != modules[-1]:
                    modules.append(module)  # a new layer; a helper in the same module is not one
                if (module, name) in ENTRIES:
                    seen.append((f"{module}.{name}", len(modules)))
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
def test_a_decode_token_crosses_at_most_five_modules(monkeypatch, api):
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
    print(f"\n{api}: a decode token crosses {depth} modules to write_frame ({seen[0][0]} -> ... -> write_frame)")
    assert depth <= MAX_LAYERS
