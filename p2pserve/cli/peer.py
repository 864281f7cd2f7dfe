"""`p2pserve peer`: serve layers of a model over hivemind's libp2p transport.

Two modes:

* fixed: ``--layers START:END`` serves that range (the mode tests and the inference path use);
  with ``--initial-peers`` it also announces itself so coordinators can route over it;
* plan-driven: no ``--layers`` but ``--initial-peers``: the peer profiles itself, probes its
  links, announces, and loads whatever range the elected coordinator's plan assigns it.

Once serving (or, plan-driven, once announced) it prints one machine-readable line::

    P2PSERVE_PEER_READY peer_id=<id> layers=<start>:<end>|none maddrs=<maddr>[,<maddr>...]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from p2pserve.dtypes import MODEL_DTYPES
from p2pserve.config import AdmissionConfig, BatchingConfig, PeerConfig
from p2pserve.errors import ConfigError, P2PServeError
from p2pserve.model.quant import require_backend
from p2pserve.protocol import FrameLimits


def parse_layers(text: str) -> tuple[int, int]:
    """Parse 'START:END' (half-open) into a tuple."""
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes START:END, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:  # long: a flat list of flags, one per call
    """Register the peer's flags (swarm flags come from the DHT layer)."""
    from p2pserve.cli.common import add_dht_arguments, add_metrics_arguments, add_revision_argument

    d = PeerConfig()
    b = BatchingConfig()
    p.add_argument("--model", default="default",
                   help="checkpoint directory, a hub id ORG/NAME (only the weight files of the layers served are "
                        "fetched; docs/hub.md), or 'default' (embedded SmolLM2-135M-Instruct)")
    add_revision_argument(p)
    p.add_argument("--layers", type=parse_layers, default=None, metavar="START:END",
                   help="serve this fixed half-open layer range (default: whole model, or the plan's range with --initial-peers)")
    _add_device_arguments(p)
    p.add_argument("--swarm-model", default=None, help="model name in the swarm's DHT keys (default: the swarm file's 'model', else the checkpoint "
                        "id; the rule every role shares: p2pserve/model/identity.py)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--compile-buckets", type=lambda v: tuple(int(x) for x in v.split(",")), default=(), metavar="B,B,...",
                   help="run each layer's dense parts compiled by torch.compile, per batch bucket (e.g. 1,8,32), compiled "
                        "when the layers load (minutes on a CPU; docs/engine.md); default: eager")
    p.add_argument("--max-layers", type=int, default=None, help="most layers this peer may hold (default: from --weights-memory-gb)")
    p.add_argument("--weights-memory-gb", type=float, default=d.weights_memory_bytes / 1024**3, help="memory for weights (a tensor-parallel group's total)")
    p.add_argument("--profile-batch", type=int, default=d.profile_batch,
                   help="concurrent sessions the announced decode throughput T[j] assumes")
    p.add_argument("--kv-memory-gb", type=float, default=d.kv_memory_bytes / 1024**3, help="memory for the KV cache (a tensor-parallel group's total)")
    p.add_argument("--kv-token-layers", type=int, default=None, help="KV budget in token-layer slots (overrides --kv-memory-gb)")
    p.add_argument("--session-idle-timeout", type=float, default=d.session_idle_timeout_s, help="seconds before an idle session is freed")
    p.add_argument("--max-payload-mb", type=float, default=d.frame_limits.max_payload_bytes / 1024**2, help="largest accepted frame payload")
    p.add_argument("--max-batch-tokens", type=int, default=b.max_batch_tokens, help="hard cap on tokens per compute step")
    p.add_argument("--pipeline-depth", type=int, default=b.pipeline_depth,
                   help="micro-batches in flight (gLLM): this peer spreads its decodes over this many steps "
                        "(default: 1 while it holds every layer, 2 while it is one stage of a pipeline of several "
                        "peers; docs/engine.md)")
    p.add_argument("--prefill-throttle", default="on", choices=["on", "off"],
                   help="gLLM token throttling: split waiting prompts into chunks under each step's prefill "
                        "budget, spread over --pipeline-depth steps (on), or run every waiting prompt whole in "
                        "the next step (off; up to --max-batch-tokens)")
    p.add_argument("--min-prefill-tokens", type=int, default=b.min_prefill_tokens, metavar="N",
                   help="gLLM's #MinP: the smallest prompt chunk a throttled step takes (default %(default)s; "
                        "larger floors cut time to first token, and the simulator favours 128-256 across regions: "
                        "docs/sim.md, section 4)")
    p.add_argument("--batch-wait-ms", type=float, default=b.max_batch_wait_s * 1000, metavar="MS",
                   help="batch forming: hold a step at most this long (and at most one recent step's compute "
                        "time) for sessions whose next Forward is due; 0 (default) runs each step on the first arrival")
    p.add_argument("--direct-port", type=int, default=d.direct_port, metavar="PORT",
                   help="TCP port of the direct path, which clients that reach this host use instead of "
                        "libp2p (lower latency; TLS 1.3 pinned through libp2p); 0 picks a free port")
    p.add_argument("--no-direct", action="store_true", help="serve sessions over libp2p only")
    p.add_argument("--direct-announce-port", type=int, default=None, metavar="PORT",
                   help="port that direct offers name instead of --direct-port: a relay or a port forward on the hosts "
                        "of --announce-maddrs that leads to it (needs a fixed --direct-port); with --announce-maddrs "
                        "the direct path binds the --host-maddrs hosts")
    a = d.admission
    p.add_argument("--max-sessions-per-owner", type=int, default=a.max_sessions_per_owner,
                   help="sessions one remote peer id may hold here")
    p.add_argument("--max-kv-fraction-per-owner", type=float, default=a.max_kv_fraction_per_owner,
                   help="share of the KV budget one remote peer id may hold (1 turns the quota off)")
    p.add_argument("--prefix-sharing", choices=("owner", "global"), default=a.prefix_sharing,
                   help="share KV prefix blocks within one remote peer id's sessions (default), or between "
                        "everyone's: faster for a common system prompt, but it tells who cached what (docs/trust.md)")
    p.add_argument("--max-streams-per-owner", type=int, default=a.max_streams_per_owner,
                   help="session streams one remote peer id may keep open")
    p.add_argument("--stream-idle-timeout", type=float, default=a.stream_idle_timeout_s,
                   help="seconds a stream that holds no session may stay silent")
    p.add_argument("--frame-read-timeout", type=float, default=a.frame_read_timeout_s,
                   help="seconds the rest of a frame may take once it started (plus its payload at 1 MiB/s)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s,
                   help="seconds a Forward may wait for compute before the client is told to go elsewhere")
    p.add_argument("--stuck-step", type=float, default=d.stuck_step_s,
                   help="a compute step running longer announces this peer draining until it ends")
    p.add_argument("--probe-max-mb", type=float, default=d.prober.max_probe_bytes / 1024**2,
                   help="largest link-probe transfer; fast links stop here (less CPU, coarser reading)")
    add_metrics_arguments(p, "the p2pserve_peer_* series of docs/metrics.md; off by default")
    add_dht_arguments(p, need_model=False)


def _add_device_arguments(p: argparse.ArgumentParser) -> None:
    """Where the layers run: device, GPUs or a tensor-parallel group, dtype, quantization."""
    d = PeerConfig()
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="compute device (default: cuda if --gpu given, else cpu)")
    p.add_argument("--gpu", default=None, metavar="N[,N...]",
                   help="CUDA device index; implies --device cuda. A comma list (0,1,2,3) serves the layer range as one "
                        "tensor-parallel group over those devices (NCCL; docs/tensor-parallel.md)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor-parallel size: with --device cpu, N processes on this host split each layer (gloo); "
                        "the group is announced as one peer (docs/tensor-parallel.md)")
    p.add_argument("--dtype", default=d.dtype, choices=list(MODEL_DTYPES))
    p.add_argument("--quant", default="none", choices=["none", "int8", "nf4", "int4"],
                   help="weight-only quantization of the layers served (needs the 'quant' extra); the swarm "
                        "model name gets '@SCHEME', so only clients asking for it route here (docs/quantization.md)")


def config_from_args(args: argparse.Namespace) -> PeerConfig:
    """Build a PeerConfig from parsed flags."""
    from p2pserve.peer.tp_group import parse_gpus

    device = args.device or ("cuda" if args.gpu is not None else "cpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda / --gpu was given but no CUDA device is available")
        gpus = parse_gpus(args.gpu) if args.gpu is not None else (0,)
        if len(gpus) > torch.cuda.device_count() or max(gpus) >= torch.cuda.device_count():
            raise ConfigError(f"--gpu {args.gpu}: this host has {torch.cuda.device_count()} CUDA device(s)")
        device = f"cuda:{gpus[0]}"
    from p2pserve.cli.common import metrics_config

    start, end = args.layers if args.layers else (None, None)
    return PeerConfig(
        model=args.model,
        start=start,
        end=end,
        device=device,
        dtype=args.dtype,
        quant=require_backend(args.quant),
        num_threads=args.num_threads,
        compile_buckets=args.compile_buckets,
        kv_budget_token_layers=args.kv_token_layers,
        kv_memory_bytes=int(args.kv_memory_gb * 1024**3),
        session_idle_timeout_s=args.session_idle_timeout,
        frame_limits=FrameLimits(max_payload_bytes=int(args.max_payload_mb * 1024**2)),
        batching=batching_config(args),
        max_layers=args.max_layers,
        weights_memory_bytes=int(args.weights_memory_gb * 1024**3),
        profile_batch=args.profile_batch,
        announce=bool(args.initial_peers) or bool(args.config),
        swarm_model=args.swarm_model,
        prober=dataclasses.replace(PeerConfig().prober, max_probe_bytes=int(args.probe_max_mb * 1024**2)),
        metrics=metrics_config(args),
        direct_port=None if args.no_direct else args.direct_port,
        request_timeout_s=args.request_timeout,
        stuck_step_s=args.stuck_step,
        admission=AdmissionConfig(
            max_sessions_per_owner=args.max_sessions_per_owner,
            max_kv_fraction_per_owner=args.max_kv_fraction_per_owner,
            max_streams_per_owner=args.max_streams_per_owner,
            prefix_sharing=args.prefix_sharing,
            stream_idle_timeout_s=args.stream_idle_timeout,
            frame_read_timeout_s=args.frame_read_timeout,
        ),
    )


def direct_address_from(args: argparse.Namespace, dcfg):
    """Where the direct path binds and which port it offers: behind announced addresses (a relay,
    a NAT's port forward) it binds the libp2p listen hosts, since the announced ones may not be
    this machine's, and offers ``--direct-announce-port`` if given."""
    from p2pserve.transport.tcp import DirectAddress, maddr_hosts

    if args.direct_announce_port is not None and (args.no_direct or not args.direct_port):
        raise ConfigError("--direct-announce-port needs a fixed --direct-port: what listens at the announced "
                          "port must know where to forward")
    listen = tuple(maddr_hosts(dcfg.host_maddrs)) if dcfg.announce_maddrs else ()
    return DirectAddress(listen_hosts=listen, announce_port=args.direct_announce_port)


def tp_from_args(args: argparse.Namespace, config: PeerConfig):
    """The peer's ``TPConfig`` (``PeerConfig.tp``) from ``--tp`` / ``--gpu A,B,...``, or None without
    tensor parallelism."""
    from p2pserve.peer.tp_group import parse_gpus, tp_devices
    from p2pserve.config import TPConfig

    gpus = parse_gpus(args.gpu) if args.gpu is not None and config.device.startswith("cuda") else None
    devices = tp_devices(config.device, gpus, args.tp)
    return None if devices is None else TPConfig(devices=devices, num_threads=config.num_threads)


async def serve(config: PeerConfig, args: argparse.Namespace) -> None:
    """Start DHT node and peer (and the control-plane agent), print the ready line, serve until signalled."""
    from p2pserve.cli.common import dht_config, model_name_from_args
    from p2pserve.cli.progress import Progress, describe
    from p2pserve.config.swarm_file import SwarmFile
    from p2pserve.dht.swarm import Swarm
    from p2pserve.model.locate import open_model
    from p2pserve.model.spec import load_spec

    progress = Progress()
    source = open_model(config.model, "peer", progress.step)  # a hub id: its config and index only
    spec = load_spec(source.folder, dtype=config.dtype, quant=config.quant)  # fail fast
    # The model's name in DHT keys, by the rule every role shares (p2pserve/model/identity.py):
    # --swarm-model, else the swarm file's model, else the checkpoint's own id. (Sessions still
    # check the checkpoint id itself when they open.)
    file = SwarmFile.load(args.config)
    dcfg = dht_config(args, file, model_name_from_args(args, file, spec))
    dcfg = dataclasses.replace(dcfg, num_layers=spec.num_layers)
    direct_address = direct_address_from(args, dcfg)
    swarm = Swarm.create(dcfg)  # forks the DHT process before weights are loaded
    agent = watch = None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_group_failure(reason: str) -> None:  # a dead rank takes the group down: withdraw, exit non-zero
        loop.call_soon_threadsafe(stop.set)

    try:
        fixed = config.start is not None or not config.announce
        with progress.step(f"loading layers {config.start or 0}:{config.end or spec.num_layers}" if fixed
                           else "starting the peer"):
            peer = await _create_peer(config, swarm, direct_address, on_group_failure, source)
        if peer.tp is not None and peer.tp.comm.failed:  # failed before the group was handed over
            stop.set()
        if config.announce:
            agent = await _start_agent(peer, swarm, config, progress)
            if agent.follow_plan:  # say what the peer waits for: the plan, a load, a handover
                watch = asyncio.create_task(progress.follow(
                    lambda: describe(agent.state, agent.loading, agent.loaded, peer.served)))
        _handle_signals(loop, stop, agent)
        layers = f"{peer.served[0]}:{peer.served[1]}" if peer.served else "none"
        if peer.metrics_server is not None:
            print(f"P2PSERVE_METRICS_READY url={peer.metrics_server.url}", flush=True)
        print(f"P2PSERVE_PEER_READY peer_id={peer.peer_id} layers={layers} maddrs={','.join(peer.visible_maddrs())}",
              flush=True)
        await stop.wait()
        if watch:
            watch.cancel()
        if agent:
            await agent.shutdown()
        await peer.shutdown()
        if peer.tp is not None and peer.tp.comm.failed:
            from p2pserve.peer.tp_group import GroupFailedError

            raise GroupFailedError(f"tensor-parallel group failed: {peer.tp.comm.failed}")
    finally:
        swarm.shutdown()


async def _create_peer(config: PeerConfig, swarm, direct_address, on_group_failure, source):
    """The peer, built from ``config``. In a swarm, push mode dials next hops where they announced
    themselves, and replies are signed with the key derived from this node's identity (stable
    across restarts); a fixed peer outside one pushes nowhere and signs with a fresh key."""
    from p2pserve.peer.next_hop import AnnouncedAddresses
    from p2pserve.peer.server import Peer

    return await Peer.create(config, swarm.dht, direct_address,
                             resolve=AnnouncedAddresses(swarm) if config.announce else None,
                             reply_key=swarm.reply_key() if config.announce else None,
                             on_group_failure=on_group_failure, source=source)


def _handle_signals(loop, stop: asyncio.Event, agent) -> None:
    """SIGINT/SIGTERM stop the peer; SIGUSR1 retires it: announced draining, still serving, so that
    the plan moves its layers elsewhere before a machine agent stops it (docs/machine-agent.md)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if agent is not None:
        loop.add_signal_handler(signal.SIGUSR1, agent.retire)


def max_layers_of(spec, config: PeerConfig) -> int:
    """The most layers a plan-driven peer offers: ``--max-layers``, else as many layers' weights as
    ``--weights-memory-gb`` holds (`ModelSpec.layer_bytes`: every expert of a mixture-of-experts
    layer, quantized where ``--quant`` says), never more than the model has (readers reject a
    record claiming more, dht/records.py)."""
    return min(spec.num_layers, config.max_layers or max(1, config.weights_memory_bytes // spec.layer_bytes))


async def _start_agent(peer, swarm, config: PeerConfig, progress):
    from p2pserve.dht.prober import LinkProber
    from p2pserve.peer.agent import SwarmAgent
    from p2pserve.peer.profiler import load_or_measure

    spec = peer.spec
    max_layers = max_layers_of(spec, config)
    load = None
    if peer.source is not None and peer.source.partial:  # a hub id: time stand-in layers, fetch nothing
        from p2pserve.model.stand_in import stand_in_shard

        load = stand_in_shard
        if peer.tp is not None:  # the group's ranks read the checkpoint itself
            load = None
            await asyncio.to_thread(peer.source.fetch_layers, spec, 0, min(max_layers, 4, spec.num_layers))
    with progress.step(f"profiling {config.device} for up to {max_layers} layers (cached after the first run)"):
        profile = await asyncio.to_thread(load_or_measure, peer.model_path, spec, config.device, max_layers,
                                          config.profile_batch, peer.tp, load)
    # each link is re-probed every link refresh (config.prober: the peer's probe sizes and targets)
    prober = LinkProber(peer.p2p, dataclasses.replace(config.prober, min_interval_s=swarm.config.link_refresh))
    agent = SwarmAgent(peer, swarm, profile, follow_plan=config.start is None, prober=prober)
    await agent.start()
    return agent


def run(args: argparse.Namespace) -> int:
    """Entry point of `p2pserve peer`."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tp, status = None, 0
    try:
        config = config_from_args(args)
        tp = tp_from_args(args, config)
        config = dataclasses.replace(config, tp=tp)
        asyncio.run(serve(config, args))
    except P2PServeError as e:
        print(f"p2pserve peer: error: {e}", file=sys.stderr)
        status = 2
    if tp is not None:  # rank 0 of a process group leaves as its other ranks do
        from p2pserve.model.tp_comm import exit_without_teardown

        exit_without_teardown(status)
    return status


def batching_config(args) -> BatchingConfig:
    """The step's token budget from the flags; ``--prefill-throttle off`` spreads waiting prefill
    over one step with no minimum under the cap, i.e. whole prompts."""
    common = dict(max_batch_tokens=args.max_batch_tokens, pipeline_depth=args.pipeline_depth,
                  max_batch_wait_s=args.batch_wait_ms / 1000)
    if args.prefill_throttle == "off":
        return BatchingConfig(**common, throttle_steps=1, min_prefill_tokens=args.max_batch_tokens)
    if args.min_prefill_tokens < 1:
        raise ConfigError("--min-prefill-tokens must be at least 1")
    return BatchingConfig(**common, min_prefill_tokens=args.min_prefill_tokens)
