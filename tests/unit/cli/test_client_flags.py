"""Client commands (`chat`, `api`) join a swarm with the same swarm file as every other role."""

from __future__ import annotations

import argparse
import json

import pytest

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


def test_api_flags_build_one_api_config(monkeypatch):
    from p2pserve.cli.api import add_arguments, api_config_from_args
    from p2pserve.config import ApiConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv("P2PSERVE_API_KEY", raising=False)
    assert api_config_from_args(parser.parse_args([])) == ApiConfig()  # flag defaults are the dataclass's
    monkeypatch.setenv("P2PSERVE_API_KEY", "sk-env")
    cfg = api_config_from_args(parser.parse_args(["--port", "0", "--max-body-mb", "1", "--header-timeout", "2",
                                                  "--served-model-name", "tiny", "--max-generations", "3"]))
    assert (cfg.api_key, cfg.port, cfg.max_body_bytes, cfg.header_timeout_s, cfg.served_model_names,
            cfg.max_generations) == ("sk-env", 0, 2**20, 2.0, ("tiny",), 3)
    assert "sk-env" not in repr(cfg)  # a logged config does not leak the key
    assert api_config_from_args(parser.parse_args(["--api-key", "sk-flag"])).api_key == "sk-flag"


@pytest.mark.parametrize("kw", [{"verify_share": 1.5}, {"verify_share": -0.1}, {"hop_timeout_s": 0},
                                {"max_retries": -1}])
def test_client_config_refuses_out_of_range_values(kw):
    from p2pserve.config import ClientConfig
    from p2pserve.errors import ConfigError

    with pytest.raises(ConfigError):
        ClientConfig(**kw)


def test_verify_every_request_flag_needs_a_verify_share():
    """``--verify-every-request`` (docs/trust.md, "Every request") reaches ``ClientConfig``, on chat
    and api alike, and is refused with ``--verify-share 0``, which turns verification off."""
    from p2pserve.cli import build_parser
    from p2pserve.cli.api import client_from_args
    from p2pserve.errors import ConfigError

    for command in ("chat", "api"):
        fixed = (command, "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmA")
        config = client_from_args(build_parser(command).parse_args([*fixed, "--verify-every-request", "--verify-hold"])).config
        assert config.verify_every_request and config.verify_hold
        assert not client_from_args(build_parser(command).parse_args(fixed)).config.verify_every_request
        with pytest.raises(ConfigError, match="verify-share"):
            client_from_args(build_parser(command).parse_args([*fixed, "--verify-every-request", "--verify-share", "0"]))
