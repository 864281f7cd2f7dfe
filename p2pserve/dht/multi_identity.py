"""Many signed identities on one DHT node: how a synthetic swarm of hundreds of peers runs on a
machine that cannot start a process (and a libp2p daemon) per peer.

Every record is stored under its owner's subkey and signed by the owner's key
(:mod:`p2pserve.dht.signing`); hivemind signs a record inside the node that stores it, with the
node's validator. :class:`MultiKeyValidator` holds several keys and signs each record with the
key its subkey names, so one node can store the records of every identity it holds. Readers
cannot tell: each record carries its owner's valid signature, exactly as if its own node had
stored it. :func:`identity_swarms` gives one :class:`~p2pserve.dht.swarm.Swarm` per identity on
that shared node. For tests and benchmarks only: the keys live in one process.
"""

from __future__ import annotations

from typing import Sequence

from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPrivateKey

from p2pserve.config import DHTConfig
from p2pserve.dht.node import start_dht
from p2pserve.dht.signing import LoggingSignatureValidator
from p2pserve.dht.swarm import Swarm


class MultiKeyValidator(LoggingSignatureValidator):
    """The signature validator, signing with whichever held key a record's subkey names."""

    def __init__(self, node_key: RSAPrivateKey, keys: Sequence[RSAPrivateKey]) -> None:
        super().__init__(node_key)
        self._keys = {k.get_public_key().to_bytes(): k for k in keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        """Sign with the key named in the subkey, if held; else as the node itself."""
        for public in self._PUBLIC_KEY_RE.findall(record.subkey or b""):
            key = self._keys.get(public)
            if key is not None:
                signature = key.sign(self._serialize_record(record))
                return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)
        return super().sign_value(record)


def identity_swarms(config: DHTConfig, keys: Sequence[RSAPrivateKey]) -> list[Swarm]:
    """One DHT node (its own key: the first of ``keys``) storing for every key; a Swarm per key."""
    node_key = keys[0]
    dht = start_dht(initial_peers=config.initial_peers, host_maddrs=config.host_maddrs, private_key=node_key,
                    record_validator=MultiKeyValidator(node_key, keys))
    return [Swarm(config, dht, k) for k in keys]
