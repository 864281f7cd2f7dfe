"""The link prober's wire (``dht/probe_messages.py``): a u32 length and a typed MessagePack map
per message.

Properties: ``read_probe_frame`` returns a validated request struct or raises a ``ProtocolError``
(or ``IncompleteReadError`` when the sender hung up); the probe server answers any stream with
well-formed typed reply frames and ends it, without raising and without reading a bulk transfer
into memory.
"""

from __future__ import annotations

import asyncio

from hypothesis import example, given
from hypothesis import strategies as st

from p2pserve.config import ProberConfig
from p2pserve.dht.probe_messages import (
    PROBE_VERSION,
    REPLIES,
    REQUESTS,
    ProbeBulk,
    ProbePing,
    ProbeReply,
    read_probe_frame,
)
from p2pserve.dht.prober import LinkProber
from p2pserve.errors import ProtocolError
from p2pserve.transport.memory import PipeWriter
from tests.fuzz import FUZZ, counted
from tests.fuzz.aio import reader_of, run
from tests.fuzz.mutate import INT_EXTREMES, damage, hostile

probe_requests = st.one_of(
    st.just({"v": PROBE_VERSION, "op": "ping"}),
    st.builds(lambda n: {"v": PROBE_VERSION, "op": "bulk", "n": n}, st.integers(0, 4096) | st.sampled_from(INT_EXTREMES)),
)


@st.composite
def probe_frame(draw) -> bytes:
    body = draw(hostile(probe_requests))
    size = draw(st.just(len(body)) | st.integers(0, 2**32 - 1) | st.sampled_from([0, 1024, 1025, 2**32 - 1]))
    return size.to_bytes(4, "big") + body + draw(st.binary(max_size=64))  # bulk bytes, or junk


probe_streams = st.lists(probe_frame(), min_size=1, max_size=4).map(b"".join).flatmap(damage) | st.binary(max_size=128)


async def _read(data: bytes):
    try:
        return await read_probe_frame(reader_of(data), REQUESTS)
    except (ProtocolError, asyncio.IncompleteReadError):
        return None


@FUZZ
@given(probe_streams)
@example(b"\x00\x00\x00\x02\xa1\x80")  # a str that is not UTF-8
@example(b"\x00\x00\x00\x01\x01")  # MessagePack, but not a map
@counted("prober.read_frame")
def test_probe_frame(data):
    msg = run(_read(data))
    assert msg is None or isinstance(msg, (ProbePing, ProbeBulk))
    if isinstance(msg, ProbeBulk):  # validated on decode: a size no bulk can have never gets through
        assert type(msg.n) is int and msg.n >= 0


async def _serve(data: bytes):
    answers = asyncio.StreamReader()
    writer = PipeWriter(answers)
    prober = LinkProber(None, ProberConfig(max_probe_bytes=1 << 12))
    await prober._handle(None, reader_of(data), writer)
    replies = []
    while True:
        try:
            replies.append(await read_probe_frame(answers, REPLIES))
        except asyncio.IncompleteReadError:
            return writer, replies, prober


@FUZZ
@given(probe_streams)
@example(b"\x00\x00\x00\x02\xa1\x80")
@example(b"\x00\x00\x00\x01\x01")
@counted("prober.serve")
def test_probe_server(data):
    writer, replies, prober = run(_serve(data))
    assert writer.closed and prober._active == 0
    assert all(isinstance(r, ProbeReply) and isinstance(r.ok, bool) for r in replies)
