"""Soak benchmark: many long-lived chat sessions for minutes; do the peers' memory and descriptors
stay bounded, and come back down when the clients leave?

A small swarm of real peer processes on loopback (two replicas of each half of a seeded tiny fp32
Llama whose KV cache is 1 KiB per token and layer; one torch thread each; fixed KV budget and a
10 s session idle timeout) serves ``--sessions`` concurrent conversations from one client node.
Each conversation keeps one pipeline (one session per hop) across its turns, so the peers' KV
caches grow turn after turn up to 512 positions; then it starts a new conversation. Sampled per
peer process (psutil; the process alone and with its DHT child and libp2p daemon):

* baseline: after one warm-up request, before the sessions start;
* during: every 5 s (max RSS, max fds), with the peers' own ``GetStats`` (sessions, KV in use);
* after idle: the sessions stop; half close their pipelines (CloseSession), half walk away with
  their streams still open, so only the peers' idle timeout frees them; sampled once that
  timeout has passed (the peers must then hold 0 sessions);
* after close: the walked-away pipelines' connections close and the client node hangs up.

The claim checked: RSS growth over the baseline stays within the KV budget (bytes) plus a
constant. Printed ratios: max RSS growth / KV budget, RSS and fds after vs baseline.

Usage: python benchmarks/soak.py [--minutes 3] [--sessions 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from p2pserve.client.failover import FailoverState  # noqa: E402
from p2pserve.client.generation import Generation  # noqa: E402
from p2pserve.client.model_info import LocalModelInfo  # noqa: E402
from p2pserve.client.node import client_transport  # noqa: E402
from p2pserve.client.params import GenerationParams  # noqa: E402
from p2pserve.client.pipeline import Pipeline  # noqa: E402
from p2pserve.client.route_providers import PeerListRoutes  # noqa: E402
from p2pserve.config import ClientConfig  # noqa: E402
from p2pserve.launch import start_peers  # noqa: E402
from tests.chaos.clients import FOLLOW_UPS, PROMPTS  # noqa: E402
from tests.chaos.monitor import StatsPoller, fd_kinds, process_figures, sockets  # noqa: E402

MAX_LENGTH = 512  # positions per conversation (its sessions reserve this much KV on every hop)
NEW_TOKENS = 48
IDLE_TIMEOUT_S = 10.0
CONFIG = ClientConfig(hop_timeout_s=60.0, max_retries=3)
#: 4 heads of 32 dims in K and V, fp32: 2 x 4 x 32 x 4 = 1 KiB per token and layer
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
             max_position_embeddings=1024)


def peer_figures(peers) -> dict:
    """RSS/fds of every peer process now (see ``process_figures``), with its fds by kind."""
    return {f"peer{i}": dict(process_figures(p.proc.pid) or {}, fd_kinds=fd_kinds(p.proc.pid))
            for i, p in enumerate(peers)}


async def stats_of(poller: StatsPoller, peers) -> dict:
    """Every peer's GetStats answer now (None when it did not answer)."""
    out = {}
    for i, p in enumerate(peers):
        st = await poller.poll(f"peer{i}", p.peer_id, p.maddrs)
        out[f"peer{i}"] = None if st is None else {
            "sessions": st.sessions, "kv_used_token_layers": st.kv_capacity_token_layers - st.kv_free_token_layers,
            "kv_capacity_token_layers": st.kv_capacity_token_layers, "compute_alive": st.compute_alive,
            "compute_restarts": st.compute_restarts}
    return out


async def sample(monitor: StatsPoller, peers) -> dict:
    """Stats first, then figures: the monitor's own connection to each peer is then open in
    every sample, the baseline's included."""
    stats = await stats_of(monitor, peers)
    return {"figures": peer_figures(peers), "stats": stats, "connections": peer_connections(peers)}


def peer_connections(peers) -> dict:
    """Each peer process's sockets by kind (TCP by state, unix), for telling a leak's kind."""
    return {f"peer{i}": sockets(p.proc.pid) for i, p in enumerate(peers)}


class Tally:
    """What the conversations did."""

    def __init__(self):
        self.turns = self.tokens = self.conversations = self.errors = 0
        self.error_texts: list[str] = []


async def conversation(transport, model, hops, state: FailoverState, seed: int, stop: asyncio.Event, tally: Tally,
                       keep: list) -> None:
    """Chat turn after turn on one pipeline until it is full, then start over; on ``stop`` the last
    pipeline is closed (even seeds) or left open, its sessions idle (odd seeds, kept in ``keep``)."""
    rng = random.Random(seed)
    spec = model.spec
    params = GenerationParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    while not stop.is_set():
        pipeline = Pipeline(transport, PeerListRoutes(spec.num_layers, hops, seed=seed + tally.conversations),
                            spec.model_id, spec.num_layers, MAX_LENGTH, params.validate(), CONFIG, state)
        tally.conversations += 1
        messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
        try:
            while not stop.is_set():
                ids = model.chat_ids(messages)
                if len(ids) + NEW_TOKENS > MAX_LENGTH:
                    break
                gen = Generation(pipeline, ids, params, model.eos_ids, model.tokenizer)
                async for _ in gen:
                    pass
                tally.turns += 1
                tally.tokens += len(gen.result.tokens)
                messages += [{"role": "assistant", "content": gen.result.text},
                             {"role": "user", "content": rng.choice(FOLLOW_UPS + PROMPTS)}]
        except Exception as e:  # counted and reported; the soak goes on with a new conversation
            tally.errors += 1
            tally.error_texts.append(f"{type(e).__name__}: {str(e)[:300]}")
        if stop.is_set() and seed % 2:
            keep.append(pipeline)  # walks away: only the peers' idle timeout frees these sessions
        else:
            await pipeline.close()


async def soak(model, peers, sessions: int, seconds: float) -> dict:
    """Baseline, the soak itself, then the clients leaving; returns every sample."""
    hops = [p.hop() for p in peers]
    transport = await client_transport(CONFIG)
    monitor = StatsPoller(await client_transport(ClientConfig()))
    out: dict = {"samples": []}
    tally, keep, stop = Tally(), [], asyncio.Event()
    state = FailoverState(CONFIG)
    try:
        warm = Pipeline(transport, PeerListRoutes(model.spec.num_layers, hops, seed=0), model.spec.model_id,
                        model.spec.num_layers, 64, GenerationParams(max_new_tokens=8).validate(), CONFIG, state)
        async for _ in Generation(warm, model.chat_ids([{"role": "user", "content": PROMPTS[0]}]),
                                  GenerationParams(max_new_tokens=8, ignore_eos=True), model.eos_ids):
            pass
        await warm.close()
        await asyncio.sleep(1.0)
        out["baseline"] = await sample(monitor, peers)
        t0 = time.monotonic()
        tasks = [asyncio.create_task(conversation(transport, model, hops, state, 1000 + i, stop, tally, keep))
                 for i in range(sessions)]
        while time.monotonic() - t0 < seconds:
            await asyncio.sleep(5.0)
            out["samples"].append({"t": round(time.monotonic() - t0, 1), **await sample(monitor, peers)})
        stop.set()
        await asyncio.gather(*tasks)
        out["left_open"] = len(keep)
        await asyncio.sleep(IDLE_TIMEOUT_S + 5.0)  # reapers run every idle_timeout / 4
        out["after_idle"] = await sample(monitor, peers)
        # then the walked-away clients' connections end too (as when their process exits): a
        # transport's close() does not close the direct connections it handed out
        await asyncio.gather(*(p.close() for p in keep))
        await transport.close()
        transport = None
        await asyncio.sleep(3.0)
        out["after_close"] = await sample(monitor, peers)
    finally:
        if transport is not None:
            await transport.close()
        await monitor.close()
        await monitor.transport.close()
    out["tally"] = {"conversations": tally.conversations, "turns": tally.turns, "tokens": tally.tokens,
                    "errors": tally.errors, "error_texts": tally.error_texts[:10], "seconds": seconds}
    return out


def summarize(raw: dict, kv_budget_bytes: int, kv_bytes_per_token_layer: int) -> dict:
    """Per peer: baseline, max during, after idle, after close; and the ratios the docstring names."""
    mib = 1 / 2**20
    peers = {}
    for name, base in raw["baseline"]["figures"].items():
        during = [s["figures"][name] for s in raw["samples"] if s["figures"].get(name)]
        kv_used = [s["stats"][name]["kv_used_token_layers"] for s in raw["samples"] if s["stats"].get(name)]
        idle, closed = raw["after_idle"]["figures"][name], raw["after_close"]["figures"][name]
        growth = max(f["rss_main"] for f in during) - base["rss_main"]
        peers[name] = {
            "rss_main_mib": {"baseline": base["rss_main"] * mib, "max": (base["rss_main"] + growth) * mib,
                             "after_idle": idle["rss_main"] * mib, "after_close": closed["rss_main"] * mib},
            "rss_total_mib": {"baseline": base["rss_total"] * mib, "max": max(f["rss_total"] for f in during) * mib,
                              "after_close": closed["rss_total"] * mib},
            "fds_main": {"baseline": base["fds_main"], "max": max(f["fds_main"] for f in during),
                         "after_idle": idle["fds_main"], "after_close": closed["fds_main"]},
            "fds_total": {"baseline": base["fds_total"], "max": max(f["fds_total"] for f in during),
                          "after_close": closed["fds_total"]},
            "kv_in_use_max_mib": max(kv_used, default=0) * kv_bytes_per_token_layer * mib,
            "sessions_max": max((s["stats"][name]["sessions"] for s in raw["samples"] if s["stats"].get(name)), default=0),
            "sessions_after_idle": (raw["after_idle"]["stats"].get(name) or {}).get("sessions"),
            # a leak keeps growing after the caches reached their working size: half-way vs end
            "rss_main_mid_run_mib": during[len(during) // 2]["rss_main"] * mib,
            "rss_main_end_of_run_mib": during[-1]["rss_main"] * mib,
            "rss_growth_max_mib": growth * mib,
            "rss_growth_over_kv_budget": growth / kv_budget_bytes,
            "rss_growth_minus_kv_budget_mib": (growth - kv_budget_bytes) * mib,
            "rss_after_close_minus_baseline_mib": (closed["rss_main"] - base["rss_main"]) * mib,
            "fds_after_close_minus_baseline": closed["fds_main"] - base["fds_main"],
            "fd_kinds": {"baseline": base["fd_kinds"], "after_close": closed["fd_kinds"]},
            "sockets": {"baseline": raw["baseline"]["connections"][name],
                        "after_idle": raw["after_idle"]["connections"][name],
                        "after_close": raw["after_close"]["connections"][name]},
        }
    return peers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "soak.json"))
    args = ap.parse_args()
    import torch

    from p2pserve.model.tiny import build_tiny_model

    torch.set_num_threads(1)
    # peer processes must import this tree, whatever an editable install points at
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    path = str(build_tiny_model("llama", Path(tempfile.mkdtemp(prefix="p2pserve-soak-")) / "llama", seed=0,
                                num_layers=8, **SHAPE))
    model = LocalModelInfo.load(path)
    spec, half = model.spec, model.spec.num_layers // 2
    # room for every session on one replica of a half: the budget, not luck, bounds memory
    kv_token_layers = args.sessions * MAX_LENGTH * half
    kv_budget_bytes = kv_token_layers * spec.kv_bytes_per_token_layer
    flags = ("--kv-token-layers", str(kv_token_layers), "--session-idle-timeout", str(IDLE_TIMEOUT_S),
             "--max-kv-fraction-per-owner", "1")  # one client node holds every session by design
    print(f"model {spec.model_id}: {spec.kv_bytes_per_token_layer} B of KV per token-layer; KV budget per peer "
          f"{kv_budget_bytes / 2**20:.0f} MiB; {args.sessions} sessions for {args.minutes:g} min", flush=True)
    peers = start_peers(path, [(0, half), (0, half), (half, spec.num_layers), (half, spec.num_layers)], *flags)
    try:
        raw = asyncio.run(soak(model, peers, args.sessions, args.minutes * 60))
    finally:
        for p in peers:
            p.stop()
    report = {"model": spec.model_id, "sessions": args.sessions, "minutes": args.minutes, "max_length": MAX_LENGTH,
              "idle_timeout_s": IDLE_TIMEOUT_S, "kv_budget_bytes_per_peer": kv_budget_bytes,
              "kv_bytes_per_token_layer": spec.kv_bytes_per_token_layer, "tally": raw["tally"],
              "left_open": raw["left_open"], "peers": summarize(raw, kv_budget_bytes, spec.kv_bytes_per_token_layer),
              "raw": raw}
    for name, p in report["peers"].items():
        print(f"{name}: RSS {p['rss_main_mib']['baseline']:.0f} -> max {p['rss_main_mib']['max']:.0f} -> after idle "
              f"{p['rss_main_mib']['after_idle']:.0f} -> after close {p['rss_main_mib']['after_close']:.0f} MiB "
              f"(growth {p['rss_growth_max_mib']:.0f} MiB = {p['rss_growth_over_kv_budget']:.2f} x KV budget; "
              f"KV in use max {p['kv_in_use_max_mib']:.0f} MiB); fds {p['fds_main']['baseline']} -> max "
              f"{p['fds_main']['max']} -> {p['fds_main']['after_close']}; sessions max {p['sessions_max']}, "
              f"after idle {p['sessions_after_idle']}", flush=True)
    print(json.dumps(report["tally"]))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
