"""A machine agent's settings (``p2pserve machine``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class MachineConfig:
    """One machine agent: ``devices`` per slot ("cpu" or "cuda:N"), the ``p2pserve peer`` flags
    every group gets (``peer_args``: model, swarm, timing), each slot's layer capacity, and a
    fixed local ``grouping`` (None: follow ``Plan.groupings``)."""

    devices: tuple[str, ...]
    peer_args: tuple[str, ...]
    slot_max_layers: int
    grouping: Optional[tuple[int, ...]] = None
    tp_degrees: tuple[int, ...] = ()
    memory_bytes: int = 1 << 30  # per slot, as offered
    refresh_s: float = 1.0
    logdir: Optional[Path] = None
