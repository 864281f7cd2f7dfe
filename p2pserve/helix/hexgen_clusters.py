"""HexGen's (ICML'24) clusters of multi-GPU machines, for LLaMA-2-70B.

* :func:`case_study` -- §3.1: one 4x A6000-48G box, one 2x A5000-24G, one 2x A4000-16G, with
  the case study's layouts (:func:`case_study_layouts`);
* :func:`full_price` -- §5.1 "heterogeneous-full-price": 2x (8x 3090Ti) in Iceland, 2x
  (3x 3090Ti) in Norway, 8x A5000 in Nevada, 2x (8x A6000) + 8x A5000 + 4x A40 in Illinois
  (58 GPUs, 9 machines).

Networks from §5.1's footnote: 2 ms / 5 Gbit/s inside a region; across regions 40-150 ms and
0.3-1.0 Gbit/s (we pick per pair within those ranges, see :data:`REGION_LINKS`). The paper does
not say how the three §3.1 boxes are connected; we take the intra-region figure. Clients reach
every machine over the intra-region link (a front end per region).

Single-GPU profiles: none of these GPU types is in Helix's measurements, so each is derived
from the measured A100 profile by :func:`~p2pserve.placement.gpu_specs.derive_profile`; TP
groups inside a machine use :data:`~p2pserve.placement.tp_cost.PCIE4_FITTED` (PCIe 4.0,
fitted to Helix's L4/L4x2 profiles).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from p2pserve.helix.format import load_profile
from p2pserve.placement.gpu_specs import GPU_SPECS, derive_profile, gpu_spec
from p2pserve.placement.machines import Group, Machine, MachineCluster, NetLink
from p2pserve.placement.profile import LatencyProfile
from p2pserve.placement.tp_cost import LLAMA2_70B, PCIE4_FITTED, MemoryModel

MODEL = "llama2-70b"
LAN = NetLink(5e9 / 8, 2e-3)
#: Cross-region paths (bytes/s, one-way s), within §5.1's 40-150 ms and 0.3-1.0 Gbit/s.
REGION_LINKS = {
    ("iceland", "norway"): NetLink(1.0e9 / 8, 40e-3),
    ("nevada", "illinois"): NetLink(1.0e9 / 8, 50e-3),
    ("iceland", "nevada"): NetLink(0.3e9 / 8, 150e-3),
    ("iceland", "illinois"): NetLink(0.5e9 / 8, 120e-3),
    ("norway", "nevada"): NetLink(0.3e9 / 8, 150e-3),
    ("norway", "illinois"): NetLink(0.5e9 / 8, 130e-3),
}
WAN = NetLink(0.3e9 / 8, 150e-3)
#: HexGen's memory limit (eq. 7) lets weights take what the KV of the batches in flight leaves:
#: we let weights take up to 75% of a GPU (Helix's planner keeps them to 46%).
HEXGEN_MEMORY = MemoryModel(weight_fraction=0.75)


@lru_cache(maxsize=None)
def single_gpu_profile(gpu: str, root: Path | None = None) -> LatencyProfile:
    """LLaMA-2-70B per-layer profile of one ``gpu``: measured for A100, derived otherwise."""
    ref = load_profile(MODEL, "a100", root)
    spec = gpu_spec(gpu)
    prof = ref if spec.name == "A100" else derive_profile(ref, GPU_SPECS["A100"], spec, LLAMA2_70B.layer_bytes)
    return prof


def machine(name: str, gpu: str, count: int, region: str = "") -> Machine:
    """A box of ``count`` ``gpu``s joined by PCIe 4.0 (fitted link)."""
    return Machine(name, gpu_spec(gpu), count, single_gpu_profile(gpu), PCIE4_FITTED, region)


def case_study(lan: NetLink = LAN) -> MachineCluster:
    """HexGen §3.1: 4x A6000, 2x A5000, 2x A4000 (``lan`` between the boxes)."""
    boxes = (machine("a6000x4", "A6000", 4), machine("a5000x2", "A5000", 2), machine("a4000x2", "A4000", 2))
    return MachineCluster("hexgen-case-study", boxes, lan=lan, wan=lan, client=LAN, memory=HEXGEN_MEMORY)


def case_study_layouts() -> dict[str, tuple[list[Group], dict[int, tuple[int, int]]]]:
    """The §3.1 layouts as (groups, placement):

    * ``hexgen``: one stage per machine, 48 / 20 / 12 layers at TP 4 / 2 / 2;
    * ``pp8``: eight single-GPU stages, layers proportional to GPU memory (14 x 4, 7 x 2, 5 x 2);
    * ``pp2_tp4``: TP-4 on the A6000 box for 56 layers, then one TP-4 group across the A5000
      and A4000 boxes for the other 24 (its all-reduces cross the network).
    """
    a6, a5, a4 = 0, 1, 2
    hexgen = [Group(tuple((a6, g) for g in range(4))), Group(((a5, 0), (a5, 1))), Group(((a4, 0), (a4, 1)))]
    pp8 = [Group(((a6, g),)) for g in range(4)] + [Group(((a5, g),)) for g in range(2)] + \
          [Group(((a4, g),)) for g in range(2)]
    sizes = [14, 14, 14, 14, 7, 7, 5, 5]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pp2 = [Group(tuple((a6, g) for g in range(4))), Group(((a5, 0), (a5, 1), (a4, 0), (a4, 1)))]
    return {
        "hexgen": (hexgen, {0: (0, 48), 1: (48, 68), 2: (68, 80)}),
        "pp8": (pp8, {i: (s, s + k) for i, (s, k) in enumerate(zip(starts, sizes))}),
        "pp2_tp4": (pp2, {0: (0, 56), 1: (56, 80)}),
    }


def full_price() -> MachineCluster:
    """HexGen §5.1 heterogeneous-full-price: 58 GPUs in 9 machines, 4 regions."""
    boxes = (
        machine("iceland-3090ti-a", "3090Ti", 8, "iceland"),
        machine("iceland-3090ti-b", "3090Ti", 8, "iceland"),
        machine("norway-3090ti-a", "3090Ti", 3, "norway"),
        machine("norway-3090ti-b", "3090Ti", 3, "norway"),
        machine("nevada-a5000", "A5000", 8, "nevada"),
        machine("illinois-a6000-a", "A6000", 8, "illinois"),
        machine("illinois-a6000-b", "A6000", 8, "illinois"),
        machine("illinois-a5000", "A5000", 8, "illinois"),
        machine("illinois-a40", "A40", 4, "illinois"),
    )
    return MachineCluster("hexgen-full-price", boxes, lan=LAN, wan=WAN, client=LAN, regions=dict(REGION_LINKS),
                          memory=HEXGEN_MEMORY)
