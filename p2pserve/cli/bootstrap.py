"""``p2pserve bootstrap``: a long-lived DHT node others join through; holds no model.

    p2pserve bootstrap --host-maddrs /ip4/0.0.0.0/tcp/31337 --identity-path bootstrap.id

Prints its multiaddrs (one per line, prefixed ``maddr``) so that they can be pasted as
``--initial-peers`` or into ``initial_peers`` of the swarm config. The node runs the same
signature validator as every member, so it refuses forged records instead of storing them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from p2pserve.cli.common import setup_logging
from p2pserve.config import BootstrapConfig
from p2pserve.config.swarm_file import SwarmFile, merge

logger = logging.getLogger("p2pserve.bootstrap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``p2pserve bootstrap`` (None: not given, the file or the default applies)."""
    parser.add_argument("--config", help="swarm config file; its initial_peers are joined (other bootstrap nodes)")
    parser.add_argument("--initial-peers", nargs="*", default=None, help="other bootstrap nodes to join")
    parser.add_argument("--host-maddrs", nargs="*", default=None,
                        help=f"listen multiaddrs (default {BootstrapConfig.host_maddrs[0]}; use a fixed port)")
    parser.add_argument("--announce-maddrs", nargs="*", default=None, help="public multiaddrs to announce")
    parser.add_argument("--identity-path", default=None, help="libp2p identity file: keeps the peer id (and so the multiaddr) stable")
    parser.add_argument("--maddrs-file", default=None, help="also write the multiaddrs to this file (scripts, tests)")
    parser.add_argument("--no-relay", dest="use_relay", action="store_false", default=None,
                        help="do not act as / use a circuit relay")
    parser.add_argument("--log-level", default="INFO")


def bootstrap_config(args: argparse.Namespace, file: SwarmFile) -> BootstrapConfig:
    """The file's ``initial_peers`` (other bootstrap nodes), overridden by the flags given.

    The file's ``host_maddrs`` are the members' and do not apply: a bootstrap node listens on
    a fixed port.
    """
    flags = {name: getattr(args, name) for name in ("initial_peers", "host_maddrs", "announce_maddrs",
                                                    "identity_path", "use_relay", "maddrs_file")}
    kw = merge({"initial_peers": file.initial_peers}, flags)
    return BootstrapConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in kw.items()})


def _write_maddrs(path: str, maddrs: list[str]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(maddrs) + "\n")
    os.replace(tmp, path)  # readers never see a half-written file


def run(args: argparse.Namespace) -> int:
    """Start the node, print its addresses, wait for SIGINT/SIGTERM."""
    setup_logging(args.log_level)
    from p2pserve.dht.node import BootstrapNode

    config = bootstrap_config(args, SwarmFile.load(args.config))
    node = BootstrapNode.create(config)
    try:
        maddrs = node.visible_maddrs()
        for m in maddrs:
            print(f"maddr {m}", flush=True)
        if config.maddrs_file:
            _write_maddrs(config.maddrs_file, maddrs)
        logger.info(f"bootstrap node {node.peer_id} up; Ctrl-C to stop")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        while not stop.wait(1.0):
            if not node.is_alive():
                logger.error("DHT process died")
                return 1
    finally:
        node.shutdown()
    return 0
