"""Quantization as identity: the flag, the name suffix, the announced field and its bounds, the
client's route filter, and the peer's refusal without the ``quant`` extra."""

from __future__ import annotations

import asyncio
import sys

import msgspec
import pytest

from p2pserve.cli import build_parser
from p2pserve.cli.api import client_from_args
from p2pserve.cli.peer import config_from_args
from p2pserve.client.swarm_routes import SwarmRoutes
from p2pserve.config import DHTConfig
from p2pserve.dht.keys import RecordKind
from p2pserve.dht.records import PeerInfo, decode_record
from p2pserve.errors import ConfigError, RecordRejected
from p2pserve.model.identity import swarm_model_name
from p2pserve.model.quant import check_quant, quantize_layers, require_backend, weight_bytes, with_quant
from p2pserve.model.spec import load_spec
from p2pserve.testing import FakeSwarm, FakeSwarmStore


def peer_info(pid: str, model: str = "m@int8", quant: str = "int8") -> PeerInfo:
    return PeerInfo(model=model, peer_id=pid, addrs=[f"/ip4/127.0.0.1/tcp/1/p2p/{pid}"], serving=(0, 8),
                    state="serving", quant=quant)


def test_scheme_names():
    assert [check_quant(q) for q in (None, "", "none", "int8", "nf4", "int4")] == [None, None, None, "int8", "nf4", "int4"]
    with pytest.raises(ConfigError, match="not a scheme"):
        check_quant("int3")


def test_name_suffix_is_part_of_every_naming_step(model_dir):
    assert with_quant("m", None) == "m" and with_quant("m", "int8") == "m@int8"
    assert with_quant("m@int8", "int8") == "m@int8"  # applying the rule twice changes nothing
    assert swarm_model_name(None, swarm_model="llama-8b", quant="nf4") == "llama-8b@nf4"
    path = model_dir("llama")
    full, int8 = load_spec(path), load_spec(path, quant="int8")
    assert int8.model_id == full.model_id + "@int8" and int8.quant == "int8" and full.quant is None
    assert swarm_model_name(path, quant="int8") == int8.model_id == swarm_model_name(path, spec=int8)
    assert swarm_model_name(path) == full.model_id  # another model: the two never meet
    assert int8.layer_bytes < full.layer_bytes / 3  # a peer's layer budget counts quantized bytes


def parse(*argv: str):
    return build_parser(argv[0]).parse_args(list(argv))


def test_peer_and_client_flags():
    assert config_from_args(parse("peer")).quant is None
    if _imports("torchao"):
        assert config_from_args(parse("peer", "--quant", "int8")).quant == "int8"
    with pytest.raises(SystemExit):
        parse("peer", "--quant", "fp3")
    for command in ("chat", "api"):
        args = parse(command, "--peers", "/ip4/127.0.0.1/tcp/1/p2p/QmA@0:8", "--quant", "nf4")
        assert client_from_args(args).quant == "nf4"  # a client needs no quantization library


def _imports(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def test_peer_refuses_quant_without_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # what a default install looks like: no torchao
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    for scheme in ("int8", "int4", "nf4"):
        with pytest.raises(ConfigError, match=r"p2pserve\[quant\]"):
            require_backend(scheme)
    with pytest.raises(ConfigError, match=r"p2pserve\[quant\]"):
        config_from_args(parse("peer", "--quant", "int8"))
    assert require_backend("none") is None


@pytest.mark.parametrize("quant, model, reason", [
    ("int8", "m", "does not end in '@int8'"),
    ("nf4", "m@int8", "does not end in '@nf4'"),
    ("INT8", "m@INT8", "lowercase token"),
    ("x" * 17, "m@" + "x" * 17, "lowercase token"),
    ("in t8", "m@in t8", "lowercase token"),
])
def test_announced_quant_is_bounded_and_matches_the_name(quant, model, reason):
    data = msgspec.msgpack.encode(peer_info("A", model, quant))  # hostile bytes, as read from the DHT
    with pytest.raises(RecordRejected, match=reason):
        decode_record(data, PeerInfo)


def test_announced_quant_accepted():
    assert decode_record(msgspec.msgpack.encode(peer_info("A")), PeerInfo).quant == "int8"
    assert decode_record(msgspec.msgpack.encode(peer_info("A", "m", "")), PeerInfo).quant == ""


def test_client_routes_only_over_peers_of_its_quantization():
    store = FakeSwarmStore()
    store.put(RecordKind.PEERS, "A", peer_info("A"))
    store.put(RecordKind.PEERS, "B", peer_info("B", "m@int8", ""))  # same key, says full width
    swarm = FakeSwarm(store, "client", DHTConfig(model="m@int8"))
    routes = SwarmRoutes(swarm, seed=0, num_layers=8, quant="int8")
    asyncio.run(routes.refresh(force=True))
    assert set(routes.peers) == {"A"}
    plain = SwarmRoutes(swarm, seed=0, num_layers=8)
    asyncio.run(plain.refresh(force=True))
    assert set(plain.peers) == {"B"}


@pytest.mark.parametrize("scheme", ["int8", "int4", "nf4"])
def test_quantize_layers_shrinks_the_weights(scheme):
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes" if scheme == "nf4" else "torchao")
    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(64, 128, bias=False), torch.nn.SiLU())])
    x = torch.randn(3, 64)
    full, before = layers[0](x), weight_bytes(layers)
    quantize_layers(layers, scheme)
    out = layers[0](x)
    assert out.shape == full.shape and out.dtype == full.dtype
    assert (out - full).abs().max() < 0.25 * full.abs().max()  # close, not equal: 4- or 8-bit rounding
    # int4 on x86 CPU keeps one int8 per 4-bit value (torchao's packed layouts need CUDA or ARM; docs)
    assert weight_bytes(layers) < {"int8": 0.3, "int4": 0.35, "nf4": 0.2}[scheme] * before
