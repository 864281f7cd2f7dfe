"""Starting hivemind DHT nodes: a member's (behind :class:`~p2pserve.dht.swarm.Swarm`) and a
bootstrap node's, each with our signature validator so that forged records are refused."""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Sequence

import hivemind
from hivemind.utils.crypto import RSAPrivateKey

from p2pserve.config import BootstrapConfig
from p2pserve.dht.identity import identity_file, node_key, peer_id_of, read_identity
from p2pserve.dht.signing import LoggingSignatureValidator, load_or_create_key, public_key_text
from p2pserve.errors import ConfigError
from p2pserve.parent_watch import children_die_with_us, end_with_parent

logger = logging.getLogger(__name__)


class OwnedDHT(hivemind.DHT):
    """A hivemind DHT node whose process, and the libp2p daemon it starts, end with the process
    that started it (``p2pserve/parent_watch.py``): a SIGKILLed peer, coordinator or client
    leaves nothing running."""

    def run(self) -> None:
        """The DHT process's body: hivemind's, with its parent watched and its daemon tied to it."""
        end_with_parent()
        with children_die_with_us():
            super().run()


def start_dht(
    *,
    initial_peers: Sequence[str],
    host_maddrs: Sequence[str],
    private_key: Optional[RSAPrivateKey] = None,
    announce_maddrs: Sequence[str] = (),
    identity_path: Optional[str] = None,
    use_relay: bool = True,
    use_auto_relay: bool = False,
    client_mode: bool = False,
    key_dir: Optional[str] = None,
    record_validator: Optional[LoggingSignatureValidator] = None,
) -> hivemind.DHT:
    """Start a hivemind DHT node (blocks ~1-3 s) whose libp2p identity is ``private_key``, the RSA
    key it signs its records with, so that its peer id is ``peer_id_of`` its public key.

    ``identity_path``, if given, must hold ``private_key`` (see :func:`~p2pserve.dht.identity.node_key`;
    ``private_key=None`` then reads it from there); otherwise the key (an ephemeral one if None)
    reaches hivemind through a private temporary identity file, deleted once the node runs
    (created in ``key_dir``, the persistent key's directory, if given). ``record_validator``
    replaces the default signature validator (:mod:`p2pserve.dht.multi_identity`).
    """
    if private_key is None:
        private_key = read_identity(identity_path) if identity_path else load_or_create_key(None)
    kwargs = dict(
        initial_peers=list(initial_peers),
        start=True,
        record_validators=[record_validator or LoggingSignatureValidator(private_key)],
        host_maddrs=list(host_maddrs),
        use_relay=use_relay,
        use_auto_relay=use_auto_relay,
        client_mode=client_mode,
    )
    if announce_maddrs:
        kwargs["announce_maddrs"] = list(announce_maddrs)
    with contextlib.ExitStack() as stack:
        if identity_path is None:
            # a key of our own has no other node to collide with: skip hivemind's identity check,
            # which starts a second libp2p daemon to look for one
            kwargs.update(identity_path=stack.enter_context(identity_file(private_key, key_dir)),
                          check_if_identity_free=False)
        else:
            kwargs["identity_path"] = identity_path
        dht = OwnedDHT(**kwargs)  # p2pd has read the identity file once this returns
    expected = peer_id_of(public_key_text(private_key))
    if dht.peer_id.to_base58() != expected:
        dht.shutdown()
        raise ConfigError(f"the DHT node runs as {dht.peer_id.to_base58()}, not as its signing key's {expected}")
    return dht


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
        key = node_key(None, config.identity_path)
        return cls(config, start_dht(initial_peers=config.initial_peers, host_maddrs=config.host_maddrs,
                                     private_key=key, announce_maddrs=config.announce_maddrs,
                                     identity_path=config.identity_path, use_relay=config.use_relay))

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
