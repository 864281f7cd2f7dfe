"""Hostile inputs: arbitrary MessagePack, and valid messages mutated at the structure and byte level.

A decoder fuzzed with random bytes mostly sees "not MessagePack"; the bugs live one step further,
in maps that decode but carry a field no honest sender would write. So :func:`mutated` starts
from a valid message (as plain builtins), changes one to three of its fields (extreme ints, NaN,
huge lists, wrong types, deleted or added keys), encodes it, and then may damage the bytes
(truncation, bit flips, splices, and size markers that claim gigabytes the input does not hold).
"""

from __future__ import annotations

import math

import msgpack
from hypothesis import strategies as st

from p2pserve.protocol import FRAME_PREFIX

INT_EXTREMES = [-1, 0, 1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, -(2**31), -(2**63)]
FLOAT_EXTREMES = [math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324, -1.0, 1e-300]
OTHER_EXTREMES = [None, True, False, "", "x" * 600, "\x00", "\u00e9\u4e2d", b"", b"\x00" * 8, [], {}, [[[]]]]
EXTREMES = st.sampled_from(INT_EXTREMES + FLOAT_EXTREMES + OTHER_EXTREMES)

#: Big containers built without drawing every element (drawing 10,000 integers is slow).
HUGE = st.sampled_from(["huge_ints", "huge_strs", "huge_map", "long_str", "deep"]).map(lambda k: {
    "huge_ints": lambda: list(range(10_000)),
    "huge_strs": lambda: ["peer"] * 3000,
    "huge_map": lambda: {f"k{i}": [i, i + 1] for i in range(2000)},
    "long_str": lambda: "z" * 40_000,
    "deep": lambda: _deep(100),
}[k]())

#: MessagePack markers that claim far more elements or bytes than follow them.
CLAIMS = [b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
          b"\xdc\xff\xff", b"\xde\xff\xff", b"\xc1", b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80" + bytes(7),
          b"\xcb\x7f\xf8" + bytes(6), b"\xc7\xff\x01", b"\xd4\xff\x00"]


def _deep(n: int):
    value: list = []
    for _ in range(n):
        value = [value]
    return value


scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=24)
           | st.binary(max_size=24) | EXTREMES)
#: Anything MessagePack can carry, nested a little.
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10) | st.integers(-3, 3), kids, max_size=5),
    max_leaves=12,
)


def pack(obj) -> bytes:
    """MessagePack bytes of plain builtins (str keys stay str, bytes stay bin)."""
    return msgpack.packb(obj, use_bin_type=True)


_DELETE = object()
_INDEX = st.integers(0, 2**16)
_ACTIONS = st.sampled_from(["extreme", "value", "delete", "add", "huge", "swap", "number", "number"])


def _paths(obj, prefix=()):
    """Every place in a builtins tree (huge containers are not descended into: the container is
    the place that matters, and walking 10,000 entries per mutation is slow)."""
    yield prefix
    if isinstance(obj, (dict, list)) and len(obj) <= 16:
        for k, v in (obj.items() if isinstance(obj, dict) else enumerate(obj)):
            yield from _paths(v, prefix + (k,))


def _replace(obj, path, new):
    """A copy of ``obj`` with the value at ``path`` replaced by ``new`` (or removed: ``_DELETE``)."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = dict(obj) if isinstance(obj, dict) else list(obj)
    child = _replace(obj[head], rest, new)
    if child is _DELETE:
        del copy[head]
    else:
        copy[head] = child
    return copy


def _at(obj, path):
    for p in path:
        obj = obj[p]
    return obj


@st.composite
def mutate_once(draw, obj):
    """One structural change somewhere in ``obj``."""
    paths = list(_paths(obj))
    path = paths[draw(_INDEX) % len(paths)]  # one shared strategy: building one per draw is slow
    action = draw(_ACTIONS)
    node = _at(obj, path)
    if action == "number" and isinstance(node, int) and not isinstance(node, bool):
        # the likeliest lie: a count or size that is negative or past int64 (weighted up: it is
        # the mutation that found the tensor-shape and token-id bugs)
        return _replace(obj, path, draw(st.sampled_from(INT_EXTREMES)))
    if action == "extreme":
        return _replace(obj, path, draw(EXTREMES))
    if action == "value":
        return _replace(obj, path, draw(values))
    if action == "delete" and path:
        return _replace(obj, path, _DELETE)
    if action == "add" and isinstance(node, dict):
        return _replace(obj, path, {**node, draw(st.text(max_size=8)): draw(values)})
    if action == "add" and isinstance(node, list):
        return _replace(obj, path, node + [draw(values)])
    if action == "huge":
        return _replace(obj, path, draw(HUGE))
    if action == "swap" and isinstance(node, (int, float)) and not isinstance(node, bool):
        # the same number as another type: 3 -> 3.0 / "3" / [3]
        return _replace(obj, path, [float(node), str(node), [node]][draw(_INDEX) % 3])
    return _replace(obj, path, draw(EXTREMES))


@st.composite
def damage(draw, raw: bytes) -> bytes:
    """Maybe break encoded bytes: truncate, flip bits, splice, delete, or insert a size claim."""
    kind = draw(st.sampled_from(["none", "none", "truncate", "flip", "splice", "delete", "claim"]))
    if kind == "none" or not raw:
        return raw
    i = draw(st.integers(0, len(raw) - 1))
    if kind == "truncate":
        return raw[:i]
    if kind == "flip":
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            j = draw(st.integers(0, len(raw) - 1))
            out[j] ^= 1 << draw(st.integers(0, 7))
        return bytes(out)
    if kind == "splice":
        return raw[:i] + draw(st.binary(min_size=1, max_size=16)) + raw[i:]
    if kind == "delete":
        return raw[:i] + raw[i + draw(st.integers(1, 8)):]
    return raw[:i] + draw(st.sampled_from(CLAIMS)) + raw[i:]


@st.composite
def mutated(draw, valid: st.SearchStrategy):
    """Bytes of a valid message (drawn from ``valid``, as builtins) after 0-3 structural changes
    and maybe byte-level damage."""
    obj = draw(valid)
    for _ in range(draw(st.integers(0, 3))):
        obj = draw(mutate_once(obj))
    return draw(damage(pack(obj)))


def hostile(valid: st.SearchStrategy) -> st.SearchStrategy:
    """What a decoder sees from a hostile sender: raw bytes, arbitrary MessagePack, or a valid
    message mutated (the last most often: that is where validation has to work)."""
    return st.one_of(
        st.binary(max_size=512),
        values.map(pack),
        mutated(valid),
        mutated(valid),
        mutated(valid),
    )


_HEADER_CLAIMS = st.sampled_from([0, 1, 1 << 16, 2**32 - 1]) | st.integers(0, 2**32 - 1)
_PAYLOAD_CLAIMS = st.sampled_from([0, 1 << 28, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)
_PAYLOADS = st.binary(max_size=64)


@st.composite
def frame(draw, headers: st.SearchStrategy) -> bytes:
    """One session frame whose prefix tells the truth about its lengths, or claims other ones."""
    header, payload = draw(headers), draw(_PAYLOADS)
    header_len = len(header) if draw(st.booleans()) else draw(_HEADER_CLAIMS)
    payload_len = len(payload) if draw(st.booleans()) else draw(_PAYLOAD_CLAIMS)
    return FRAME_PREFIX.pack(header_len, payload_len) + header + payload


def streams(headers: st.SearchStrategy) -> st.SearchStrategy:
    """What arrives on a connection before the sender hangs up: a few frames (headers drawn from
    ``headers``, as bytes), maybe damaged, or plain random bytes."""
    framed = st.lists(frame(headers), min_size=1, max_size=3).map(b"".join)
    return st.binary(max_size=256) | framed | framed.flatmap(damage)
