"""The minimal failing examples the fuzzers found, kept as plain tests.

Each was an untyped exception (or an unchecked value) escaping a decoder of network bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.validation import DHTRecord

from p2pserve.dht.probe_messages import REQUESTS, read_probe_frame
from p2pserve.dht.records import CoordinatorCandidate, LinkInfo, PeerInfo, Plan, decode_record
from p2pserve.dht.signing import LoggingSignatureValidator, load_or_create_key
from p2pserve.errors import MalformedFrameError
from p2pserve.protocol import FrameLimits, TensorMeta, check_prefix, decode_reply, decode_request
from p2pserve.transport.frames import tensor_from_wire
from tests.fuzz.aio import reader_of, run
from tests.fuzz.mutate import pack

NOT_UTF8 = b"\xa1\x80"  # a one-byte MessagePack str holding a UTF-8 continuation byte


def test_a_str_that_is_not_utf8_is_malformed_in_every_decoder():
    """msgspec raises UnicodeDecodeError (no DecodeError) for it; it escaped every decoder."""
    header = b"\x82\xa1t\xa5close\xaasession_id" + NOT_UTF8
    with pytest.raises(MalformedFrameError):
        decode_request(header)
    with pytest.raises(MalformedFrameError):
        decode_reply(b"\x82\xa1t\xa6closed\xaasession_id" + NOT_UTF8)
    for cls in (PeerInfo, LinkInfo, CoordinatorCandidate, Plan):
        with pytest.raises(MalformedFrameError):
            decode_record(b"\x81\xa5model" + NOT_UTF8, cls)

    async def probe():
        return await read_probe_frame(reader_of(len(NOT_UTF8).to_bytes(4, "big") + NOT_UTF8), REQUESTS)

    with pytest.raises(MalformedFrameError):
        run(probe())


@pytest.mark.parametrize("shape", [[0, 2**63], [0, 2**62, 2**62], [0, 2**64 - 1]])
def test_an_empty_tensor_with_absurd_dimensions_is_malformed(shape):
    """It holds no bytes, so the byte count agreed; torch then overflowed building it."""
    with pytest.raises(MalformedFrameError):
        tensor_from_wire(TensorMeta("float32", shape, 0), b"")


def test_counters_and_token_ids_past_int64_are_malformed():
    """A token id 2**64-1 decoded, and the client's next int64 input tensor overflowed."""
    with pytest.raises(MalformedFrameError):
        decode_reply(pack({"t": "result", "session_id": "s", "step": 0, "position": 1, "token": 2**64 - 1}))
    with pytest.raises(MalformedFrameError):
        decode_reply(pack({"t": "result", "session_id": "s", "step": 0, "position": 1, "token": -1}))
    with pytest.raises(MalformedFrameError):
        decode_request(pack({"t": "forward", "session_id": "s", "step": 2**64 - 1, "position": 0,
                             "tensor": {"dtype": "int64", "shape": [1], "nbytes": 8}}))


@pytest.mark.parametrize("port", [-1, 70000])
def test_a_port_no_socket_takes_is_malformed(port):
    """asyncio raised OverflowError connecting to it, which the direct path did not catch."""
    with pytest.raises(MalformedFrameError):
        decode_reply(pack({"t": "direct_offer", "port": port, "token": "x"}))


def test_a_short_frame_prefix_is_malformed():
    with pytest.raises(MalformedFrameError):
        check_prefix(b"\x00\x00\x00\x01", FrameLimits())


def test_an_owner_key_of_unknown_type_is_refused_not_raised():
    """cryptography raised UnsupportedAlgorithm (no ValueError) inside the DHT's validator."""
    validator = LoggingSignatureValidator(load_or_create_key(None))
    record = DHTRecord(key=b"k", subkey=b"[owner:ssh-foo AAAA]", value=b"v[signature:AAAA]", expiration_time=1.0)
    assert validator.validate(record) is False
    assert validator.validate(dataclasses.replace(record, key=b"[owner:ssh-foo AAAA]", subkey=None)) is False
