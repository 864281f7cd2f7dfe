"""Client commands (`chat`, `api`) join a swarm with the same swarm file as every other role."""

from __future__ import annotations

import argparse
import json

from p2pserve.cli.api import add_client_arguments, apply_swarm_file


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_client_arguments(parser)
    return parser.parse_args(argv)


def test_swarm_file_fills_what_flags_leave_out(tmp_path):
    cfg = tmp_path / "swarm.json"
    cfg.write_text(json.dumps({"swarm_id": "lab", "model": "m", "initial_peers": ["/ip4/10.0.0.1/tcp/1/p2p/QmA"],
                               "trusted_coordinators": ["ssh-rsa AAAA"]}))
    args = parse("--config", str(cfg))
    apply_swarm_file(args)
    assert (args.initial_peers, args.swarm_id, args.trusted_coordinator, args.swarm_model) == (
        ["/ip4/10.0.0.1/tcp/1/p2p/QmA"], "lab", ["ssh-rsa AAAA"], "m")


def test_flags_override_the_swarm_file(tmp_path):
    cfg = tmp_path / "swarm.json"
    cfg.write_text(json.dumps({"swarm_id": "lab", "initial_peers": ["/ip4/10.0.0.1/tcp/1/p2p/QmA"]}))
    args = parse("--config", str(cfg), "--swarm-id", "other", "--initial-peers", "/ip4/127.0.0.1/tcp/2/p2p/QmB")
    apply_swarm_file(args)
    assert args.swarm_id == "other" and args.initial_peers == ["/ip4/127.0.0.1/tcp/2/p2p/QmB"]


def test_without_a_file_the_defaults_hold():
    args = parse()
    apply_swarm_file(args)
    assert (args.initial_peers, args.swarm_id, args.trusted_coordinator, args.swarm_model) == ([], "p2pserve", [], None)
