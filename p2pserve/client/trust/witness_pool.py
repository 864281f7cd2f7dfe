"""The verifier's streams and sessions on witness replicas, kept between checks.

A check replays a hop's input history on another replica. Opening a session for it and closing
it again cost two round trips and two session set-ups on the witness, more than the replay itself
on a small model (an OpenSession, one prefill Forward, a CloseSession per check). So a
:class:`WitnessPool` keeps, per replica, one stream and one open session per span, and a check
starts its replay at position 0 of that session: the peer cuts its cache and its input commitment
back to the position a Forward starts at, exactly as for a client's rewind, so the replay is
computed and signed over the check's inputs alone. A session is opened again when a check needs
more positions than it holds (its ``max_length`` is at least 64, so short checks share one) or
another ``SamplingParams``; one that failed (the peer timed it out, restarted) is dropped and
the check runs once more on a fresh stream and session.

One check at a time per replica (a lock): checks to one replica share its stream.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Optional

from p2pserve.client.connection import HopConnection
from p2pserve.client.hop import Hop
from p2pserve.config import ClientConfig
from p2pserve.protocol import DTYPE_SIZES, PROTOCOL_VERSION, CloseSession, Forward, OpenSession, SamplingParams
from p2pserve.protocol import TensorMeta
from p2pserve.types import PeerId, SessionId


@dataclass
class _Session:
    """An open check session on one replica's stream."""

    session_id: SessionId
    start: int
    end: int
    max_length: int
    sampling: SamplingParams
    steps: int = 0  # Forwards sent on it (the step counter the peer echoes)


class _Replica:
    """One replica's stream, its lock and its open check sessions by span."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.conn: Optional[HopConnection] = None
        self.sessions: dict[tuple[int, int], _Session] = {}


class WitnessPool:
    """Streams and sessions the verifier keeps on witness replicas (see the module docstring)."""

    def __init__(self, transport, model_id: str, num_layers: int, config: ClientConfig):
        self.transport = transport
        self.model_id = model_id
        self.num_layers = num_layers
        self.config = config
        self._replicas: dict[str, _Replica] = {}
        self.opened = 0  # sessions opened on witnesses (each check used to open one)
        self.forwards = 0  # Forwards sent to witnesses

    async def run(self, replica: Hop, calls, max_length: int, sampling: SamplingParams):
        """Send ``calls`` (``(position, rows, dtype, payload, outputs)``, the first at position 0;
        ``outputs`` tokens asked of a last hop, else 1; a last hop's may add ``context, allowed``) to a check session over ``replica``'s span;
        returns each call's (reply, payload) and the session id. A session that fails is dropped
        and the calls are sent once more on a fresh stream and session."""
        entry = self._replicas.setdefault(replica.peer_id, _Replica())
        async with entry.lock:
            for attempt in (0, 1):
                fresh = entry.conn is None or (replica.start, replica.end) not in entry.sessions
                try:
                    return await self._send(entry, replica, calls, max_length, sampling)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    await self._drop(replica.peer_id)
                    entry = self._replicas.setdefault(replica.peer_id, _Replica())
                    if fresh or attempt:  # a fresh session failed too: the replica's fault
                        raise
        raise AssertionError("unreachable")

    async def _send(self, entry: _Replica, replica: Hop, calls, max_length: int, sampling: SamplingParams):
        cfg = self.config
        if entry.conn is None or entry.conn.stream is None:
            entry.conn = HopConnection(self.transport, replica, cfg.frame_limits, cfg.hop_timeout_s,
                                       cfg.connect_timeout_s)
            await entry.conn.connect()
            entry.sessions.clear()
        session = await self._session(entry, replica, max_length, sampling)
        link = HopConnection(self.transport, replica, cfg.frame_limits, cfg.hop_timeout_s, cfg.connect_timeout_s,
                             stream=entry.conn.stream, session_id=session.session_id)
        replies = []
        for position, rows, dtype, payload, k, *last in calls:  # last: a last hop's (context, allowed)
            meta = _meta(dtype, rows, payload)
            step, session.steps = session.steps, session.steps + 1
            self.forwards += 1
            extra = dict(context=last[0], allowed=last[1]) if last else {}
            reply, out = await link.call(Forward(session_id=session.session_id, step=step, position=position,
                                                 tensor=meta, outputs=k, **extra), payload)
            link.check_forward(reply, out, rows, step, position, replica.end == self.num_layers, outputs=k)
            replies.append((reply, out))
        return replies, session.session_id

    async def _session(self, entry: _Replica, replica: Hop, max_length: int, sampling: SamplingParams) -> _Session:
        """The open session over ``replica``'s span, opened (again) when it is too short or samples
        otherwise."""
        span = (replica.start, replica.end)
        session = entry.sessions.get(span)
        if session is not None and session.max_length >= max_length and session.sampling == sampling:
            return session
        if session is not None:
            await entry.conn.call(CloseSession(session_id=session.session_id))
            del entry.sessions[span]
        room = max(64, max_length)  # short sessions share one; a longer check opens a longer one
        session = _Session(secrets.token_hex(16), replica.start, replica.end, room, sampling)
        await entry.conn.call(OpenSession(version=PROTOCOL_VERSION, model_id=self.model_id,
                                          session_id=session.session_id, start=replica.start, end=replica.end,
                                          max_length=room, sampling=sampling, background=True))
        self.opened += 1
        entry.sessions[span] = session
        return session

    async def _drop(self, peer_id: PeerId) -> None:
        entry = self._replicas.pop(peer_id, None)
        if entry is not None and entry.conn is not None:
            await entry.conn.close()

    async def close(self) -> None:
        """Close every stream (the peers free the sessions on them)."""
        for peer_id in list(self._replicas):
            await self._drop(peer_id)


def _meta(dtype: str, rows: int, payload) -> TensorMeta:
    width = len(payload) // max(rows, 1) // DTYPE_SIZES[dtype]
    shape = [rows] if dtype == "int64" else [rows, width]
    return TensorMeta(dtype=dtype, shape=shape, nbytes=len(payload))
