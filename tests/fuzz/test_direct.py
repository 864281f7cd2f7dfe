"""The direct path's handshake (``transport/tcp.py``): the peer's listener parsing a connection's
first frame (what arrives once TLS is up: ``_serve`` is the TLS server's callback), and the client
parsing the peer's ``DirectOffer``.

Properties: the listener hands a connection to the session handler only after an
``AttachDirect`` frame carrying a token it issued, answers it ``DirectAttached``, and closes
every other connection; nothing escapes its accept callback (an exception there used to leave
the connection open). The client's upgrade returns the stream it opened or raises a typed or
connection error, whatever the peer answers.
"""

from __future__ import annotations

import asyncio

import msgspec
from hypothesis import example, given
from hypothesis import strategies as st

from p2pserve.errors import ProtocolError
from p2pserve.protocol import (
    FRAME_PREFIX,
    SESSION_PROTOCOL,
    AttachDirect,
    DirectAttached,
    FrameLimits,
    decode_reply,
    decode_request,
)
from p2pserve.transport.frames import read_frame
from p2pserve.transport.memory import MemoryNetwork, PipeWriter
from p2pserve.transport.tcp import DirectListener, DirectTransport
from tests.fuzz import FUZZ, counted
from tests.fuzz.aio import reader_of, run
from tests.fuzz.messages import replies, requests
from tests.fuzz.mutate import hostile, mutated, pack, streams

#: Stands for the token the listener issues (32 hex characters), swapped in once it is known.
SLOT = "T" * 32
attach = st.just(msgspec.to_builtins(AttachDirect(token=SLOT)))
attach_headers = st.one_of(attach.map(pack), mutated(attach), hostile(requests))
#: The honest first frame followed by anything: the path that attaches, which random frames rarely take.
honest = st.tuples(attach.map(pack).map(lambda h: FRAME_PREFIX.pack(len(h), 0) + h), st.binary(max_size=64))


def pack_frame(header: dict) -> bytes:
    """``header`` as one whole frame without payload."""
    body = pack(header)
    return FRAME_PREFIX.pack(len(body), 0) + body


def _first_frame(data: bytes):
    if len(data) < FRAME_PREFIX.size:
        return None
    header_len, payload_len = FRAME_PREFIX.unpack(data[:FRAME_PREFIX.size])
    return payload_len, data[FRAME_PREFIX.size:FRAME_PREFIX.size + header_len]


async def _handshake(data: bytes):
    attached = []

    async def handler(reader, writer, remote):
        attached.append((writer, remote))

    listener = DirectListener(handler, "me", hosts=[], attach_timeout_s=5.0)
    token = listener.tokens.issue("holder")
    data = data.replace(SLOT.encode(), token.encode())
    answers = asyncio.StreamReader()
    writer = PipeWriter(answers)
    await listener._serve(reader_of(data), writer)
    return data, token, attached, writer, answers, listener


@FUZZ
@given(streams(attach_headers) | honest.map(b"".join))
@example(FRAME_PREFIX.pack(4, 0) + b"\xa1\x80\xa1\x80")  # a str that is not UTF-8
@counted("tcp.DirectListener.attach")
def test_listener_attaches_only_with_its_token(raw):
    data, token, attached, writer, answers, listener = run(_handshake(raw))
    if not attached:
        assert writer.closed
        return
    assert attached[0][1] == "holder"  # served as the peer the token was issued to
    payload_len, header = _first_frame(data)
    assert payload_len == 0 and decode_request(header) == AttachDirect(token=token)
    assert len(listener.tokens) == 0  # one use only
    reply = run(read_frame(answers, FrameLimits()))
    assert decode_reply(reply[0]) == DirectAttached(peer_id="me")


async def _upgrade(data: bytes):
    net = MemoryNetwork()

    async def peer(reader, writer, remote):
        try:
            await read_frame(reader, FrameLimits())  # the client's OpenDirect
        except (asyncio.IncompleteReadError, ProtocolError):
            pass
        writer.write(data)
        writer.close()

    net.serve("peer", SESSION_PROTOCOL, peer)
    transport = DirectTransport(net.transport("client"))
    try:
        return await transport.open_stream("peer", [], SESSION_PROTOCOL, 5.0)
    except (ProtocolError, ConnectionError):
        return None


@FUZZ
@given(streams(hostile(replies)))
@example(FRAME_PREFIX.pack(4, 0) + b"\xa1t\xa1\x80")
@example(pack_frame({"t": "direct_offer", "port": 1, "token": "x", "tls_sha256": "Z" * 64}))  # not a fingerprint
@counted("tcp.DirectTransport.offer")
def test_client_upgrade_survives_any_offer(raw):
    stream = run(_upgrade(raw))
    # without addresses to dial, whatever the offer says, the client keeps the stream it opened
    assert stream is None or stream.kind == "memory"
