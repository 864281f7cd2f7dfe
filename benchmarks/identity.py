"""What the identity rules cost a reader: per record, against decoding and validating it.

Every record a reader takes from the DHT is decoded and validated (the baseline); the identity
rules add deriving the signer's peer id from its public key (cached per key), the binding
check, the time bounds and the allow-list (``p2pserve/dht/acceptance.py``). Measured on 256
PeerInfo records with 32-entry tables, each signed by its own key, read through the real
``Swarm`` over an in-memory DHT.

    python benchmarks/identity.py [--records 256] [--rounds 20] [--json benchmarks/results/identity.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from p2pserve.config import DHTConfig
from p2pserve.dht.acceptance import expiration_reason, identity_reason, membership_reason, timestamp_reason
from p2pserve.dht.identity import peer_id_of
from p2pserve.dht.keys import RecordKind, record_key
from p2pserve.dht.records import PeerInfo, decode_record, encode_record
from p2pserve.dht.signing import load_or_create_key, owner_subkey, public_key_text
from p2pserve.dht.swarm import Swarm
from p2pserve.testing import FakeClock, FakeDHT


def _median_us(f, rounds: int, per: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) / per * 1e6)
    return statistics.median(times)


def measure(records: int = 256, rounds: int = 20) -> dict:
    """Per-record microseconds of decoding (baseline), the rules, and a whole ``get_peers``."""
    keys = [load_or_create_key(None) for _ in range(records)]
    texts = [public_key_text(k) for k in keys]
    clock = FakeClock()
    infos = [PeerInfo(model="bench", peer_id=peer_id_of(t), max_layers=32, throughput_decode=[1e3 / j for j in
                                                                                               range(1, 33)],
                      timestamp=clock()) for t in texts]
    blobs = [encode_record(i) for i in infos]
    dht = FakeDHT()
    dht.data[record_key("s", "bench", RecordKind.PEERS)] = {
        owner_subkey(k): FakeDHT.Entry(b, clock() + 5.0) for k, b in zip(keys, blobs)}
    reader = Swarm(DHTConfig(model="bench", swarm_id="s"), dht, keys[0], clock=clock)
    open_read = _median_us(lambda: asyncio.run(reader.get_peers()), rounds, records)
    members = Swarm(DHTConfig(model="bench", swarm_id="s", allowed_peers=tuple(i.peer_id for i in infos)), dht,
                    keys[0], clock=clock)
    member_read = _median_us(lambda: asyncio.run(members.get_peers()), rounds, records)
    assert len(asyncio.run(members.get_peers())) == records
    decode = _median_us(lambda: [decode_record(b, PeerInfo) for b in blobs], rounds, records)
    uncached = _median_us(lambda: [peer_id_of.__wrapped__(t) for t in texts], 3, records)
    allowed = frozenset(i.peer_id for i in infos)

    def rules():
        for t, i in zip(texts, infos):
            pid = peer_id_of(t)
            assert not (expiration_reason(clock() + 5.0, clock(), 10.0, 2.0) or membership_reason("peers", pid, allowed)
                        or identity_reason(i, pid) or timestamp_reason(i, clock(), 2.0))

    rules_us = _median_us(rules, rounds, records)
    return {
        "records": records,
        "decode_validate_us": decode,
        "get_peers_us_per_record": open_read,
        "get_peers_allow_list_us_per_record": member_read,
        "peer_id_of_uncached_us": uncached,
        "rules_us": rules_us,
        "rules_over_decode": rules_us / decode,
        "read_over_decode": open_read / decode,
        "read_with_allow_list_over_decode": member_read / decode,
    }


def main() -> None:
    """Run, print the figures and ratios, write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=256)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", default="benchmarks/results/identity.json")
    args = p.parse_args()
    out = measure(args.records, args.rounds)
    print(f"decode + validate (baseline)      {out['decode_validate_us']:8.1f} us/record")
    print(f"identity + time + allow-list rules {out['rules_us']:7.1f} us/record "
          f"({out['rules_over_decode']:.2f}x the baseline)")
    print(f"get_peers, open swarm             {out['get_peers_us_per_record']:8.1f} us/record "
          f"({out['read_over_decode']:.2f}x the baseline)")
    print(f"get_peers, allow-list of {args.records:<5d}    {out['get_peers_allow_list_us_per_record']:8.1f} "
          f"us/record ({out['read_with_allow_list_over_decode']:.2f}x)")
    print(f"peer_id_of, first sight of a key  {out['peer_id_of_uncached_us']:8.1f} us (then cached)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
