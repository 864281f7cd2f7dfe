"""`p2pserve machine`: offer a multi-GPU (or multi-slot CPU) machine to the swarm.

    p2pserve machine --model PATH --initial-peers MADDR --gpu 0,1,2,3
    p2pserve machine --model PATH --initial-peers MADDR --device cpu --slots 4 --slot-max-layers 4
    p2pserve machine ... --grouping 2,1,1 -- --kv-memory-gb 2      # a fixed grouping; flags after -- go to every peer

The agent measures the links between its slots (an all-reduce per slot pair, gloo or NCCL) and
one slot's decode profile, announces them as a signed ``MachineInfo``, and runs one plan-driven
``p2pserve peer`` per tensor-parallel group of the grouping the coordinator chooses for it
(``Plan.groupings``; ``p2pserve coordinator --grouping auto|D``), regrouping make-before-break
when the plan changes it (docs/machine-agent.md). Prints
``P2PSERVE_MACHINE_READY machine_id=<id> slots=<n>`` once announced.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path

from p2pserve.errors import ConfigError, P2PServeError

log = logging.getLogger("p2pserve.machine")

# DHT flags forwarded to every group's `p2pserve peer` as given (dest -> flag)
_FORWARD = {"config": "--config", "model": "--model", "swarm_model": "--swarm-model", "initial_peers": "--initial-peers",
            "swarm_id": "--swarm-id", "host_maddrs": "--host-maddrs", "announce_maddrs": "--announce-maddrs",
            "trusted_coordinator": "--trusted-coordinator", "allowed_peers": "--allowed-peers",
            "peer_refresh": "--peer-refresh", "link_refresh": "--link-refresh", "candidate_refresh": "--candidate-refresh",
            "plan_refresh": "--plan-refresh", "max_clock_skew": "--max-clock-skew", "log_level": "--log-level"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the machine agent's flags."""
    from p2pserve.cli.common import add_dht_arguments

    add_dht_arguments(p)
    m = p.add_argument_group("machine")
    m.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="slots are CPU processes or CUDA devices")
    m.add_argument("--slots", type=int, default=None, help="CPU slots offered (--device cpu)")
    m.add_argument("--gpu", default=None, metavar="N,N,...", help="CUDA devices offered (implies --device cuda)")
    m.add_argument("--slot-max-layers", type=int, required=True, help="layers one slot holds (a group of d: d times)")
    m.add_argument("--slot-memory-gb", type=float, default=1.0, help="memory offered per slot (announced)")
    m.add_argument("--grouping", default="plan", metavar="plan|D,D,...",
                   help="plan (default): run the grouping the coordinator's plan gives this machine; or fixed TP "
                        "degrees in slot order, e.g. 2,1,1")
    m.add_argument("--profile-batch", type=int, default=4, help="decode batch of the slot profile")
    m.add_argument("--num-threads", type=int, default=1, help="torch threads per peer process")
    m.add_argument("--logdir", default=None, help="write each group's peer log to DIR/group-SLOTS.log")
    m.add_argument("peer_args", nargs=argparse.REMAINDER, help="after --: flags for every group's p2pserve peer")


def devices_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """One device per slot: ``cpu`` x ``--slots``, or ``cuda:N`` per ``--gpu`` index."""
    from p2pserve.peer.tp_group import parse_gpus

    if args.gpu is not None:
        return tuple(f"cuda:{g}" for g in parse_gpus(args.gpu))
    if args.device != "cpu" or not args.slots or not 1 <= args.slots <= 16:
        raise ConfigError("give --device cpu --slots N (1-16) or --gpu 0,1,...")
    return ("cpu",) * args.slots


def parse_grouping(text: str, n: int) -> tuple[int, ...] | None:
    """``plan`` -> None; ``2,1,1`` -> (2, 1, 1), checked against ``n`` slots."""
    if text == "plan":
        return None
    try:
        degrees = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--grouping takes plan or degrees like 2,1,1, not {text!r}") from None
    if sum(degrees) > n or any(d not in (1, 2, 4, 8) for d in degrees):
        raise ConfigError(f"--grouping {text}: powers of two, at most {n} slots in all")
    return degrees


def peer_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags every group's ``p2pserve peer`` gets: the swarm's, as given, and those after ``--``."""
    out: list[str] = ["--num-threads", str(args.num_threads), "--profile-batch", str(args.profile_batch)]
    for dest, flag in _FORWARD.items():
        v = getattr(args, dest, None)
        if v is None:
            continue
        if dest == "trusted_coordinator":
            for key in v:
                out += [flag, key]
        else:
            out += [flag, *map(str, v)] if isinstance(v, list) else [flag, str(v)]
    extra = list(args.peer_args or [])
    return tuple(out + (extra[1:] if extra[:1] == ["--"] else extra))


def _measure(model: str, devices: tuple[str, ...], max_layers: int, batch: int):
    """(links, slot profile, TP degrees the model splits into) -- blocking."""
    from p2pserve.model.locate import open_model
    from p2pserve.model.spec import load_spec
    from p2pserve.model.tensor_parallel import check_splittable
    from p2pserve.peer.profiler import load_or_measure
    from p2pserve.peer.slot_links import measure_links

    source = open_model(model, "peer")  # a hub id: configs and index only; its groups fetch their layers
    path = str(source.folder)
    spec = load_spec(path)
    degrees = []
    for d in (2, 4, 8):
        try:
            if d <= len(devices):
                check_splittable(spec, d)
                degrees.append(d)
        except ConfigError:
            pass
    links = measure_links(list(devices))
    load = None
    if source.partial:  # time stand-in layers rather than fetch weights no group may serve
        from p2pserve.model.stand_in import stand_in_shard

        load = stand_in_shard
    profile = load_or_measure(path, spec, devices[0], min(max_layers, spec.num_layers), batch, load=load)
    return links, list(profile.decode), degrees


async def serve(args: argparse.Namespace) -> None:
    """Measure, announce and follow the plan until signalled."""
    from p2pserve.cli.common import dht_config, model_name_from_args
    from p2pserve.dht.swarm import Swarm
    from p2pserve.machine.agent import MachineAgent
    from p2pserve.config import MachineConfig
    from p2pserve.config.swarm_file import SwarmFile

    devices = devices_from_args(args)
    grouping = parse_grouping(args.grouping, len(devices))
    links, profile, degrees = await asyncio.to_thread(_measure, args.model, devices, args.slot_max_layers,
                                                      args.profile_batch)
    log.info("slot links: %s", ", ".join(f"{l.a}-{l.b} {l.bandwidth / 1e9:.2f} GB/s {l.latency_s * 1e6:.0f} us"
                                          for l in links) or "none (one slot)")
    file = SwarmFile.load(args.config)
    swarm = Swarm.create(dht_config(args, file, model_name_from_args(args, file)))
    try:
        config = MachineConfig(devices=devices, peer_args=peer_args(args), slot_max_layers=args.slot_max_layers,
                               grouping=grouping, tp_degrees=tuple(degrees),
                               memory_bytes=int(args.slot_memory_gb * 1024**3),
                               refresh_s=max(0.5, swarm.config.peer_refresh),
                               logdir=Path(args.logdir) if args.logdir else None)
        agent = MachineAgent(config, swarm, links, profile)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await swarm.announce(swarm_kind(), agent.info())
        print(f"P2PSERVE_MACHINE_READY machine_id={swarm.peer_id} slots={len(devices)}", flush=True)
        await agent.run(stop)
    finally:
        swarm.shutdown()


def swarm_kind():
    """The DHT record kind of machine announcements."""
    from p2pserve.dht.keys import RecordKind

    return RecordKind.MACHINES


def run(args: argparse.Namespace) -> int:
    """Entry point of `p2pserve machine`."""
    from p2pserve.cli.common import setup_logging

    setup_logging(args.log_level)
    try:
        asyncio.run(serve(args))
    except (ConfigError, P2PServeError) as e:
        log.error("%s", e)
        return 2
    return 0
