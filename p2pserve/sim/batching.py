"""How a node sizes each per-layer batch: fixed caps (Helix) or gLLM token throttling.

Both policies answer one question when a node forms a batch for one layer: at most how many
prompt requests, prompt tokens and decode tokens may it take from that layer's FIFO queues.

* :class:`CapsPolicy` — the Helix simulator's static caps from ``machine_params.json``:
  ``prompt_max_requests[k]``, ``prompt_max_tokens = requests * 2048`` and ``decode_max_tokens[k]``.
* :class:`ThrottlePolicy` — gLLM §3 token throttling on top of those caps. Prefill tokens per
  batch ``#P = max(min(#WP / T, MaxP * (KVfree - KVthresh) / (1 - KVthresh)), MinP)`` where
  ``#WP`` is the waiting prompt tokens; decode tokens per batch ``#D = ceil(#RD / depth)`` where
  ``#RD`` is the decode-phase queries running through the node and ``depth`` their mean pipeline
  depth, so that each micro-batch in the pipeline carries an even share of the decode work.
  With ``chunk_prefill`` (Sarathi/gLLM chunked prefill) a prompt that does not fit the batch's
  prefill budget is split: the batch takes the tokens that fit and the rest waits at that layer
  for the next batch there. Without it a prompt job is atomic: a batch always admits at least its
  first waiting prompt, and the budget limits how many more join it.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pserve import throttle


@dataclass(frozen=True)
class BatchCaps:
    """Static per-batch limits of a node holding ``k`` layers."""

    prompt_max_requests: int
    prompt_max_tokens: int
    decode_max_tokens: int


class CapsPolicy:
    """Helix's static caps; the node reads them once (no per-batch call)."""

    name = "caps"
    dynamic = False
    chunk_prefill = False

    def limits(self, caps: BatchCaps, waiting_prompt_tokens: int, kv_free: float,
               running_decodes: int, mean_depth: float) -> tuple[int, int, int]:
        """The caps themselves, whatever the state."""
        return caps.prompt_max_requests, caps.prompt_max_tokens, caps.decode_max_tokens


@dataclass
class ThrottlePolicy:
    """gLLM token throttling (defaults from the gLLM paper: T=8, MaxP=2048, MinP=32, 0.05)."""

    iterations: int = 8  # #T: spread waiting prefill over this many batches
    max_prefill: int = 2048  # #MaxP
    min_prefill: int = 32  # #MinP
    kv_thresh: float = 0.05  # KVthresh
    throttle_decode: bool = True  # False: only the prefill budget (decode keeps its cap)
    chunk_prefill: bool = False  # split prompts at the prefill budget (chunked prefill)
    name: str = "throttle"
    dynamic: bool = True

    def limits(self, caps: BatchCaps, waiting_prompt_tokens: int, kv_free: float,
               running_decodes: int, mean_depth: float) -> tuple[int, int, int]:
        """Budgets for one batch, never above the node's static caps."""
        prefill = throttle.prefill_budget(waiting_prompt_tokens, kv_free, iterations=self.iterations,
                                          max_prefill=self.max_prefill, min_prefill=self.min_prefill,
                                          kv_thresh=self.kv_thresh, whole_spread=False)
        if not self.throttle_decode:
            decode = caps.decode_max_tokens
        else:
            decode = throttle.decode_budget(running_decodes, mean_depth)
        return (
            caps.prompt_max_requests,
            min(caps.prompt_max_tokens, prefill),
            max(1, min(caps.decode_max_tokens, decode)),
        )
