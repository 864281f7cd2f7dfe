"""The requests this process made through the swarm: their routes and speed (pure log + a thin
client wrapper).

Only the process that sends requests knows the routes they took: the peers see one hop each and
the DHT holds no routes. ``p2pserve api --dashboard`` therefore wraps its ``AsyncClient`` in a
:class:`RecordingClient`, which logs every finished (or failed) generation in a bounded
:class:`RequestLog`; a ``status`` or ``coordinator`` dashboard has no such log and shows what
clients report instead (``ServiceReports``, :mod:`p2pserve.dashboard.document`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

from p2pserve import clock as clocks
from p2pserve.clock import Clock


@dataclass(frozen=True)
class RequestRecord:
    """One generation: when it ended, the last route it used as ``(peer_id, start, end)`` hops,
    how many routes it opened (1 + failovers), tokens generated, seconds, and how it ended (the
    finish reason, or the error's type)."""

    finished_at: float
    route: tuple[tuple[str, int, int], ...]
    routes: int
    tokens: int
    prompt_tokens: int
    elapsed_s: float
    first_token_s: Optional[float]
    outcome: str

    def as_json(self) -> dict[str, Any]:
        """The record as ``/api/swarm`` lists it."""
        return {
            "finished_at": self.finished_at,
            "hops": [{"peer_id": p, "start": a, "end": b} for p, a, b in self.route],
            "routes": self.routes, "tokens": self.tokens, "prompt_tokens": self.prompt_tokens,
            "elapsed_s": round(self.elapsed_s, 4),
            "first_token_s": None if self.first_token_s is None else round(self.first_token_s, 4),
            "tokens_per_s": round(self.tokens / self.elapsed_s, 3) if self.elapsed_s > 0 else None,
            "outcome": self.outcome,
        }


def _hops(route) -> tuple[tuple[str, int, int], ...]:
    return tuple((h.peer_id, int(h.start), int(h.end)) for h in route)


class RequestLog:
    """The last ``max_records`` requests, and running totals (``tokens_total`` feeds the served
    tokens/s history)."""

    def __init__(self, max_records: int = 50, clock: Clock = clocks.wall):
        self.records: deque[RequestRecord] = deque(maxlen=max_records)
        self.tokens_total = 0
        self.requests_total = 0
        self.failures_total = 0
        self._clock = clock

    def add(self, record: RequestRecord) -> None:
        """Log one finished request."""
        self.records.append(record)
        self.tokens_total += record.tokens
        self.requests_total += 1
        self.failures_total += record.outcome not in ("stop", "length")

    def add_reply(self, reply) -> None:
        """Log a finished ``client.reply.Reply``."""
        self.add(RequestRecord(self._clock(), _hops(reply.route), len(reply.routes), len(reply.tokens),
                               reply.prompt_tokens, reply.elapsed_s, reply.first_token_s, reply.finish_reason))

    def add_failure(self, pipeline, error: BaseException, elapsed_s: float) -> None:
        """Log a generation that failed with ``error`` (its pipeline tells the routes it tried)."""
        log = list(getattr(pipeline, "route_log", ()) or ())
        self.add(RequestRecord(self._clock(), _hops(log[-1]) if log else (), len(log), 0, 0, elapsed_s, None,
                               type(error).__name__))

    def recent(self) -> list[dict[str, Any]]:
        """The logged requests, newest first."""
        return [r.as_json() for r in reversed(self.records)]


class _RecordedStream:
    """A ``ReplyStream`` that logs its reply (or its failure) when it ends; everything else is
    the wrapped stream's."""

    def __init__(self, stream, log: RequestLog):
        self._stream = stream
        self._log = log
        self._started = time.monotonic()
        self._logged = False

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def __aiter__(self) -> "_RecordedStream":
        return self

    async def __anext__(self) -> str:
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            self._record(None)
            raise
        except Exception as e:
            self._record(e)
            raise

    async def open(self) -> None:
        """Open the route (see ``ReplyStream.open``); a failure is logged."""
        try:
            await self._stream.open()
        except Exception as e:
            self._record(e)
            raise

    def _record(self, error: Optional[BaseException]) -> None:
        if self._logged:
            return
        self._logged = True
        if error is None and self._stream.reply is not None:
            self._log.add_reply(self._stream.reply)
        elif error is not None:
            self._log.add_failure(getattr(self._stream, "pipeline", None), error, time.monotonic() - self._started)


class RecordingClient:
    """An ``AsyncClient`` whose streamed and whole generations are logged in ``log``; every
    other attribute is the client's own."""

    def __init__(self, client, log: RequestLog):
        self._client = client
        self.log = log

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def generate_stream(self, *args, **kwargs):
        """``AsyncClient.generate_stream``, logged when it ends."""
        return _RecordedStream(self._client.generate_stream(*args, **kwargs), self.log)

    def chat_stream(self, *args, **kwargs):
        """``AsyncClient.chat_stream``, logged when it ends."""
        return _RecordedStream(self._client.chat_stream(*args, **kwargs), self.log)

    async def chat(self, *args, **kwargs):
        """``AsyncClient.chat``, logged."""
        reply = await self._client.chat(*args, **kwargs)
        self.log.add_reply(reply)
        return reply

    async def generate(self, *args, **kwargs):
        """``AsyncClient.generate``, logged."""
        reply = await self._client.generate(*args, **kwargs)
        self.log.add_reply(reply)
        return reply
