"""A query (one user request) and its route through the cluster.

A query is one prompt job (all ``input_len`` tokens) followed by ``output_len`` decode jobs of
one token each, all on the same route. A query has at most one job in flight, so the query
object itself travels through nodes and links; ``is_prompt`` says which kind of job it is now.
Fields are plain attributes (``__slots__``) because the simulator touches them in its hot loop.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage: ``node`` runs layers ``[start, end)`` of the model."""

    node: int
    start: int
    end: int

    @property
    def layers(self) -> int:
        """Number of layers this stage runs."""
        return self.end - self.start


class Query:
    """A request in the simulator, with its route and progress."""

    __slots__ = (
        "qid",
        "input_len",
        "output_len",
        "arrival",
        "route",
        "hop",
        "is_prompt",
        "tokens",
        "decoded",
        "job_start",
        "entry",
        "exit",
        "kv_need",
        "prompt_done",
        "finished",
        "recompute",
        "chunk_done",
        "prefilled",
        "prompt_route",
    )

    def __init__(self, qid: int, input_len: int, output_len: int, arrival: float) -> None:
        self.qid = qid
        self.input_len = input_len
        self.output_len = output_len
        self.arrival = arrival  # when the query reached the coordinator
        self.route: tuple[Stage, ...] = ()
        self.hop = 0  # index into route of the stage the current job is at
        self.is_prompt = True
        self.tokens = input_len  # tokens of the current job (input_len, then 1 per decode)
        self.decoded = 0  # decode jobs finished
        self.job_start = arrival  # when the current job left the coordinator
        self.entry = 0  # first layer of the current stage (set on arrival at a node)
        self.exit = 0  # one past the last layer of the current stage
        self.kv_need: dict[int, int] = {}  # node -> token-layer entries reserved by the scheduler
        self.prompt_done = -1.0
        self.finished = -1.0
        self.recompute = False  # a decode job rebuilding context preempted on this node
        self.chunk_done = 0  # chunked prefill: tokens of this prompt job already through its current layer
        self.prefilled = False  # prefill/decode split: the prompt ran elsewhere, its KV comes over the links
        self.prompt_route: tuple[Stage, ...] = ()  # ... from this route's nodes (sim/disagg.py)

    def __repr__(self) -> str:
        kind = "prompt" if self.is_prompt else f"decode#{self.decoded}"
        return f"Query({self.qid}, {kind}, hop={self.hop}/{len(self.route)})"
