"""The model's shape (layers, activation bytes) from the peers' signed announcements. Pure.

A coordinator plans with the model's layer count and the bytes one token's hidden state takes
between two peers. Flags and the swarm file set them, else the model folder ``--model`` names;
a coordinator that knows the model only by name takes them from what its peers announce
(``PeerInfo.num_layers`` / ``activation_bytes``, read from each peer's own checkpoint).

The rule, :func:`agree`: **the shape announced by the most distinct signers wins, if strictly
more signers announce it than any other shape**; a tie decides nothing and the coordinator
waits. Peer ids are bound to the key that signs the record (``dht/acceptance.py``), so each
signer counts once. Why a majority rather than the first record seen: every coordinator reading
the same records adopts the same shape whatever order its reads return them in (two coordinators
taking first-seen shapes could publish plans for different depths), and one stray or hostile
peer among honest ones announcing at the time can neither decide the shape nor stall it (which
refusing every conflict would allow). The coordinator adopts a shape only once it has won every
read for a peer record's lifetime (``service.learn_shape``), so that peers starting together are
all counted. What this does not stop: a majority of Sybil keys outvoting honest peers in an open
swarm, or a hostile peer alone in the swarm when the coordinator starts. An operator who fears
either gives the folder, the flags or the swarm file, which always win.

Once adopted, a shape is kept for the coordinator's life (its plans, and the clients reading
them, depend on the depth); peers announcing another shape are left out of the plan with a
logged reason (:func:`mismatched`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from p2pserve.dht.records import PeerInfo
from p2pserve.types import PeerId


@dataclass(frozen=True, order=True)
class Shape:
    """What the planner needs of a model: its depth and one token's hidden state on the wire.

    ``activation_bytes`` 0 means "not checked" in :func:`mismatched` (the operator set it).
    """

    num_layers: int
    activation_bytes: int

    def __str__(self) -> str:
        return f"{self.num_layers} layers, {self.activation_bytes} activation bytes/token"


def announced(info: PeerInfo) -> Optional[Shape]:
    """The shape a peer's record announces, or None if it announces none (an older peer)."""
    if info.num_layers <= 0 or info.activation_bytes <= 0:
        return None
    return Shape(info.num_layers, info.activation_bytes)


@dataclass(frozen=True)
class Agreement:
    """What :func:`agree` found: the adopted ``shape`` (None: none yet), the peers refused for
    announcing another one (peer id -> reason), and a line saying why, for the log."""

    shape: Optional[Shape]
    reason: str
    refused: dict[str, str] = field(default_factory=dict)


def _short(peer_id: PeerId) -> str:
    return f"...{peer_id[-8:]}"


def agree(peers: Mapping[str, PeerInfo]) -> Agreement:
    """Adopt the shape that strictly more distinct signers announce than any other (see the
    module docstring); ``peers`` maps a signer's peer id to its validated record."""
    by_shape: dict[Shape, list[str]] = {}
    for pid, info in sorted(peers.items()):
        shape = announced(info)
        if shape is not None:
            by_shape.setdefault(shape, []).append(pid)
    if not by_shape:
        silent = f" ({len(peers)} peer(s) announce none)" if peers else ""
        return Agreement(None, f"no peer announces the model's shape yet{silent}")
    ranked = sorted(by_shape.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    listing = "; ".join(f"{s} by {len(ids)} peer(s) {', '.join(map(_short, ids))}" for s, ids in ranked)
    if len(ranked) > 1 and len(ranked[1][1]) == len(ranked[0][1]):
        return Agreement(None, f"peers disagree with no majority: {listing}")
    winner, ids = ranked[0]
    refused = {pid: f"announces {s}; {len(ids)} peer(s) announce {winner}"
               for s, others in ranked[1:] for pid in others}
    return Agreement(winner, f"{winner}, announced by {len(ids)} of {len(peers)} peer(s)"
                     + (f" (conflicting: {listing})" if refused else ""), refused)


def mismatched(peers: Mapping[str, PeerInfo], shape: Shape) -> dict[str, str]:
    """Peers whose announced shape differs from ``shape`` (peer id -> reason). A field the peer
    does not announce, or that ``shape`` leaves unchecked (0), is not compared."""
    out = {}
    for pid, info in peers.items():
        if info.num_layers and info.num_layers != shape.num_layers:
            out[pid] = f"announces {info.num_layers} layers; the plan is for {shape.num_layers}"
        elif info.activation_bytes and shape.activation_bytes and info.activation_bytes != shape.activation_bytes:
            out[pid] = (f"announces {info.activation_bytes} activation bytes/token; the plan is for "
                        f"{shape.activation_bytes}")
    return out
