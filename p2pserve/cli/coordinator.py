"""``p2pserve coordinator``: run a placement coordinator (an election candidate).

    p2pserve coordinator --config bootstrap/swarm.toml --model M --key-path ~/.p2pserve/coord.key
    p2pserve coordinator --model /models/Llama-3.1-8B-Instruct --initial-peers /ip4/.../p2p/Qm...

``--model`` names the model as every role does (``p2pserve/model/identity.py``): a checkpoint
folder, whose config.json also gives the layer count and activation size, or a bare name, whose
shape comes from ``--num-layers``/``--activation-bytes``, the swarm file, or else the peers' signed
announcements (``p2pserve/coordinator/shape.py``).
    p2pserve coordinator --print-public-key --key-path ~/.p2pserve/coord.key   # for trusted_coordinators
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal

from p2pserve.cli.common import (add_dht_arguments, add_metrics_arguments, dht_config, metrics_config,
                                 model_name_from_args, setup_logging)
from p2pserve.config import ComputeProbeConfig, CoordinatorConfig
from p2pserve.config.swarm_file import SwarmFile, merge
from p2pserve.errors import ConfigError, UnknownModelError

logger = logging.getLogger("p2pserve.coordinator")

# CoordinatorConfig fields that have a flag of the same name (and may be set per model in the file)
_FLAGS = ("num_layers", "activation_bytes", "replan_period", "link_change_threshold", "objective",
          "solve_time_limit", "priority", "coordinator_id", "check_claims", "claim_slack", "claim_batch",
          "min_report_samples", "min_reporter_addresses", "max_rtt_credit", "unobserved_share", "unobserved_total_share",
          "cold_claim_slack", "max_peers_per_address", "trusted_verifiers", "trust_verifiers",
          "retrial_replicas", "exclusion_s", "grouping")


def publish_guard(args: argparse.Namespace):
    """The publish guard's check factory (a short simulation of each round's topology), or None."""
    if not getattr(args, "publish_guard", True):
        return None
    from p2pserve.sim.plan_check import live_check  # the simulator loads only when asked for

    return live_check()


def add_arguments(parser: argparse.ArgumentParser) -> None:  # long: a flat list of flags, one per call
    """Flags of ``p2pserve coordinator`` (None: not given, the file or the default applies); the
    defaults their help names are the dataclasses'."""
    D, P = CoordinatorConfig(num_layers=1), ComputeProbeConfig()
    add_dht_arguments(parser)
    c = parser.add_argument_group("coordinator")
    c.add_argument("--priority", type=int, default=None, help=f"election priority (higher leads; default {D.priority})")
    c.add_argument("--coordinator-id", default=None, help="election id (default: libp2p peer id)")
    c.add_argument("--num-layers", type=int, default=None,
                   help="model layers (default: the swarm file, else the --model folder's config.json, else what "
                        "a majority of the peers announce)")
    c.add_argument("--activation-bytes", type=int, default=None,
                   help="bytes per token of hidden state (default: as --num-layers; the folder's at fp32)")
    c.add_argument("--replan-period", type=float, default=None, help=f"re-plan at least this often (s; default {D.replan_period:g})")
    c.add_argument("--link-change-threshold", type=float, default=None, help=f"relative bandwidth change that re-plans (default {D.link_change_threshold:g})")
    c.add_argument("--objective", choices=("throughput", "max-flow"), default=None, help=f"planner objective (default {D.objective})")
    c.add_argument("--grouping", default=None, metavar="auto|1|2|4|8",
                   help="how machine agents (p2pserve machine) group their slots into tensor-parallel peers: auto "
                        "(default) chooses per machine by the cost model and the planner, a number fixes the TP "
                        "degree (docs/machine-agent.md)")
    c.add_argument("--solve-time-limit", type=float, default=None, help=f"seconds per placement solve (default {D.solve_time_limit:g})")
    c.add_argument("--publish-guard", action=argparse.BooleanOptionalAction, default=True,
                   help="simulate each placement before publishing it, against the heuristic baselines (full solves) "
                        "or the current placement (churn moves); runs when every peer announces its latency and KV "
                        "capacity (default: on; docs/planner.md, \"The publish guard\")")
    t = parser.add_argument_group("claims (docs/trust.md, \"Claims\")")
    t.add_argument("--check-claims", action=argparse.BooleanOptionalAction, default=None,
                   help="cap claimed throughput by the service rates clients report "
                        f"(default {'on' if D.check_claims else 'off'})")
    t.add_argument("--claim-slack", type=float, default=None, help=f"effective = min(claim, SLACK x observed); default {D.claim_slack:g}")
    t.add_argument("--claim-batch", type=int, default=None,
                   help="sessions a claimed throughput is profiled at (observed per-session rates are scaled by it); "
                        f"default {D.claim_batch}")
    t.add_argument("--min-report-samples", type=int, default=None, help=f"decode samples a report needs to count; default {D.min_report_samples}")
    t.add_argument("--min-reporter-addresses", type=int, default=None,
                   help=f"a peer counts as observed only by reports from this many addresses; default {D.min_reporter_addresses}")
    t.add_argument("--max-rtt-credit", type=float, default=None,
                   help=f"most a report's RTT correction may raise its rate over the wall-clock rate; default {D.max_rtt_credit:g}")
    t.add_argument("--unobserved-share", type=float, default=None,
                   help=f"a peer nobody observed is capped at this x the median observed rate; default {D.unobserved_share:g}")
    t.add_argument("--unobserved-total-share", type=float, default=None,
                   help="peers nobody observed together get at most this x the observed peers' total; "
                        f"default {D.unobserved_total_share:g}")
    t.add_argument("--cold-claim-slack", type=float, default=None,
                   help=f"before any report, claims are capped at this x the median claim; default {D.cold_claim_slack:g}")
    t.add_argument("--max-peers-per-address", type=int, default=None,
                   help="open swarms: at most N peers per announced IP get flow "
                        f"(default {D.max_peers_per_address}; 0: no cap)")
    t.add_argument("--compute-probe-interval", type=float, default=P.interval_s, metavar="S",
                   help="the leader times a few decode steps of each peer itself at most every S seconds, as an "
                        "ordinary session from an identity of its own, and caps claims by it (0: off; default %(default)g)")
    t.add_argument("--compute-probe-steps", type=int, default=P.steps, metavar="N",
                   help="timed decode steps per probe (default %(default)s)")
    c.add_argument("--print-public-key", action="store_true", help="print this coordinator's public key and exit")
    v = parser.add_argument_group("output verification (docs/trust.md)")
    v.add_argument("--trusted-verifier", dest="trusted_verifiers", action="append", default=None, metavar="KEY|PEER_ID",
                   help="a verifier whose evidence alone excludes a peer: the OpenSSH public key of its DHT "
                        "records, or its peer id (repeatable)")
    v.add_argument("--no-trust-verifiers", dest="trust_verifiers", action="store_const", const=False, default=None,
                   help="ignore --trusted-verifier: only the coordinator's own re-execution of accused steps excludes a peer")
    v.add_argument("--retrial-replicas", type=int, default=None,
                   help="replicas the coordinator re-executes an accused step on, which must all agree against "
                        f"the accused before it is excluded (default {D.retrial_replicas}; 0: only trusted verifiers exclude)")
    v.add_argument("--exclusion-s", type=float, default=None,
                   help=f"how long an exclusion lasts after its last evidence (default {D.exclusion_s:g} s)")
    w = parser.add_argument_group("web dashboard (docs/dashboard.md)")
    w.add_argument("--web-port", type=int, default=None,
                   help="also serve the live swarm dashboard on this TCP port (0 = a free one; page at /, "
                        "JSON at /api/swarm)")
    w.add_argument("--web-host", default="127.0.0.1", help="address the dashboard listens on (default %(default)s)")
    add_metrics_arguments(parser, "the p2pserve_coordinator_* series of docs/metrics.md; off by default")


def coordinator_config(args: argparse.Namespace, file: SwarmFile, model: str, shape=None) -> CoordinatorConfig:
    """The file's ``[models."<model>"]`` settings, overridden by every flag given; ``shape`` (a
    ``coordinator.shape.Shape``: the model folder's, or the peers') fills what neither sets."""
    base = {"num_layers": shape.num_layers, "activation_bytes": shape.activation_bytes} if shape else {}
    kw = merge(base, merge(file.model_settings(model).values(), {name: getattr(args, name, None) for name in _FLAGS}))
    if "num_layers" not in kw:
        raise ConfigError(f"number of layers of {model} unknown: pass --num-layers or set [models.\"{model}\"] num_layers")
    if kw.get("trusted_verifiers") is not None:
        kw["trusted_verifiers"] = tuple(kw["trusted_verifiers"])
    return CoordinatorConfig(**kw)


def operator_shape(args: argparse.Namespace, file: SwarmFile, model: str) -> dict:
    """The shape fields the flags or the swarm file set (they win over the folder and the peers)."""
    kw = merge(file.model_settings(model).values(), {name: getattr(args, name, None) for name in _FLAGS})
    return {k: kw[k] for k in ("num_layers", "activation_bytes") if k in kw}


def folder_shape(model: str | None):
    """The ``Shape`` of the checkpoint folder ``--model`` names (fp32 activations, as a peer's
    default dtype), or None for a bare name (``p2pserve/model/identity.py``)."""
    from p2pserve.coordinator.shape import Shape
    from p2pserve.model.identity import checkpoint_of
    from p2pserve.model.spec import load_spec

    folder = checkpoint_of(model) if model is not None else None
    if folder is None:
        return None
    spec = load_spec(folder)
    return Shape(spec.num_layers, spec.activation_bytes_per_token)


async def _own_node():
    """A libp2p node with an identity of its own, not the coordinator's: the compute probes and
    retrials it carries look like any client's sessions."""
    from p2pserve.protocol import FrameLimits
    from p2pserve.transport.libp2p import Libp2pTransport
    from p2pserve.transport.tcp import DirectTransport

    return DirectTransport(await Libp2pTransport.create(host_maddrs=("/ip4/0.0.0.0/tcp/0",)), FrameLimits())


def compute_prober(args: argparse.Namespace, name: str):
    """The leader's compute prober (``coordinator/compute_probe.py``), or None with an interval of 0.
    Sessions are opened for the model id each peer announces (``PeerInfo.model_id``), else the
    ``--model`` folder's model id, else the swarm's model name without its ``@SCHEME`` suffix."""
    from p2pserve.coordinator.compute_probe import ComputeProber
    from p2pserve.model.identity import checkpoint_of
    from p2pserve.model.spec import load_spec

    if args.compute_probe_interval <= 0:
        return None
    if args.compute_probe_steps < 1:
        raise ConfigError("--compute-probe-steps must be >= 1")
    folder = checkpoint_of(args.model) if getattr(args, "model", None) is not None else None
    model_id = load_spec(folder).model_id if folder is not None else name.split("@")[0]
    cfg = ComputeProbeConfig(interval_s=args.compute_probe_interval, steps=args.compute_probe_steps)
    return ComputeProber(_own_node, model_id, cfg)


def retrials(cfg: CoordinatorConfig, prober):
    """The leader's retrials of accused steps (``coordinator/retrial.py``), through the prober's
    node when it has one, else a node of their own; None with ``retrial_replicas`` 0."""
    from p2pserve.coordinator.retrial import Retrials

    if cfg.retrial_replicas <= 0:
        return None
    if prober is not None:
        return Retrials(prober.node, cfg.retrial_replicas)
    node = []

    async def own():
        if not node:
            node.append(await _own_node())
        return node[0]

    return Retrials(own, cfg.retrial_replicas)


def _print_public_key(key_path: str | None) -> int:
    from p2pserve.dht.signing import load_or_create_key, public_key_text

    if not key_path:
        print("--print-public-key needs --key-path (an ephemeral key cannot be trusted)")
        return 2
    print(public_key_text(load_or_create_key(key_path)))
    return 0


def web_dashboard(args: argparse.Namespace, swarm, dcfg, ccfg: CoordinatorConfig):
    """The dashboard of ``--web-port`` over this coordinator's swarm view (an async context)."""
    from p2pserve.config import DashboardConfig
    from p2pserve.dashboard.server import serving
    from p2pserve.dashboard.watch import SwarmWatch

    config = DashboardConfig(host=args.web_host, port=args.web_port)
    trusted = tuple(ccfg.trusted_verifiers) if ccfg.trust_verifiers else ()
    watch = SwarmWatch(swarm, config, source="coordinator", model=dcfg.model, swarm_id=dcfg.swarm_id,
                       num_layers=ccfg.num_layers, trusted_verifiers=trusted)
    return serving(watch, config)


def run(args: argparse.Namespace) -> int:
    """Entry point; returns the exit code."""
    setup_logging(args.log_level)
    if args.print_public_key:
        return _print_public_key(args.key_path)
    from p2pserve.dht.swarm import Swarm

    try:
        file = SwarmFile.load(args.config)
        name = model_name_from_args(args, file)
        dcfg = dht_config(args, file, name)
        given = operator_shape(args, file, name)
        # the shape: flags and file, else the folder --model names, else the peers' announcements
        shape = folder_shape(args.model)
        ccfg = coordinator_config(args, file, name, shape) if shape or "num_layers" in given else None
        if ccfg is not None:
            dcfg = dataclasses.replace(dcfg, num_layers=ccfg.num_layers)
        mcfg = metrics_config(args)
    except (ConfigError, UnknownModelError) as e:
        print(f"error: {e}")
        return 2

    swarm = Swarm.create(dcfg)
    try:
        asyncio.run(_serve(swarm, args, file, name, given, ccfg, mcfg))
    except ConfigError as e:  # found only once serving: a dashboard or metrics port already in use
        print(f"error: {e}")
        return 2
    finally:
        swarm.shutdown()
    return 0


async def _serve(swarm, args: argparse.Namespace, file: SwarmFile, name: str, given: dict,
                 cfg: CoordinatorConfig | None, mcfg) -> None:
    """Run the service until signalled; with no ``cfg`` yet, learn the shape from the peers first."""
    from p2pserve.coordinator.service import CoordinatorService, learn_shape
    from p2pserve.coordinator.shape import Shape
    from p2pserve.metrics import serve_metrics

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # the peers' agreed shape holds the rest to their activation size; a folder's is a guess at
    # fp32 (peers may run bf16), and one the operator set is theirs: neither is compared
    from_peers = cfg is None
    if cfg is None:
        logger.info(f"{name} is not a model folder and no --num-layers is set: taking the model's shape from the "
                    "peers' announcements")
        learned = await learn_shape(swarm, stop, swarm.config.peer_refresh, settle=swarm.config.peer_ttl)
        if learned is None:
            return
        cfg = coordinator_config(args, file, name, learned)
        swarm.config = dataclasses.replace(swarm.config, num_layers=cfg.num_layers)
    # Peers announcing another shape are left out of the plan (readers drop other depths anyway).
    checked = from_peers and "activation_bytes" not in given
    prober = compute_prober(args, name)
    service = CoordinatorService(swarm, cfg, shape=Shape(cfg.num_layers, cfg.activation_bytes if checked else 0),
                                 prober=prober, retrials=retrials(cfg, prober), plan_check=publish_guard(args))
    metrics = serve_metrics(service.metrics.registry, mcfg) if mcfg.port is not None else None
    if metrics is not None:
        print(f"P2PSERVE_METRICS_READY url={metrics.url}", flush=True)
    logger.info(
        f"coordinator {service.coordinator_id} for {name} ({cfg.num_layers} layers, {cfg.activation_bytes} "
        f"activation bytes/token; priority {cfg.priority}); public key {swarm.public_key[:40]}...; "
        f"listening on {' '.join(swarm.visible_maddrs())}"
    )
    try:
        if args.web_port is None:
            await service.run(stop)
            return
        async with web_dashboard(args, swarm, swarm.config, cfg):
            await service.run(stop)
    finally:
        if metrics is not None:
            metrics.close()
