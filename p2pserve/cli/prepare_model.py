"""`p2pserve prepare-model`: convert the embedded default model now, or build a tiny test model."""

from __future__ import annotations

import argparse

from p2pserve.model.tiny import TINY_FAMILIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Register the flags."""
    p.add_argument("--tiny", choices=TINY_FAMILIES, default=None, help="build a tiny seeded test model instead")
    p.add_argument("--out", default=None, help="output directory for --tiny")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Print the path of the prepared model."""
    if args.tiny:
        from p2pserve.model.tiny import build_tiny_model

        out = args.out or f"tiny-{args.tiny}"
        print(build_tiny_model(args.tiny, out, seed=args.seed))
    else:
        from p2pserve.model.default import default_model_path

        print(default_model_path())
    return 0
