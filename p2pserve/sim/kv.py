"""The scheduler's KV-cache estimate (Helix §5.2) and the offline feeder's usage measure.

When a query is routed, each node on its route reserves ``(input + expected_output) * layers``
token-layer entries, ``expected_output = avg_output * ratio``; the reservation is released when
the query finishes. A node is masked for a new query when the reservation would push it past
``hwm * capacity`` (equivalently ``avail - need < (1 - hwm) * capacity``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KvSettings:
    """High-water mark and expected-output ratio (Helix: online 0.9/0.6, offline 0.85/1.0)."""

    hwm: float
    output_ratio: float
    avg_output: int = 240

    @classmethod
    def online(cls) -> "KvSettings":
        """The authors' online settings."""
        return cls(hwm=0.9, output_ratio=0.6)

    @classmethod
    def offline(cls) -> "KvSettings":
        """The authors' offline settings."""
        return cls(hwm=0.85, output_ratio=1.0)


class KvEstimator:
    """Per-node reserved token-layer entries against capacity."""

    def __init__(self, capacity: dict[int, int], settings: KvSettings, layer_capacity: float):
        self.capacity = dict(capacity)
        self.settings = settings
        self.reserved = {i: 0 for i in capacity}
        # Each route runs every layer exactly once, so every layer carries the same reserved
        # tokens (the sum over active queries); the most used layer is the one with the least
        # capacity summed over the nodes holding it. ``layer_capacity`` is that minimum.
        self.layer_capacity = layer_capacity
        self.active_tokens = 0

    def tokens_per_layer(self, input_len: int) -> int:
        """Entries one query reserves per layer it runs."""
        s = self.settings
        return int(input_len + s.avg_output * s.output_ratio)

    def fits(self, node: int, need: int) -> bool:
        """Whether ``need`` more entries keep ``node`` under its high-water mark."""
        return self.reserved[node] + need <= self.settings.hwm * self.capacity[node]

    def reserve(self, query) -> None:
        """Reserve along ``query.route`` and remember what was taken (for release)."""
        per_layer = self.tokens_per_layer(query.input_len)
        need = {}
        for st in query.route:
            amount = per_layer * (st.end - st.start)
            need[st.node] = need.get(st.node, 0) + amount
            self.reserved[st.node] += amount
        query.kv_need = need
        self.active_tokens += per_layer

    def release(self, query) -> None:
        """Give back what :meth:`reserve` took for ``query``."""
        for node, amount in query.kv_need.items():
            self.reserved[node] -= amount
        query.kv_need = {}
        self.active_tokens -= self.tokens_per_layer(query.input_len)

    def free_fraction(self, node: int) -> float:
        """Unreserved share of ``node``'s capacity (token throttling reads it)."""
        cap = self.capacity[node]
        return 1.0 - self.reserved[node] / cap if cap else 0.0

    def max_layer_usage(self) -> float:
        """Reserved share of the most used layer's capacity (offline feeding rule)."""
        return self.active_tokens / self.layer_capacity if self.layer_capacity else 1.0
