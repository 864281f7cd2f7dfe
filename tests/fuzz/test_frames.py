"""The frame codec: ``read_frame`` over a stream that ends, and ``tensor_from_wire``.

Properties: ``read_frame`` yields frames whose lengths are inside the limits and add up to no
more than what arrived, or raises a ``ProtocolError`` (a limit) or ``IncompleteReadError`` (the
sender hung up, its documented end of stream), within a timeout, and without allocating memory
for lengths the prefix only claims. ``tensor_from_wire`` returns a tensor holding no more bytes
than its payload, or raises ``MalformedFrameError``.
"""

from __future__ import annotations

import asyncio
import tracemalloc

from hypothesis import example, given
from hypothesis import strategies as st

from p2pserve.errors import MalformedFrameError, ProtocolError
from p2pserve.protocol import FRAME_PREFIX, FrameLimits, TensorMeta
from p2pserve.transport.frames import read_frame, tensor_from_wire
from tests.fuzz import FUZZ, counted
from tests.fuzz.aio import reader_of, run
from tests.fuzz.messages import requests
from tests.fuzz.mutate import hostile, streams
from tests.support.wire import claimed_metas

limits = st.builds(FrameLimits, max_header_bytes=st.integers(0, 1 << 17) | st.just(64 * 1024),
                   max_payload_bytes=st.integers(0, 1 << 30) | st.just(256 * 1024 * 1024))
#: Slack for the reader's own bookkeeping, above the bytes that really arrived.
_OVERHEAD = 256 * 1024


async def _read_all(data: bytes, lim: FrameLimits):
    reader = reader_of(data)
    frames = []
    while True:
        try:
            frames.append(await read_frame(reader, lim))
        except asyncio.IncompleteReadError:
            return frames
        except ProtocolError:
            return frames


@FUZZ
@given(streams(hostile(requests)), limits)
@example(FRAME_PREFIX.pack(16, 2**64 - 1) + b"x" * 16, FrameLimits(max_payload_bytes=2**64 - 1))
@counted("frames.read_frame")
def test_read_frame(data, lim):
    tracemalloc.start()
    try:
        frames = run(_read_all(data, lim))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 4 * len(data) + _OVERHEAD, f"{peak} bytes traced reading {len(data)} bytes"
    used = 0
    for header, payload in frames:
        assert 0 < len(header) <= lim.max_header_bytes and len(payload) <= lim.max_payload_bytes
        used += FRAME_PREFIX.size + len(header) + len(payload)
    assert used <= len(data)


@FUZZ
@given(st.one_of(claimed_metas(), st.tuples(st.builds(TensorMeta, dtype=st.just("float32"), shape=st.lists(
    st.integers(0, 8), max_size=4), nbytes=st.integers(0, 2048)), st.integers(0, 2048))), st.data())
@example((TensorMeta("int64", [0, 2**63], 0), 0), None)
@counted("frames.tensor_from_wire")
def test_tensor_from_wire(case, data):
    meta, claimed = case
    actual = claimed if type(claimed) is int and 0 <= claimed <= 1 << 16 else 0
    payload = bytes(actual) if data is None else data.draw(st.sampled_from([bytes(actual), bytearray(actual)]))
    try:
        t = tensor_from_wire(meta, payload)
    except MalformedFrameError:
        return
    assert list(t.shape) == list(meta.shape)
    assert t.untyped_storage().nbytes() <= len(payload)
