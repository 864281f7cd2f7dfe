"""``p2pserve coordinator``: run a placement coordinator (an election candidate).

    p2pserve coordinator --config bootstrap/swarm.toml --model M --key-path ~/.p2pserve/coord.key
    p2pserve coordinator --print-public-key --key-path ~/.p2pserve/coord.key   # for trusted_coordinators
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from p2pserve.cli.common import add_dht_arguments, dht_config_from_args, model_settings, setup_logging

logger = logging.getLogger("p2pserve.coordinator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``p2pserve coordinator``."""
    add_dht_arguments(parser)
    c = parser.add_argument_group("coordinator")
    c.add_argument("--priority", type=int, default=0, help="election priority (higher leads)")
    c.add_argument("--coordinator-id", default="", help="election id (default: libp2p peer id)")
    c.add_argument("--num-layers", type=int, default=None, help="model layers (default from the swarm file)")
    c.add_argument("--activation-bytes", type=int, default=None, help="bytes per token of hidden state")
    c.add_argument("--replan-period", type=float, default=None, help="re-plan at least this often (s)")
    c.add_argument("--link-change-threshold", type=float, default=None, help="relative bandwidth change that re-plans")
    c.add_argument("--objective", choices=("throughput", "max-flow"), default=None, help="planner objective")
    c.add_argument("--solve-time-limit", type=float, default=None, help="seconds per placement solve")
    c.add_argument("--print-public-key", action="store_true", help="print this coordinator's public key and exit")


def run(args: argparse.Namespace) -> int:
    """Entry point; returns the exit code."""
    setup_logging(args.log_level)
    if args.print_public_key:
        from p2pserve.dht.signing import load_or_create_key, public_key_text

        if not args.key_path:
            print("--print-public-key needs --key-path (an ephemeral key cannot be trusted)")
            return 2
        print(public_key_text(load_or_create_key(args.key_path)))
        return 0
    from p2pserve.coordinator.service import CoordinatorConfig, CoordinatorService
    from p2pserve.dht.swarm import Swarm
    from p2pserve.errors import ConfigError

    try:
        dcfg, file_cfg = dht_config_from_args(args)
        ms = model_settings(file_cfg, dcfg.model)
        num_layers = args.num_layers or ms.get("num_layers")
        if not num_layers:
            raise ConfigError(f"number of layers of {dcfg.model} unknown: pass --num-layers or set [models.\"{dcfg.model}\"] num_layers")
        kw = dict(num_layers=int(num_layers), priority=args.priority, coordinator_id=args.coordinator_id)
        if args.activation_bytes or ms.get("activation_bytes"):
            kw["activation_bytes"] = int(args.activation_bytes or ms["activation_bytes"])
        if args.replan_period or ms.get("replan_period"):
            kw["replan_period"] = float(args.replan_period or ms["replan_period"])
        if args.objective or ms.get("objective"):
            kw["objective"] = args.objective or ms["objective"]
        if args.solve_time_limit or ms.get("solve_time_limit"):
            kw["solve_time_limit"] = float(args.solve_time_limit or ms["solve_time_limit"])
        if args.link_change_threshold:
            kw["link_change_threshold"] = args.link_change_threshold
        ccfg = CoordinatorConfig(**kw)
    except ConfigError as e:
        print(f"error: {e}")
        return 2

    swarm = Swarm.create(dcfg)
    try:
        service = CoordinatorService(swarm, ccfg)
        logger.info(
            f"coordinator {service.coordinator_id} for {dcfg.model} (priority {ccfg.priority}); "
            f"public key {swarm.public_key[:40]}...; listening on {' '.join(swarm.visible_maddrs())}"
        )

        async def main() -> None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await service.run(stop)

        asyncio.run(main())
    finally:
        swarm.shutdown()
    return 0
