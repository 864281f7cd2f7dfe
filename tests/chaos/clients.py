"""Chat clients of the chaos run: continuous greedy chats, each reply checked token for token
against single-process ``transformers`` ``generate`` on the same weights.

Conversations come from a fixed pool (a first turn, and a second turn that quotes the first
reply), so every reference is computed once, before the chaos starts: the event loop that runs
the clients never blocks on a reference forward.

"Lost" is strict: a request whose ``chat()`` raised anything (or ran past ``request_deadline_s``,
a stuck client) is lost. Nothing retries at the application level; recovery is the client's own
failover (its ``max_retries`` pipeline rebuilds per step).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

PROMPTS = [
    "Hello! How are you today?",
    "What is the capital of France?",
    "Tell me about peer-to-peer networks.",
    "Explain pipelines, flows and placements.",
    "The quick brown fox jumps over the lazy dog.",
    "Count the numbers 0 1 2 3 4 5 6 7 8 9.",
    "Why split a model's layers across many machines?",
    "What is a cache?",
    "Say something about the lazy dog.",
    "How are flows and caches related?",
    "Thank you, I am fine.",
    "Which machines serve the model?",
]
FOLLOW_UPS = ["And then?", "Why?", "Say it again in other words."]


@dataclass(frozen=True)
class Conversation:
    """Messages to send and the reference reply tokens for them."""

    messages: tuple
    reference: tuple[int, ...]


def build_conversations(model, model_path: str, max_new_tokens: int) -> list[Conversation]:
    """First turns of every prompt, and a second turn after each (the first reply quoted as the
    assistant's text), each with its reference from ``tests.harness.reference_generate``."""
    from tests.harness import reference_generate

    out = []
    for i, text in enumerate(PROMPTS):
        first = ({"role": "user", "content": text},)
        ref = reference_generate(model_path, model.chat_ids(list(first)), max_new_tokens)
        out.append(Conversation(first, tuple(ref)))
        said = model.tokenizer.decode(ref, skip_special_tokens=True)
        second = first + ({"role": "assistant", "content": said},
                          {"role": "user", "content": FOLLOW_UPS[i % len(FOLLOW_UPS)]})
        out.append(Conversation(second, tuple(reference_generate(model_path, model.chat_ids(list(second)),
                                                                 max_new_tokens))))
    return out


@dataclass
class ClientTally:
    """What the chat clients saw."""

    completed: int = 0
    identical: int = 0
    lost: int = 0
    started: int = 0
    with_failover: int = 0  # completed requests whose pipeline re-routed at least once
    hop_failures: int = 0
    failure_reasons: Counter = field(default_factory=Counter)
    lost_errors: list[str] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        done = self.completed
        lat = sorted(self.latencies)
        return {
            "started": self.started, "completed": done, "lost": self.lost,
            "identical": self.identical,
            "identical_pct": 100.0 * self.identical / done if done else 0.0,
            "requests_with_failover": self.with_failover, "hop_failures": self.hop_failures,
            "hop_failure_reasons": dict(self.failure_reasons.most_common(12)),
            "latency_s": {"median": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)], "max": lat[-1]} if lat else {},
            "lost_errors": self.lost_errors[:20], "mismatches": self.mismatches[:10],
        }


def reason_of(failure_text: str) -> str:
    """A failure record's reason without the peer id and address (for counting by kind)."""
    text = failure_text.split(": ", 1)[-1]
    return text.split(" (")[0][:80]


async def chat_worker(client, conversations: list[Conversation], tally: ClientTally, stop: asyncio.Event,
                      seed: int, max_new_tokens: int, request_deadline_s: float, lost_pause_s: float = 1.0) -> None:
    """Chat until ``stop`` is set (the request in flight finishes), one request at a time."""
    rng = random.Random(seed)
    while not stop.is_set():
        conv = rng.choice(conversations)
        tally.started += 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(request_deadline_s):
                reply = await client.chat(list(conv.messages), max_new_tokens=max_new_tokens, ignore_eos=True)
        except Exception as e:  # lost: it reached the caller despite failover (or hung: TimeoutError)
            tally.lost += 1
            kind = "stuck past the deadline" if isinstance(e, TimeoutError) else type(e).__name__
            tally.lost_errors.append(f"{time.time():.1f} {kind}: {str(e)[:1500]}")
            # a user who got an error waits a moment before the next request (no spinning on a
            # failure that returns at once); the failed request is not sent again
            await asyncio.sleep(lost_pause_s)
            continue
        tally.latencies.append(time.monotonic() - t0)
        tally.completed += 1
        if reply.failures:
            tally.with_failover += 1
            tally.hop_failures += len(reply.failures)
            tally.failure_reasons.update(reason_of(f) for f in reply.failures)
        if tuple(reply.tokens) == conv.reference:
            tally.identical += 1
        else:
            tally.mismatches.append({"messages": conv.messages[-1]["content"], "got": reply.tokens,
                                     "want": list(conv.reference), "routes": reply.route_text(),
                                     "failures": reply.failures})
