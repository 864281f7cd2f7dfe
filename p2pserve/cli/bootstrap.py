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

from p2pserve.cli.common import load_swarm_file, setup_logging

logger = logging.getLogger("p2pserve.bootstrap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``p2pserve bootstrap``."""
    parser.add_argument("--config", help="swarm config file; its initial_peers are joined (other bootstrap nodes)")
    parser.add_argument("--initial-peers", nargs="*", default=None, help="other bootstrap nodes to join")
    parser.add_argument("--host-maddrs", nargs="*", default=["/ip4/0.0.0.0/tcp/31337"],
                        help="listen multiaddrs (default /ip4/0.0.0.0/tcp/31337; use a fixed port)")
    parser.add_argument("--announce-maddrs", nargs="*", default=None, help="public multiaddrs to announce")
    parser.add_argument("--identity-path", default=None, help="libp2p identity file: keeps the peer id (and so the multiaddr) stable")
    parser.add_argument("--maddrs-file", default=None, help="also write the multiaddrs to this file (scripts, tests)")
    parser.add_argument("--no-relay", action="store_true", help="do not act as / use a circuit relay")
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    """Start the node, print its addresses, wait for SIGINT/SIGTERM."""
    setup_logging(args.log_level)
    import hivemind

    from p2pserve.dht.signing import LoggingSignatureValidator, load_or_create_key

    file_cfg = load_swarm_file(args.config)
    peers = args.initial_peers if args.initial_peers is not None else file_cfg.get("initial_peers", [])
    kwargs = dict(
        initial_peers=list(peers),
        start=True,
        host_maddrs=list(args.host_maddrs),
        record_validators=[LoggingSignatureValidator(load_or_create_key(None))],
        use_relay=not args.no_relay,
    )
    if args.announce_maddrs:
        kwargs["announce_maddrs"] = list(args.announce_maddrs)
    if args.identity_path:
        kwargs["identity_path"] = args.identity_path
    dht = hivemind.DHT(**kwargs)
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        for m in maddrs:
            print(f"maddr {m}", flush=True)
        if args.maddrs_file:
            tmp = args.maddrs_file + ".tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(maddrs) + "\n")
            os.replace(tmp, args.maddrs_file)  # readers never see a half-written file
        logger.info(f"bootstrap node {dht.peer_id.to_base58()} up; Ctrl-C to stop")
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        while not stop.wait(1.0):
            if not dht.is_alive():
                logger.error("DHT process died")
                return 1
    finally:
        dht.shutdown()
    return 0
