"""The single `p2pserve` entry point.

Each subcommand lives in the package that owns it, as a module exposing
``add_arguments(parser)`` and ``run(args) -> int``. The modules are imported only when their
subcommand is chosen, so `p2pserve plan` never imports torch and `p2pserve peer` never imports
the MILP solver.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

# name -> (module path, one-line help). Order is the order shown by --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bootstrap": ("p2pserve.dht.bootstrap_command", "run a long-lived DHT bootstrap node"),
    "peer": ("p2pserve.peer.command", "serve layers of a model to the swarm"),
    "coordinator": ("p2pserve.coordinator.command", "run a placement coordinator (election candidate)"),
    "chat": ("p2pserve.client.chat_command", "interactive chat through the swarm"),
    "api": ("p2pserve.client.api_command", "OpenAI-compatible HTTP server"),
    "status": ("p2pserve.dht.status_command", "show the swarm: peers, links, leader, plan, flows"),
    "plan": ("p2pserve.coordinator.plan_command", "solve a layer placement for a Helix cluster file"),
    "sim": ("p2pserve.sim.command", "simulate a cluster with a placement and a scheduler"),
    "demo": ("p2pserve.client.demo_command", "start a local swarm and answer a chat prompt"),
    "prepare-model": ("p2pserve.model.command", "convert the embedded default model / build test models"),
}


def _available() -> dict[str, tuple[str, str]]:
    """Subcommands whose module exists in this checkout (some arrive with later issues)."""
    found = {}
    for name, (module, help_text) in SUBCOMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            found[name] = (module, help_text)
    return found


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Build the top-level parser; only the selected subcommand's module is imported."""
    parser = argparse.ArgumentParser(
        prog="p2pserve",
        description="Peer-to-peer LLM serving (Helix placement, IWRR pipelines, failover).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _available().items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            importlib.import_module(module).add_arguments(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and run the chosen subcommand; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    selected = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(selected if selected in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(_available()[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
