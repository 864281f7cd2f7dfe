"""HexGen's TP cost model (placement/tp_cost.py): the formula, the fit to Helix's measured TP
profiles, memory and the T table; derived single-GPU profiles (placement/gpu_specs.py)."""

from __future__ import annotations

import pytest

from p2pserve.errors import ConfigError
from p2pserve.helix.format import load_profile
from p2pserve.placement.gpu_specs import GPU_SPECS, GpuSpec, derive_profile, gpu_spec
from p2pserve.placement.profile import LatencyProfile
from p2pserve.placement.tp_cost import (
    LLAMA2_70B,
    PCIE3_FITTED,
    PCIE4_FITTED,
    GroupCost,
    LinkCost,
    MemoryModel,
    allreduce_s,
    fit_link,
    tp_layer_ms,
    tp_profile,
)

MODEL = "llama2-70b"
ACT = LLAMA2_70B.act_bytes


def flat(ms: float) -> LatencyProfile:
    """A profile where one layer takes ``ms`` whatever the batch (hand-computable)."""
    return LatencyProfile((1.0, 1000.0), (ms, ms), (1.0, 1000.0), (ms, ms))


def test_allreduce_is_ring_cost_and_free_alone():
    link = LinkCost(bus_bytes_per_s=1e9, latency_s=1e-4)
    assert allreduce_s(1e6, 1, link) == 0.0
    # 2 (d-1)/d of the message crosses the slowest link, plus one latency per collective.
    assert allreduce_s(1e6, 4, link) == pytest.approx(1e-4 + 1.5 * 1e6 / 1e9)
    # per layer: single time / d plus two all-reduces of tokens x hidden x dtype bytes
    assert tp_layer_ms(8.0, 10, 2, link, 100) == pytest.approx(4.0 + 2000.0 * (1e-4 + 1000 / 1e9))


def test_group_profile_takes_the_slowest_member():
    link = LinkCost(bus_bytes_per_s=1e12, latency_s=0.0)
    prof = tp_profile([flat(4.0), flat(8.0)], link, ACT)
    assert prof.decode_ms(10) == pytest.approx(4.0, rel=1e-3)  # max(4, 8) / 2 (+ ~0 comm)
    assert tp_profile([flat(4.0)], link, ACT).decode_ms(10) == 4.0


def test_bad_links_are_refused():
    with pytest.raises(ConfigError):
        LinkCost(bus_bytes_per_s=0.0, latency_s=0.0)
    with pytest.raises(ConfigError):
        LinkCost(bus_bytes_per_s=1e9, latency_s=float("nan"))
    with pytest.raises(ConfigError):
        tp_profile([], PCIE4_FITTED, ACT)


@pytest.mark.parametrize("single, grouped, fitted", [
    ("t4", [(2, "t4x2"), (4, "t4x4")], PCIE3_FITTED),
    ("l4", [(2, "l4x2")], PCIE4_FITTED),
])
def test_fit_reproduces_helix_measured_tp_profiles(single, grouped, fitted):
    """The fitted constants in tp_cost are what the fit gives, and the model predicts the
    measured TP-2/TP-4 profiles within 5% on average."""
    link, err = fit_link(load_profile(MODEL, single), [(d, load_profile(MODEL, g)) for d, g in grouped], ACT)
    assert link.bus_bytes_per_s == pytest.approx(fitted.bus_bytes_per_s, rel=0.01)
    assert link.latency_s == pytest.approx(fitted.latency_s, rel=0.02)
    assert err < 0.05


def test_memory_model_matches_helix_max_layers():
    """weight_fraction 0.46 gives Helix's max_num_layers for A100 (12), L4 (7), L4x2 (14), T4 (4)."""
    a100 = load_profile(MODEL, "a100")
    for mem, d, want in ((40e9, 1, 12), (24e9, 1, 7), (24e9, 2, 14), (16e9, 1, 4), (16e9, 2, 9)):
        assert GroupCost(d, mem, a100).max_layers == want
    # HexGen §3.1: naive PP cannot put 10 layers on one A4000-16G; TP-8 over 16 GB GPUs can't
    # hold 80 layers either (each GPU would need 10 layers' worth).
    hexgen = MemoryModel(weight_fraction=0.75)
    assert GroupCost(1, 16e9, a100, memory=hexgen).max_layers < 10
    assert GroupCost(8, 16e9, a100, memory=hexgen).max_layers < 80


def test_table_format_and_kv():
    cost = GroupCost(2, 24e9, load_profile(MODEL, "a100"), memory=MemoryModel(weight_fraction=0.75))
    table, kv = cost.table(), cost.kv_table()
    assert len(table) == len(kv) == cost.max_layers + 1 and table[0] == 0.0 and kv[0] == 0
    assert all(t > 0 for t in table[1:])
    assert all(a > b for a, b in zip(kv[1:], kv[2:]))  # more layers, less KV room
    assert cost.kv_capacity(cost.max_layers) > 0


def test_derived_profile_scales_by_roofline():
    """A GPU with the reference's specs gets the reference's profile; half the memory bandwidth
    slows small decode batches (weight-bound) about 2x and long prompts (compute-bound) barely."""
    ref = load_profile(MODEL, "a100")
    a100 = gpu_spec("a100")
    same = derive_profile(ref, a100, a100, LLAMA2_70B.layer_bytes)
    assert same.decode_ms(100) == pytest.approx(ref.decode_ms(100))
    slow_mem = GpuSpec("x", 40e9, a100.mem_bw / 2, a100.flops)
    d = derive_profile(ref, a100, slow_mem, LLAMA2_70B.layer_bytes)
    assert d.decode_ms(2) / ref.decode_ms(2) == pytest.approx(2.0, rel=0.02)
    assert d.prompt_ms(8000) / ref.prompt_ms(8000) < 1.1
    assert set(GPU_SPECS) >= {"A6000", "A5000", "A4000", "A40", "3090Ti"}
    with pytest.raises(ConfigError):
        gpu_spec("H9000")
