"""One model name across roles: every command derives the swarm's model name from ``--model``
by the rule of ``p2pserve/model/identity.py``, and the coordinator reads the shape from a folder."""

from __future__ import annotations

import argparse
import json

import pytest

from p2pserve.errors import ConfigError, UnknownModelError
from p2pserve.model.identity import checkpoint_of, explicit_name, swarm_model_name
from p2pserve.model.spec import load_spec


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A folder that is a checkpoint as far as names go: a config.json (no weights needed)."""
    path = tmp_path_factory.mktemp("models") / "tiny-qwen2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
        "num_hidden_layers": 6, "intermediate_size": 128, "vocab_size": 300}))
    return path


def test_a_folder_gives_its_checkpoint_id_and_a_bare_name_stays(ckpt):
    assert swarm_model_name(str(ckpt)) == load_spec(ckpt).model_id
    assert swarm_model_name(str(ckpt)).startswith("qwen2-")  # the family, then the content's digest
    assert swarm_model_name("llama-3-8b") == "llama-3-8b"
    assert checkpoint_of("llama-3-8b") is None and checkpoint_of(str(ckpt)) == ckpt


def test_precedence_swarm_model_then_file_then_model(ckpt):
    assert swarm_model_name(str(ckpt), swarm_model="s", file_model="f") == "s"
    assert swarm_model_name(str(ckpt), file_model="f") == "f"
    assert explicit_name(None, None) is None and explicit_name(None, "f") == "f"
    with pytest.raises(ConfigError):
        swarm_model_name(str(ckpt), swarm_model=" ")


def test_a_folder_that_is_no_checkpoint_is_an_error_not_a_name(tmp_path):
    with pytest.raises(UnknownModelError, match="config.json"):
        swarm_model_name(str(tmp_path))


def _parse(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_peer_coordinator_status_and_client_flags_meet_on_one_name(ckpt, tmp_path):
    from p2pserve.cli import api, coordinator, peer, status
    from p2pserve.cli.common import model_name_from_args
    from p2pserve.config.swarm_file import SwarmFile

    none = SwarmFile()
    want = load_spec(ckpt).model_id
    for module in (peer, coordinator, status):
        assert model_name_from_args(_parse(module, ["--model", str(ckpt)]), none) == want, module.__name__
        assert model_name_from_args(_parse(module, ["--model", str(ckpt), "--swarm-model", "x"]), none) == "x"
    args = _parse(api, ["--model", str(ckpt), "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/Qm"])
    api.apply_swarm_file(args)
    assert swarm_model_name(args.model, swarm_model=args.swarm_model) == want
    # the swarm file's model wins over --model, on every role alike
    (tmp_path / "s.json").write_text(json.dumps({"model": "from-file"}))
    file = SwarmFile.load(str(tmp_path / "s.json"))
    for module in (peer, coordinator, status):
        assert model_name_from_args(_parse(module, ["--model", str(ckpt)]), file) == "from-file"
    with pytest.raises(ConfigError, match="no model"):
        model_name_from_args(_parse(coordinator, []), none)


def test_the_coordinator_reads_the_shape_from_a_folder_and_flags_win(ckpt):
    from p2pserve.cli import coordinator
    from p2pserve.config.swarm_file import SwarmFile

    shape = coordinator.folder_shape(str(ckpt))
    assert (shape.num_layers, shape.activation_bytes) == (6, 64 * 4)
    assert coordinator.folder_shape("a-bare-name") is None
    args = _parse(coordinator, ["--model", str(ckpt)])
    cfg = coordinator.coordinator_config(args, SwarmFile(), "n", shape)
    assert (cfg.num_layers, cfg.activation_bytes) == (6, 256)
    args = _parse(coordinator, ["--model", str(ckpt), "--num-layers", "3"])
    assert coordinator.coordinator_config(args, SwarmFile(), "n", shape).num_layers == 3
    assert coordinator.operator_shape(args, SwarmFile(), "n") == {"num_layers": 3}
    with pytest.raises(ConfigError, match="number of layers"):
        coordinator.coordinator_config(_parse(coordinator, ["--model", "bare"]), SwarmFile(), "bare")
