"""The ``kv`` section of benchmarks/runtime.py: the paged KV cache against today's reservation.

* ``admitted_sessions_vs_reservation``: with the same KV memory (SmolLM2's layers, the peer's
  default 2 GiB), how many sessions a peer holds at once under the paged cache over how many it
  admitted when each session reserved ``max_length × layers``. Sessions are (prompt, reply) pairs
  drawn from the Azure conversation trace; each declares ``max_length = prompt + cap`` where the
  cap is the longest reply in the trace (the smallest fixed ``max_new_tokens`` that cuts no reply
  short). Paged sessions are counted at their final length (prompt + reply), the most they hold;
  ``..._mid_reply`` counts them halfway through their reply; ``..._by_declared_cap`` repeats
  the final-length count for other caps (the gain is the cap's to make); ``..._shared_system_prompt``
  assumes the first ``--kv-system-prompt`` tokens of every prompt are one system prompt, whose
  full blocks the sessions share (the trace has lengths only, no content);
  ``..._shipped_default_caps`` is the baseline the shipped clients declare when a request names
  no limit: ``max_length = prompt + max_new_tokens`` with the Python API's default 128 and the
  OpenAI API's (and ``p2pserve chat``'s) 256, each reply cut at that cap on both sides (what
  those clients generate). Through the real `SessionTable`, `PagedCache` and `KVBudget` (no
  tensors are written).
* ``batching_gain_16_vs_1_in_process``: aggregate decode tokens/s of 16 sessions at distinct
  lengths over 1 through one in-process SmolLM2 shard of every layer (``Shard.forward_batch``;
  the fastest step of each, configurations interleaved, since the machine is shared), with the
  paged cache's exact (grouped, bit-identical) attention; the same for its padded one-call mode,
  for the per-sequence path (contiguous `SequenceCache`, one SDPA call per sequence), and for
  sessions at equal lengths (one exact group), all in the same run.
"""

from __future__ import annotations

import random
import time

import torch


def trace_pairs() -> list[tuple[int, int]]:
    """(prompt, reply) token counts of the Azure conversation trace (the Helix data root)."""
    from p2pserve.sim.workload import load_lengths

    prompts, replies = load_lengths("azure_conv")
    return [(int(p), int(r)) for p, r in zip(prompts, replies)]


def admitted(spec, capacity: int, pairs: list[tuple[int, int]], cap: int, paged_length,
             system: int = 0) -> tuple[int, int]:
    """(sessions admitted under the reservation, sessions held by the paged cache) for ``pairs`` in
    order. ``system`` > 0: the first ``system`` tokens of every prompt are one shared system
    prompt, whose full blocks the paged sessions share (prefix sharing; the rest of each
    session's tokens are its own)."""
    from p2pserve.config import AdmissionConfig
    from p2pserve.errors import OverloadedError
    from p2pserve.peer.kv_cache import KVBudget
    from p2pserve.peer.sessions import SessionTable
    from p2pserve.protocol import PROTOCOL_VERSION, OpenSession, SamplingParams

    L = spec.num_layers
    reservation = KVBudget(capacity)
    old = 0
    for prompt, _ in pairs:
        try:
            reservation.reserve((prompt + cap) * L)
        except OverloadedError:
            break
        old += 1
    table = SessionTable(spec=spec, served=(0, L), budget=KVBudget(capacity), idle_timeout_s=1e9, max_sessions=10**6,
                         torch_dtype=torch.float32, admission=AdmissionConfig(max_kv_fraction_per_owner=1.0,
                                                                              max_sessions_per_owner=10**6))
    table.budget.k = table.budget.v = torch.empty(0)  # accounting only: no storage, nothing written
    table.budget.bind = lambda *a, **k: None
    new = 0
    for i, (prompt, reply) in enumerate(pairs):
        msg = OpenSession(version=PROTOCOL_VERSION, model_id=spec.model_id, session_id=f"s{i}", start=0, end=L,
                          max_length=prompt + cap, sampling=SamplingParams())
        length = paged_length(prompt, reply)
        try:
            session = table.open(msg, owner=None)
            if system:  # lengths counted as written, then the content keys of the blocks filled
                session.cache.claim(length)
                shared = torch.arange(min(system, length))
                own = torch.full((length - shared.shape[0],), i, dtype=torch.long)  # another session's tokens
                session.cache.note_written(torch.cat([shared, own]), 0)
            else:
                table.grow(session, length)
        except OverloadedError:
            break
        new += 1
    return old, new


def decode_step_s(shard, spec, caches, prompt: int, steps: int, gen, spread: int = 0) -> float:
    """Fastest decode step (s) of ``len(caches)`` sessions stepping together; prefills them first
    when empty (session i with ``prompt + spread * i`` tokens). The fastest of many steps: the
    machine is shared, and load only adds time."""
    from p2pserve.model.shard import Segment

    L = spec.num_layers
    for i, c in enumerate(caches):
        if c.length == 0:
            x = torch.randint(0, spec.vocab_size, (prompt + spread * i,), generator=gen)
            shard.forward_batch([Segment(x, 0, 0, L, c, True)])
    best = float("inf")
    for _ in range(steps):
        segs = [Segment(torch.randint(0, spec.vocab_size, (1,), generator=gen), c.length, 0, L, c, True) for c in caches]
        t = time.perf_counter()
        shard.forward_batch(segs)
        best = min(best, time.perf_counter() - t)
    return best


def run_kv(args) -> dict:
    """The paged-cache figures (see the module docstring)."""
    from p2pserve.client.model_info import LocalModelInfo
    from p2pserve.model.shard import Shard
    from p2pserve.peer.kv_cache import KVBudget, PagedCache, SequenceCache

    torch.set_num_threads(args.threads)
    model = LocalModelInfo.load(args.model)
    spec = model.spec
    pairs = trace_pairs()
    random.Random(0).shuffle(pairs)
    cap = max(r for _, r in pairs)
    capacity = (2 * 1024**3) // spec.kv_bytes_per_token_layer  # the peer's default kv_memory_bytes
    old, final = admitted(spec, capacity, pairs, cap, lambda p, r: p + r)
    _, mid = admitted(spec, capacity, pairs, cap, lambda p, r: p + (r + 1) // 2)

    shard = Shard.load(model.path, spec, 0, spec.num_layers)
    pools = {}
    for mode, exact in (("exact", True), ("padded", False)):
        pools[mode] = KVBudget(64 * 1024 * spec.num_layers)
        pools[mode].bind(spec.num_kv_heads, spec.head_dim, torch.float32)
        pools[mode].exact = exact
    prompt, steps = args.kv_prompt, args.tokens // 4  # 4 rounds of steps: caches hold prompt + tokens
    longest = prompt + 3 * 16 + 4 * steps + 8

    def paged(mode, n):
        return [PagedCache(pools[mode], 0, spec.num_layers, longest) for _ in range(n)]

    def flat(n):
        return [SequenceCache(0, spec.num_layers, spec.num_kv_heads, spec.head_dim, longest, torch.float32)
                for _ in range(n)]

    # Sessions at one length (one exact group) and at distinct lengths (prompt + 3i: a group each).
    caches = {}
    for spread in (0, 3):
        for n in (1, 16):
            caches |= {(mode, n, spread): paged(mode, n) for mode in ("exact", "padded")}
            caches[("per_sequence", n, spread)] = flat(n)
    best = {key: float("inf") for key in caches}
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):  # the configurations interleaved, so load hits them alike
        for key, cs in caches.items():
            best[key] = min(best[key], decode_step_s(shard, spec, cs, prompt, steps, gen, spread=key[2]))
    rates = {key: key[1] / s for key, s in best.items()}
    system = args.kv_system_prompt
    _, shared_final = admitted(spec, capacity, pairs, cap, lambda p, r: p + r, system=system)
    by_cap = {}
    for name, c in (("p99_reply", sorted(r for _, r in pairs)[int(0.99 * len(pairs))]), ("max_reply", cap),
                    ("2048", 2048), ("4096", 4096)):
        o, f = admitted(spec, capacity, pairs, c, lambda p, r: p + r)
        by_cap[name] = {"cap": c, "reservation": o, "paged": f, "ratio": f / o}
    shipped = {}
    for name, c in (("python_api_128", 128), ("openai_api_256", 256)):
        o, f = admitted(spec, capacity, pairs, c, lambda p, r, c=c: p + min(r, c))
        shipped[name] = {"cap": c, "reservation": o, "paged": f, "ratio": f / o}
    return {
        "model": spec.model_id,
        "threads": args.threads,
        "kv_capacity_token_layers": capacity,
        "trace_sessions_drawn": len(pairs),
        "declared_new_tokens_cap": cap,
        "sessions_admitted_reservation": old,
        "sessions_held_paged_final_length": final,
        "sessions_held_paged_mid_reply": mid,
        "admitted_sessions_vs_reservation": final / old,
        "admitted_sessions_vs_reservation_mid_reply": mid / old,
        "admitted_sessions_vs_reservation_by_declared_cap": by_cap,
        "admitted_sessions_vs_reservation_shipped_default_caps": shipped,
        "shared_system_prompt_tokens": system,
        "sessions_held_paged_shared_system_prompt": shared_final,
        "admitted_sessions_vs_reservation_shared_system_prompt": shared_final / old,
        "kv_prompt_tokens": prompt,
        "decode_tokens_per_s": {f"{mode}_{n}_sessions_{'equal' if spread == 0 else 'distinct'}_lengths": r
                                for (mode, n, spread), r in rates.items()},
        "batching_gain_16_vs_1_in_process": rates["exact", 16, 3] / rates["exact", 1, 3],
        "batching_gain_16_vs_1_in_process_equal_lengths": rates["exact", 16, 0] / rates["exact", 1, 0],
        "batching_gain_16_vs_1_in_process_padded": rates["padded", 16, 3] / rates["padded", 1, 3],
        "batching_gain_16_vs_1_in_process_per_sequence": rates["per_sequence", 16, 3] / rates["per_sequence", 1, 3],
        "exact_vs_per_sequence_16_sessions_distinct_lengths": rates["exact", 16, 3] / rates["per_sequence", 16, 3],
        "exact_vs_per_sequence_16_sessions_equal_lengths": rates["exact", 16, 0] / rates["per_sequence", 16, 0],
        "padded_vs_per_sequence_16_sessions_distinct_lengths": rates["padded", 16, 3] / rates["per_sequence", 16, 3],
        "exact_vs_padded_16_sessions_distinct_lengths": rates["exact", 16, 3] / rates["padded", 16, 3],
    }
