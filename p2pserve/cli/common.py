"""Command-line flags and the swarm file, shared by bootstrap / coordinator / status / peer.

A swarm file (:class:`p2pserve.config.swarm_file.SwarmFile`, see ``bootstrap/swarm.toml``) holds what every
member of a swarm must agree on. Each command turns its flags and the file into its role's config
with :func:`p2pserve.config.swarm_file.merge`: a flag that was given wins, even 0 or empty, so every flag
here defaults to ``None`` ("not given").
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import msgspec

from p2pserve.config import DHTConfig
from p2pserve.config.swarm_file import ModelSettings, SwarmFile, Timing, merge
from p2pserve.errors import ConfigError

# DHTConfig field -> the argparse ``dest`` of its flag (registered by add_dht_arguments)
_DHT_FLAGS = {
    "swarm_id": "swarm_id",
    "initial_peers": "initial_peers",
    "trusted_coordinators": "trusted_coordinator",
    "allowed_peers": "allowed_peers",
    "host_maddrs": "host_maddrs",
    "announce_maddrs": "announce_maddrs",
    "identity_path": "identity_path",
    "key_path": "key_path",
    "use_relay": "use_relay",
    "use_auto_relay": "use_auto_relay",
    "client_mode": "client_mode",
    "peer_refresh": "peer_refresh",
    "link_refresh": "link_refresh",
    "candidate_refresh": "candidate_refresh",
    "plan_refresh": "plan_refresh",
    "max_clock_skew": "max_clock_skew",
    "report_ttl": "report_ttl",
    "evidence_ttl": "evidence_ttl",
}


def add_dht_arguments(parser: argparse.ArgumentParser, *, need_model: bool = True) -> None:
    """Flags every DHT-using command accepts (all default to None: "not given")."""
    g = parser.add_argument_group("swarm")
    g.add_argument("--config", help="swarm config file (.toml or .json): initial peers, trusted coordinators, models")
    if need_model:
        g.add_argument("--model", help="the model: a checkpoint folder, a hub id ORG/NAME (its configs and tokenizer "
                                       "are fetched), 'default' (the embedded SmolLM2), or a bare name; every role "
                                       "derives the swarm's model name from it the same way")
        add_revision_argument(g)
        g.add_argument("--swarm-model", default=None,
                       help="the model's name in the swarm's DHT keys (overrides the swarm file's 'model', which "
                            "overrides the name --model gives: a folder's checkpoint id, a bare name as is)")
    g.add_argument("--initial-peers", nargs="*", default=None, help="multiaddrs of running DHT nodes")
    g.add_argument("--swarm-id", default=None, help="swarm id prefixing every DHT key (default from file or 'p2pserve')")
    g.add_argument("--host-maddrs", nargs="*", default=None, help=f"listen multiaddrs (default {DHTConfig.host_maddrs[0]})")
    g.add_argument("--announce-maddrs", nargs="*", default=None, help="public multiaddrs to announce (behind NAT / port forward)")
    g.add_argument("--identity-path", default=None,
                   help="this node's key as a libp2p identity file: it signs the node's records and fixes its peer "
                        "id (created if missing)")
    g.add_argument("--key-path", default=None,
                   help="the same key as DER (what --print-public-key reads); with --identity-path too, both must "
                        "hold one key (a missing one is written from the other)")
    g.add_argument("--trusted-coordinator", action="append", default=None, metavar="PUBKEY",
                   help="OpenSSH public key of a coordinator whose plans to follow (repeatable)")
    g.add_argument("--allowed-peers", nargs="*", default=None, metavar="PEER_ID",
                   help="admit only these peer ids as members: their peer, link, report and evidence records are "
                        "read, everyone else's dropped (default: an open swarm)")
    g.add_argument("--use-auto-relay", action="store_true", default=None, help="behind NAT: find a relay to be reachable through")
    g.add_argument("--no-relay", dest="use_relay", action="store_false", default=None, help="disable libp2p circuit relay")
    g.add_argument("--client-mode", action="store_true", default=None, help="outgoing connections only (stores nothing for others)")
    t = parser.add_argument_group("timing (seconds; shorten in tests)")
    t.add_argument("--peer-refresh", type=float, default=None)
    t.add_argument("--link-refresh", type=float, default=None)
    t.add_argument("--candidate-refresh", type=float, default=None)
    t.add_argument("--plan-refresh", type=float, default=None)
    t.add_argument("--max-clock-skew", type=float, default=None)
    t.add_argument("--report-ttl", type=float, default=None, help="lifetime of clients' service reports")
    t.add_argument("--evidence-ttl", type=float, default=None, help="lifetime of verification evidence")
    parser.add_argument("--log-level", default="INFO")


def add_revision_argument(group) -> None:
    """``--revision``: the branch, tag or commit of a hub ``--model`` (folded into it as
    ``ORG/NAME@REVISION`` by :func:`fold_revision` before the command runs)."""
    group.add_argument("--revision", default=None,
                       help="branch, tag or commit of a hub --model ORG/NAME (default: main; docs/hub.md)")


def fold_revision(args: argparse.Namespace) -> None:
    """Pin a hub ``--model`` at ``--revision`` (``ORG/NAME@REVISION``), so that every later use
    of ``args.model`` (a child peer's command line included) names the same commit. Raises
    ``ConfigError`` for ``--revision`` with a model that is not a hub id."""
    from p2pserve.model.hub import with_revision

    if getattr(args, "revision", None) is not None:
        args.model = with_revision(getattr(args, "model", None), args.revision)
        args.revision = None


def setup_logging(level: str) -> None:
    """One-line log records with the process id (several roles often share a terminal)."""
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s",
    )


def dht_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The DHTConfig fields as given on the command line (None: not given; lists as tuples).

    Flags a command does not register read as not given, so partial parsers work too.
    """
    out = {}
    for name, dest in _DHT_FLAGS.items():
        v = getattr(args, dest, None)
        out[name] = tuple(v) if isinstance(v, list) else v
    return out


def dht_config(args: argparse.Namespace, file: SwarmFile, model_name: str) -> DHTConfig:
    """The DHTConfig of a command: the swarm file overlaid by the flags given, under the swarm's
    model name ``model_name`` (from :func:`p2pserve.model.identity.swarm_model_name`)."""
    kw = merge(file.dht_values(), dht_flags(args))
    kw["model"] = model_name
    for p in ("identity_path", "key_path"):
        if kw.get(p):
            kw[p] = os.path.expanduser(kw[p])
    return DHTConfig(**kw)


def model_name_from_args(args: argparse.Namespace, file: SwarmFile, spec=None) -> str:
    """The swarm's model name from ``--model``, ``--swarm-model`` and the file's ``model``, by
    the one rule of :mod:`p2pserve.model.identity` (``spec``: the checkpoint's, if loaded).

    A command without a default model (coordinator, status) must be given one of the three.
    """
    from p2pserve.model.identity import swarm_model_name

    model, swarm_model = getattr(args, "model", None), getattr(args, "swarm_model", None)
    if model is None and swarm_model is None and not file.model and spec is None:
        raise ConfigError("no model: pass --model PATH|NAME|default, --swarm-model NAME, or set 'model' in the swarm config")
    return swarm_model_name(model, swarm_model=swarm_model, file_model=file.model, spec=spec)


def dht_config_from_args(args: argparse.Namespace) -> tuple[DHTConfig, SwarmFile]:
    """Load ``--config`` and build the DHTConfig of a command with ``--model``; also returns the
    loaded swarm file."""
    file = SwarmFile.load(getattr(args, "config", None))
    return dht_config(args, file, model_name_from_args(args, file)), file


def write_local_swarm_file(path, spec, boot: list[str], swarm_id: str, host_maddr: str,
                           timing: dict[str, float], solve_time_limit: float,
                           trusted_coordinators: tuple[str, ...] = ()) -> None:
    """Write the JSON swarm file of a swarm started on one machine (demo, tests, benchmarks):
    its id, model, bootstrap addresses, listen address, refresh periods, the coordinator keys
    whose plans members follow (none: an open swarm), and the planner's settings for ``spec``
    (a ``ModelSpec``)."""
    file = SwarmFile(
        swarm_id=swarm_id, model=spec.model_id, initial_peers=tuple(boot), host_maddrs=(host_maddr,),
        trusted_coordinators=tuple(trusted_coordinators), timing=msgspec.convert(dict(timing), Timing),
        models={spec.model_id: ModelSettings(num_layers=spec.num_layers, activation_bytes=spec.activation_bytes_per_token,
                                             solve_time_limit=solve_time_limit)},
    )
    with open(path, "wb") as f:
        f.write(file.to_json())


def add_metrics_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--metrics-port`` / ``--metrics-host``: a Prometheus endpoint (``MetricsConfig``)."""
    m = p.add_argument_group("metrics")
    m.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help=f"serve Prometheus metrics at http://HOST:PORT/metrics ({what}); 0 picks a free port")
    m.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint listens on (default %(default)s; 0.0.0.0 opens it)")


def metrics_config(args: argparse.Namespace):
    """The ``p2pserve.metrics.MetricsConfig`` of the flags of :func:`add_metrics_arguments`."""
    from p2pserve.config import MetricsConfig

    return MetricsConfig(port=args.metrics_port, host=args.metrics_host)
