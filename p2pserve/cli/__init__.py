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

from p2pserve.parent_watch import exit_with_launcher

# name -> (module path, one-line help). Order is the order shown by --help.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "bootstrap": ("p2pserve.cli.bootstrap", "run a long-lived DHT bootstrap node"),
    "peer": ("p2pserve.cli.peer", "serve layers of a model to the swarm"),
    "coordinator": ("p2pserve.cli.coordinator", "run a placement coordinator (election candidate)"),
    "machine": ("p2pserve.cli.machine", "offer a machine's GPUs (or CPU slots) as tensor-parallel peers the plan groups"),
    "chat": ("p2pserve.cli.chat", "interactive chat through the swarm"),
    "api": ("p2pserve.cli.api", "OpenAI-compatible HTTP server"),
    "status": ("p2pserve.cli.status", "show the swarm: peers, links, leader, plan, flows"),
    "plan": ("p2pserve.cli.plan", "solve a layer placement for a Helix cluster file"),
    "sim": ("p2pserve.cli.sim", "simulate a cluster with a placement and a scheduler"),
    "demo": ("p2pserve.cli.demo", "start a local swarm and answer a chat prompt"),
    "prepare-model": ("p2pserve.cli.prepare_model", "convert the embedded default model / build test models"),
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
    exit_with_launcher()  # a child of p2pserve.launch stops with it (p2pserve/parent_watch.py)
    from p2pserve.cli.common import fold_revision
    from p2pserve.errors import ConfigError

    try:
        fold_revision(args)
    except ConfigError as e:
        print(f"p2pserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    module = importlib.import_module(_available()[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
