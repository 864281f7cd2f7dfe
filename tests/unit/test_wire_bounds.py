"""Counters and sizes on the wire are bounded by the decoder itself.

``Forward(position=-5)`` used to be accepted: the peer's cache length became -2 and attention ran
over uninitialised slots. A negative position, step, layer bound or max_length is now malformed.
"""

from __future__ import annotations

import msgspec
import pytest

from p2pserve.errors import MalformedFrameError
from p2pserve.protocol import PROTOCOL_VERSION, Forward, OpenSession, TensorMeta, decode_request

META = TensorMeta(dtype="int64", shape=[1], nbytes=8)


@pytest.mark.parametrize("field,value", [("position", -5), ("step", -1)])
def test_negative_forward_counters_are_malformed(field, value):
    fields = {"session_id": "s", "step": 0, "position": 0, "tensor": META, field: value}
    with pytest.raises(MalformedFrameError):
        decode_request(msgspec.msgpack.encode(Forward(**fields)))


@pytest.mark.parametrize("field,value", [("start", -1), ("end", -3), ("max_length", -7)])
def test_negative_session_bounds_are_malformed(field, value):
    fields = {"version": PROTOCOL_VERSION, "model_id": "m", "session_id": "s", "start": 0, "end": 1,
              "max_length": 8, field: value}
    with pytest.raises(MalformedFrameError):
        decode_request(msgspec.msgpack.encode(OpenSession(**fields)))


def test_honest_values_still_decode():
    msg = Forward(session_id="s", step=3, position=7, tensor=META)
    assert decode_request(msgspec.msgpack.encode(msg)) == msg
