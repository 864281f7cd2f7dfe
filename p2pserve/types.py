"""The names every layer of p2pserve shares, each defined once.

Pure Python, no third-party imports: the planner, the simulator, the router and the wire structs
all import from here.
"""

from __future__ import annotations

from typing import Dict, Final, Tuple

#: A peer's libp2p peer id, base58 text (``12D3Koo...``).
PeerId = str
#: A session id on one hop, chosen by the client.
SessionId = str
#: A half-open range of transformer layers ``[start, end)``.
LayerRange = Tuple[int, int]
#: Which layers each peer holds (or is told to hold).
Placement = Dict[PeerId, LayerRange]

#: The pseudo-nodes of the flow graph in routes, flows and wire records: clients send tokens
#: from ``SOURCE`` and receive them at ``SINK``.
SOURCE: Final = "source"
SINK: Final = "sink"

#: The same two pseudo-nodes as node indices of a placement topology, whose real nodes are
#: ``0..n-1`` (link tables and flow graphs are keyed by index there).
SOURCE_INDEX: Final = -1
SINK_INDEX: Final = -2
