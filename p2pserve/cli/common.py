"""Command-line flags and swarm config files shared by bootstrap / coordinator / status / peer.

A swarm config file (TOML or JSON, see ``bootstrap/swarm.toml``) holds what every member of a
swarm must agree on: swarm id, initial peers, trusted coordinator keys, and per model its layer
count and activation size. Flags override the file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tomllib
from typing import Any, Optional

from p2pserve.dht.config import DHTConfig
from p2pserve.errors import ConfigError


def load_swarm_file(path: Optional[str]) -> dict[str, Any]:
    """Parse a swarm config file (``.toml`` or ``.json``); ``{}`` when ``path`` is None."""
    if not path:
        return {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read swarm config {path}: {e}") from e
    try:
        if path.endswith(".json"):
            cfg = json.loads(data)
        else:
            cfg = tomllib.loads(data.decode())
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: expected a table at top level")
    return cfg


def write_local_swarm_file(path, spec, boot: list[str], swarm_id: str, host_maddr: str,
                           timing: dict[str, float], solve_time_limit: float,
                           trusted_coordinators: tuple[str, ...] = ()) -> None:
    """Write the JSON swarm file of a swarm started on one machine (demo, tests, benchmarks):
    its id, model, bootstrap addresses, listen address, refresh periods, the coordinator keys
    whose plans members follow (none: an open swarm), and the planner's settings for ``spec``
    (a ``ModelSpec``)."""
    cfg = {
        "swarm_id": swarm_id, "model": spec.model_id, "initial_peers": list(boot), "host_maddrs": [host_maddr],
        "trusted_coordinators": list(trusted_coordinators), "timing": dict(timing),
        "models": {spec.model_id: {"num_layers": spec.num_layers, "activation_bytes": spec.activation_bytes_per_token,
                                   "solve_time_limit": solve_time_limit}},
    }
    with open(path, "w") as f:
        json.dump(cfg, f)


def model_settings(file_cfg: dict, model: str) -> dict[str, Any]:
    """The ``[models."<model>"]`` table of a swarm file (``{}`` if absent)."""
    models = file_cfg.get("models", {})
    if not isinstance(models, dict):
        raise ConfigError("'models' must be a table of tables")
    return dict(models.get(model, {}))


def add_dht_arguments(parser: argparse.ArgumentParser, *, need_model: bool = True) -> None:
    """Flags every DHT-using command accepts."""
    g = parser.add_argument_group("swarm")
    g.add_argument("--config", help="swarm config file (.toml or .json): initial peers, trusted coordinators, models")
    if need_model:
        g.add_argument("--model", help="model name (must match across the swarm; default: the file's 'model')")
    g.add_argument("--initial-peers", nargs="*", default=None, help="multiaddrs of running DHT nodes")
    g.add_argument("--swarm-id", default=None, help="swarm id prefixing every DHT key (default from file or 'p2pserve')")
    g.add_argument("--host-maddrs", nargs="*", default=None, help="listen multiaddrs (default /ip4/0.0.0.0/tcp/0)")
    g.add_argument("--announce-maddrs", nargs="*", default=None, help="public multiaddrs to announce (behind NAT / port forward)")
    g.add_argument("--identity-path", default=None, help="libp2p identity file (stable peer id; created if missing)")
    g.add_argument("--key-path", default=None, help="RSA key (DER) signing this node's records; created if missing")
    g.add_argument("--trusted-coordinator", action="append", default=None, metavar="PUBKEY",
                   help="OpenSSH public key of a coordinator whose plans to follow (repeatable)")
    g.add_argument("--use-auto-relay", action="store_true", help="behind NAT: find a relay to be reachable through")
    g.add_argument("--no-relay", action="store_true", help="disable libp2p circuit relay")
    g.add_argument("--client-mode", action="store_true", help="outgoing connections only (stores nothing for others)")
    t = parser.add_argument_group("timing (seconds; shorten in tests)")
    t.add_argument("--peer-refresh", type=float, default=None)
    t.add_argument("--link-refresh", type=float, default=None)
    t.add_argument("--candidate-refresh", type=float, default=None)
    t.add_argument("--plan-refresh", type=float, default=None)
    t.add_argument("--max-clock-skew", type=float, default=None)
    parser.add_argument("--log-level", default="INFO")


def setup_logging(level: str) -> None:
    """One-line log records with the process id (several roles often share a terminal)."""
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s",
    )


def swarm_membership(args: argparse.Namespace, f: dict[str, Any]) -> dict[str, Any]:
    """Which swarm a member joins: its id, bootstrap addresses and trusted coordinator keys,
    each from its flag if given, else from the swarm file ``f``. Every role, clients included,
    resolves these the same way."""
    peers = args.initial_peers if args.initial_peers is not None else f.get("initial_peers", [])
    trusted = args.trusted_coordinator if args.trusted_coordinator is not None else f.get("trusted_coordinators", [])
    return {"swarm_id": args.swarm_id or f.get("swarm_id", "p2pserve"), "initial_peers": tuple(peers),
            "trusted_coordinators": tuple(trusted)}


def dht_config_from_args(args: argparse.Namespace, *, model: Optional[str] = None) -> tuple[DHTConfig, dict]:
    """Merge the swarm file and flags into a DHTConfig; also returns the parsed file."""
    f = load_swarm_file(getattr(args, "config", None))
    model = model or getattr(args, "model", None) or f.get("model")
    if not model:
        raise ConfigError("no model: pass --model or set 'model' in the swarm config")
    kw: dict[str, Any] = {"model": model, **swarm_membership(args, f)}
    if args.host_maddrs is not None or "host_maddrs" in f:
        kw["host_maddrs"] = tuple(args.host_maddrs if args.host_maddrs is not None else f["host_maddrs"])
    if args.announce_maddrs is not None or "announce_maddrs" in f:
        kw["announce_maddrs"] = tuple(args.announce_maddrs if args.announce_maddrs is not None else f["announce_maddrs"])
    kw["identity_path"] = args.identity_path or f.get("identity_path")
    kw["key_path"] = args.key_path or f.get("key_path")
    kw["use_auto_relay"] = bool(args.use_auto_relay or f.get("use_auto_relay", False))
    kw["use_relay"] = not (args.no_relay or f.get("use_relay", True) is False)
    kw["client_mode"] = bool(args.client_mode or f.get("client_mode", False))
    timing = f.get("timing", {})
    for name in ("peer_refresh", "link_refresh", "candidate_refresh", "plan_refresh", "max_clock_skew",
                 "handover_max_wait"):
        v = getattr(args, name, None)
        if v is None:
            v = timing.get(name)
        if v is not None:
            kw[name] = float(v)
    for p in ("identity_path", "key_path"):
        if kw[p]:
            kw[p] = os.path.expanduser(kw[p])
    return DHTConfig(**kw), f
