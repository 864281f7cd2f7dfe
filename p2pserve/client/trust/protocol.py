"""``StepTrust``: the one interface a pipeline has to the trust machinery (and ``HopObserver``,
the timing of hops for the service reports).

A pipeline holds one per generation (None: nothing is verified). It asks it which peers to
leave out of a route, tells it when a route opens and is left, hands it each hop's exchange
of a step while the route records them (``taping``), and calls :meth:`StepTrust.after_step`
once per step. The generation asks it from which output on a caught peer's work must be
regenerated. Nothing here imports the implementation (``trust/session.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from p2pserve.client.connection import HopConnection
    from p2pserve.client.routing import Masks
    from p2pserve.protocol import SamplingParams


class HopObserver(Protocol):
    """Times hops for the service reports (``trust/observer.py``: what clients observe of peers'
    claimed rates)."""

    def rtt(self, peer_id: str, layers: int, seconds: float) -> None:
        """A session of ``layers`` layers on ``peer_id`` opened in ``seconds`` (the link's RTT)."""

    def decode(self, peer_id: str, layers: int, seconds: float) -> None:
        """A one-token step of ``layers`` layers on ``peer_id`` took ``seconds``, round trip."""


class StepTrust(Protocol):
    """What verification needs from, and gives to, one pipeline."""

    @property
    def taping(self) -> bool:
        """Whether the current route's exchanges are recorded (such a route is never pushed:
        the client must see every hop's reply)."""

    def masks(self, masks: "Masks") -> "Masks":
        """``masks`` with the peers this client caught banned."""

    def route_opened(self, links: Sequence["HopConnection"]) -> None:
        """A route's sessions are open on ``links`` (route order)."""

    def forked(self, parent: Optional["StepTrust"], positions: int) -> None:
        """The route just opened forks ``parent``'s sessions at ``positions``: their inputs before
        it are this route's past too (or, when ``parent`` kept none, the route goes unrecorded)."""

    def record(self, hop: int, position: int, count: int, dtype: str, inputs, reply, payload, context=None,
               allowed=None) -> None:
        """Hop ``hop`` of the route was sent ``inputs`` (``count`` positions from ``position``,
        as ``dtype`` bytes; a last hop also ``context`` and ``allowed``) and answered ``reply``
        with ``payload`` (references, not copies)."""

    def after_step(self, sampling: "SamplingParams") -> None:
        """A step went through the whole route: draw which of its hops to check."""

    def route_done(self) -> None:
        """The pipeline leaves the route (request done, or failover): its drawn checks start."""

    def rollback_from(self) -> Optional[int]:
        """The first output position a caught peer touched (to generate again), or None."""

    def forget_caught(self) -> None:
        """The outputs of the caught peers were withdrawn: stop tracking those peers."""

    async def settle(self) -> None:
        """Wait for every check drawn on this pipeline's steps (``ClientConfig.verify_hold``)."""
