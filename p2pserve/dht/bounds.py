"""Bounds and small validators shared by the typed DHT records (``records.py``, ``reports.py``,
``machine_info.py``): each validator returns None or raises RecordRejected with a reason."""

from __future__ import annotations

import math
from typing import Literal, Optional

from p2pserve.errors import RecordRejected
from p2pserve.types import LayerRange

SCHEMA_VERSION = 1

# Sanity bounds. They are deliberately generous (a record within them may still be wrong) but
# they stop a single buggy or hostile peer from poisoning the planner with figures that would
# dominate any max-flow (10^12 tokens/s) or break arithmetic (negative memory, NaN).
MAX_LAYERS = 4096
MAX_ACTIVATION_BYTES = 1 << 20  # one token's hidden state: hidden size 262144 in fp32
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: far beyond any single peer
MAX_TOKENS_PER_S = 1e8  # per peer, for one layer: ~1000x a fast GPU today
MAX_BANDWIDTH_BYTES_S = 1e12  # 8 Tbit/s
MAX_RTT_S = 60.0
MAX_TOKENS = 1 << 40
MAX_EPOCH = 1 << 62  # plan epochs; a coordinator's next epoch saturates here (dht.election.next_epoch)
MAX_ADDRS = 32
MAX_STR = 512
MAX_QUANT = 16  # a quantization scheme's name (int8, nf4, ...)
MAX_LINKS = 4096
MAX_PEERS_IN_PLAN = 4096
MAX_FLOWS = 1 << 17
MAX_TP = 8  # tensor-parallel degree of one peer (a TP group inside one machine)
MAX_MACHINE_SLOTS = 16  # GPUs (or CPU slots) one machine agent offers
MAX_LATENCY_POINTS = 8  # measured (tokens, ms) points per phase of a latency profile
MAX_LAYER_MS = 1e5  # one layer's batch taking 100 s is no serving peer
MAX_KV_ENTRY_BYTES = 1 << 24  # one token's K and V for one layer

PeerState = Literal["joining", "loading", "serving", "draining"]
PEER_STATES: tuple[str, ...] = ("joining", "loading", "serving", "draining")


# ---------------------------------------------------------------------------------------------
# small validation helpers: each returns None or raises RecordRejected with a reason


def _finite(name: str, x: float, lo: float, hi: float) -> None:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or not lo <= x <= hi:
        raise RecordRejected(f"{name}={x!r} outside [{lo:g}, {hi:g}]")


def _int(name: str, x: int, lo: int, hi: int) -> None:
    if not lo <= x <= hi:
        raise RecordRejected(f"{name}={x!r} outside [{lo}, {hi}]")


def _str(name: str, s: str, *, allow_empty: bool = False) -> None:
    if (not s and not allow_empty) or len(s) > MAX_STR:
        raise RecordRejected(f"{name} must be 1-{MAX_STR} characters, got {len(s)}")


def check_span(name: str, span: Optional[LayerRange], num_layers: Optional[int] = None) -> None:
    """Reject a half-open layer range that is empty, reversed or out of bounds."""
    if span is None:
        return
    start, end = span
    upper = MAX_LAYERS if num_layers is None else num_layers
    if not 0 <= start < end <= upper:
        raise RecordRejected(f"{name}=[{start}, {end}) is not a valid range within [0, {upper})")


def _check_quant(quant: str, model: str) -> None:
    """A quantization name is a short token, and the model's name carries it as its suffix."""
    if not quant:
        return
    if len(quant) > MAX_QUANT or not quant.isascii() or not all(c.isalnum() or c == "_" for c in quant) \
            or quant != quant.lower():
        raise RecordRejected(f"quant {quant[:MAX_QUANT]!r} is not a lowercase token of 1-{MAX_QUANT} characters")
    if not model.endswith("@" + quant):
        raise RecordRejected(f"announces quant={quant!r} for model {model!r}, whose name does not end in '@{quant}'")


def _check_schema(schema: int) -> None:
    if schema != SCHEMA_VERSION:
        raise RecordRejected(f"schema {schema} not supported (this build reads {SCHEMA_VERSION})")
