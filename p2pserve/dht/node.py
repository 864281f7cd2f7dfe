"""Starting hivemind DHT nodes: a member's (behind :class:`~p2pserve.dht.swarm.Swarm`) and a
bootstrap node's, each with our signature validator so that forged records are refused."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import hivemind

from p2pserve.config import BootstrapConfig
from p2pserve.dht.signing import LoggingSignatureValidator, load_or_create_key

logger = logging.getLogger(__name__)


def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    private_key=None,
    announce_maddrs: Sequence[str] = (),
    identity_path: Optional[str] = None,
    use_relay: bool = True,
    use_auto_relay: bool = False,
    client_mode: bool = False,
) -> hivemind.DHT:
    """Start a hivemind DHT node (blocks ~1-3 s). ``private_key`` is the RSA key the node signs
    with (an ephemeral one if None); ``announce_maddrs`` / ``identity_path`` are optional."""
    kwargs = dict(
        initial_peers=list(initial_peers),
        start=True,
        record_validators=[LoggingSignatureValidator(private_key or load_or_create_key(None))],
        host_maddrs=list(host_maddrs),
        use_relay=use_relay,
        use_auto_relay=use_auto_relay,
        client_mode=client_mode,
    )
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    if identity_path:
        kwargs["identity_path"] = identity_path
    return hivemind.DHT(**kwargs)


class BootstrapNode:
    """A long-lived DHT node others join through; it holds no model and announces nothing.

    It runs the same signature validator as every member, so it refuses forged records instead
    of storing them. ``__init__`` does no I/O; :meth:`create` starts the node.
    """

    def __init__(self, config: BootstrapConfig, dht: hivemind.DHT):
        self.config = config
        self.dht = dht

    @classmethod
    def create(cls, config: BootstrapConfig) -> "BootstrapNode":
        """Start the node for ``config``."""
        return cls(config, start_dht(initial_peers=config.initial_peers, host_maddrs=config.host_maddrs,
                                     announce_maddrs=config.announce_maddrs, identity_path=config.identity_path,
                                     use_relay=config.use_relay))

    @property
    def peer_id(self) -> str:
        """This node's libp2p peer id (base58)."""
        return self.dht.peer_id.to_base58()

    def visible_maddrs(self) -> list[str]:
        """Multiaddrs others can use as ``initial_peers``."""
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def is_alive(self) -> bool:
        """Whether the DHT process still runs."""
        return self.dht.is_alive()

    def shutdown(self) -> None:
        """Stop the DHT node."""
        self.dht.shutdown()
