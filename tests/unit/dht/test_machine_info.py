"""MachineInfo (dht/machine_info.py) and PeerInfo.tp: hostile bytes are refused with a reason."""

from __future__ import annotations

import msgspec
import pytest

from p2pserve.dht.machine_info import GpuLink, GpuOffer, MachineInfo
from p2pserve.dht.records import PeerInfo, decode_record, encode_record
from p2pserve.errors import MalformedFrameError, RecordRejected


def offer(n=4, links=None):
    gpus = [GpuOffer(device="NVIDIA RTX A6000", memory_bytes=48 << 30) for _ in range(n)]
    if links is None:
        links = [GpuLink(a=a, b=b, bandwidth=5.45e9, latency_s=96e-6, kind="pcie")
                 for a in range(n) for b in range(a + 1, n)]
    return MachineInfo(model="llama2-70b", machine_id="12D3KooWmachine", gpus=gpus, links=links, timestamp=1.0)


def test_round_trip_and_bottleneck():
    m = decode_record(encode_record(offer()), MachineInfo)
    assert len(m.gpus) == 4 and m.bottleneck([0, 1, 2]) == (5.45e9, 96e-6)
    partial = offer(links=[GpuLink(a=0, b=1, bandwidth=2e11, latency_s=2e-5, kind="nvlink")])
    assert partial.bottleneck([0, 1]) == (2e11, 2e-5)
    assert partial.bottleneck([0, 1, 2]) is None  # 2 was never measured against 0 or 1


@pytest.mark.parametrize("bad", [
    offer(n=17),  # more GPUs than a machine has
    offer(n=0, links=[]),
    offer(links=[GpuLink(a=0, b=4, bandwidth=1e9, latency_s=0.0)]),  # unknown GPU
    offer(links=[GpuLink(a=1, b=1, bandwidth=1e9, latency_s=0.0)]),  # self-link
    offer(links=[GpuLink(a=0, b=1, bandwidth=1e9, latency_s=0.0)] * 2),  # measured twice
    offer(links=[GpuLink(a=0, b=1, bandwidth=float("inf"), latency_s=0.0)]),
    offer(links=[GpuLink(a=0, b=1, bandwidth=1e9, latency_s=-1.0)]),
    offer(links=[GpuLink(a=0, b=1, bandwidth=1e9, latency_s=0.0, kind="x" * 600)]),
    MachineInfo(model="m", machine_id="p", gpus=[GpuOffer(device="g", memory_bytes=-1)]),
    MachineInfo(model="m", machine_id="p", gpus=[GpuOffer(device="", memory_bytes=1)]),
])
def test_hostile_offers_are_rejected(bad):
    with pytest.raises(RecordRejected):
        decode_record(encode_record(bad), MachineInfo)


def test_wrong_types_are_malformed():
    raw = msgspec.msgpack.encode({"model": "m", "machine_id": "p", "gpus": [["g", "lots"]]})
    with pytest.raises(MalformedFrameError):
        decode_record(raw, MachineInfo)


def test_peer_tp_is_bounded_and_defaults_to_one():
    base = PeerInfo(model="m", peer_id="p")
    assert decode_record(encode_record(base), PeerInfo).tp == 1
    assert decode_record(encode_record(PeerInfo(model="m", peer_id="p", tp=4)), PeerInfo).tp == 4
    for tp in (0, 9, -1):
        with pytest.raises(RecordRejected):
            decode_record(encode_record(PeerInfo(model="m", peer_id="p", tp=tp)), PeerInfo)
