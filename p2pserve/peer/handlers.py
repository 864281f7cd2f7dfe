"""RPC edge of the peer: reads frames from a session stream, answers each with a reply.

This is one of the few places that catch broad exceptions: whatever a client sends, the peer
answers with a typed ``ErrorReply`` and keeps serving every other session. A frame whose size
limit is exceeded leaves the stream out of sync, so that stream alone is closed after the reply.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from p2pserve import __version__
from p2pserve.errors import (
    BadRequestError,
    ErrorCode,
    P2PServeError,
    PayloadTooLargeError,
    WIRE_ERRORS,
    ModelMismatchError,
)
from p2pserve.model.spec import ModelSpec
from p2pserve.peer.sessions import SessionTable
from p2pserve.peer.timing import RecentTimes
from p2pserve.peer.worker import ComputeWorker, Job
from p2pserve.protocol import (
    CloseSession,
    DirectOffer,
    ErrorReply,
    Forward,
    ForwardResult,
    FrameLimits,
    GetStats,
    PeerStats,
    OpenDirect,
    OpenSession,
    SessionClosed,
    SessionOpened,
    decode_request,
    error_reply,
)
from p2pserve.transport.frames import read_frame, tensor_from_wire, tensor_to_wire, write_frame

log = logging.getLogger(__name__)


class SessionHandler:
    """Serves the session protocol on any transport's streams (libp2p, the direct path)."""

    def __init__(
        self,
        spec: ModelSpec,
        table: SessionTable,
        worker: ComputeWorker,
        limits: FrameLimits,
        request_timeout_s: float,
    ):
        self.spec = spec
        self.table = table
        self.worker = worker
        self.limits = limits
        self.request_timeout_s = request_timeout_s
        self.streams_open = 0
        self.direct = None  # a DirectListener when this peer offers the direct TCP path
        self.inline_window_s = worker.throttle.config.inline_lone_decode_s
        self._last_session: str | None = None  # the session of the latest Forward
        self._alone_since = 0.0  # when that session became the only one sending
        self._service = RecentTimes()  # recent Forwards, frame read to reply written

    async def handle_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A transport's stream handler (``StreamHandler``): serve frames until the client hangs up."""
        owner = object()
        self.streams_open += 1
        try:
            while True:
                try:
                    header, payload = await read_frame(reader, self.limits)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                except PayloadTooLargeError as e:
                    await self._reply_error(writer, e)
                    return  # the body was not read, so the stream is out of sync
                t0 = time.perf_counter()
                reply, out_payload = await self._dispatch(header, payload, owner)
                await write_frame(writer, reply, out_payload)
                if isinstance(reply, ForwardResult):
                    self._service.add(time.perf_counter() - t0)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self.streams_open -= 1
            closed = self.table.close_owned_by(owner)
            if closed:
                log.debug("stream closed; freed %d session(s)", closed)
            try:
                writer.close()
            except Exception:  # the transport may already be gone
                pass

    async def _reply_error(self, writer, exc: P2PServeError) -> None:
        try:
            await write_frame(writer, error_reply(exc.code, exc.message))
        except (ConnectionError, RuntimeError):
            pass

    async def _dispatch(self, header: bytes, payload: bytes, owner) -> tuple[object, bytes]:
        session_id = step = None
        try:
            msg = decode_request(header)
            session_id = getattr(msg, "session_id", None)
            step = getattr(msg, "step", None)
            if isinstance(msg, OpenSession):
                return self._open(msg, owner), b""
            if isinstance(msg, Forward):
                return await self._forward(msg, payload, owner)
            if isinstance(msg, GetStats):
                return self.stats(), b""
            if isinstance(msg, OpenDirect):
                return (self.direct.offer() if self.direct else DirectOffer(port=0)), b""
            if isinstance(msg, CloseSession):
                self.table.close(msg.session_id, owner)
                return SessionClosed(session_id=msg.session_id), b""
            raise BadRequestError(f"unexpected message {type(msg).__name__}")
        except WIRE_ERRORS as e:
            log.info("rejected request (%s): %s", e.code.value, e.message)
            return ErrorReply(code=e.code.value, message=e.message, session_id=session_id, step=step), b""
        except Exception as e:  # never crash on input: report and keep serving
            log.exception("internal error while handling a request")
            return error_reply(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", session_id, step), b""

    def stats(self) -> PeerStats:
        """Current load and batching counters."""
        st, budget = self.worker.stats, self.table.budget
        lo, hi = self.table.served or (0, 0)
        return PeerStats(
            model_id=self.spec.model_id,
            served_start=lo,
            served_end=hi,
            sessions=len(self.table),
            kv_capacity_token_layers=budget.capacity,
            kv_free_token_layers=budget.free,
            queued_tokens=self.worker.queued_tokens,
            steps=st.steps,
            tokens=st.tokens,
            max_batch_tokens=st.max_batch_tokens,
            max_batch_sessions=st.max_batch_sessions,
            inline_steps=st.inline_steps,
            service_ms=self._service.median_ms,
            compute_ms=st.compute.median_ms,
            compute_alive=self.worker.alive,
            compute_restarts=self.worker.restarts,
            stuck_s=self.worker.stuck_for(),
        )

    def _open(self, msg: OpenSession, owner) -> SessionOpened:
        if msg.model_id != self.spec.model_id:
            raise ModelMismatchError(f"this peer serves model {self.spec.model_id!r}, not {msg.model_id!r}")
        session = self.table.open(msg, owner)
        lo, hi = self.table.served
        return SessionOpened(
            session_id=session.id,
            start=session.start,
            end=session.end,
            served_start=lo,
            served_end=hi,
            hidden_size=self.spec.hidden_size,
            dtype=self.spec.dtype,
            peer_version=__version__,
        )

    async def _forward(self, msg: Forward, payload: bytes, owner) -> tuple[ForwardResult, bytes]:
        session = self.table.get(msg.session_id, owner)
        if session.busy:
            raise BadRequestError(f"session {msg.session_id!r} already has a request in flight")
        inputs = tensor_from_wire(msg.tensor, payload)
        self._check_inputs(session, inputs)
        n = inputs.shape[0]
        if msg.position > session.position:
            raise BadRequestError(
                f"position {msg.position} skips ahead of the session's {session.position} cached tokens"
            )
        if msg.position + n > session.max_length:
            raise BadRequestError(
                f"positions up to {msg.position + n} exceed the session's max_length {session.max_length}"
            )
        if msg.position < session.position:
            session.cache.truncate(msg.position)  # the client rewinds (e.g. regenerates a turn)
        loop = asyncio.get_running_loop()
        job = Job(
            session=session,
            inputs=inputs,
            position=msg.position,
            sample=session.end == self.spec.num_layers,
            future=loop.create_future(),
            loop=loop,
        )
        session.busy = True
        try:
            if not (n == 1 and self._alone(session.id) and self.worker.run_inline(job)):
                self.worker.submit(job)
            # asyncio.timeout wraps no extra task around the future (wait_for would): this is
            # on every hop of every token.
            async with asyncio.timeout(self.request_timeout_s):
                result = await job.future
        finally:
            session.busy = False
            session.last_used = self.table.clock()
        position = msg.position + n
        if isinstance(result, int):
            return ForwardResult(session_id=session.id, step=msg.step, position=position, token=result), b""
        meta, data = tensor_to_wire(result)
        return ForwardResult(session_id=session.id, step=msg.step, position=position, tensor=meta), data

    def _alone(self, session_id: str) -> bool:
        """Whether only ``session_id`` has sent Forwards for ``inline_window_s`` (nobody to batch with)."""
        now = time.monotonic()
        if session_id != self._last_session:
            self._last_session, self._alone_since = session_id, now
        return self.inline_window_s > 0 and now - self._alone_since >= self.inline_window_s

    def _check_inputs(self, session, inputs: torch.Tensor) -> None:
        if session.start == 0:
            if inputs.dtype != torch.int64 or inputs.dim() != 1:
                raise BadRequestError(
                    f"a span starting at layer 0 takes token ids int64 [n], got {inputs.dtype} {list(inputs.shape)}"
                )
            if inputs.numel() and (int(inputs.min()) < 0 or int(inputs.max()) >= self.spec.vocab_size):
                raise BadRequestError(f"token ids must be in [0, {self.spec.vocab_size})")
        else:
            expected = str(inputs.dtype).removeprefix("torch.")
            if inputs.dim() != 2 or inputs.shape[1] != self.spec.hidden_size:
                raise BadRequestError(
                    f"hidden states must be [n, {self.spec.hidden_size}], got {list(inputs.shape)}"
                )
            if expected != self.spec.dtype:
                raise BadRequestError(f"hidden states must be {self.spec.dtype}, got {expected}")
        if inputs.shape[0] == 0:
            raise BadRequestError("a Forward must carry at least one token")
