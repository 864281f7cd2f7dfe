"""RPC edge of the peer: reads frames from a session stream, answers each with a reply.

This is one of the few places that catch broad exceptions: whatever a client sends, the peer
answers with a typed ``ErrorReply`` and keeps serving every other session.

Every resource a stream can make the peer hold is bounded before it is held
(``peer/admission.py``): streams per owner, the silence a stream may keep, the time the rest of a
frame may take once its first byte arrived, and a frame's payload, which is admitted only after
its header was decoded and checked against what the session may still legally send (and
against the peer's in-flight byte budget). A payload that is refused unread leaves the stream
out of sync, so that stream alone is closed after the error reply (a small one is read and
dropped instead, so that an honest client whose session expired keeps its stream).
Push mode's ``AllowPush``, ``PushForward``, ``PushBatch`` and ``AwaitResult`` are handed to
``peer/forwarding.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time


from p2pserve import __version__
from p2pserve.config import AdmissionConfig
from p2pserve.errors import (
    BadRequestError,
    OverloadedError,
    P2PServeError,
    PayloadTooLargeError,
    WIRE_ERRORS,
    ModelMismatchError,
)
from p2pserve.model.spec import ModelSpec
from p2pserve.peer.admission import PayloadBudget, StreamQuota, payload_allowance
from p2pserve.peer.forward_checks import check_forward, last_hop_ask
from p2pserve.peer.prefix_share import coarse_free
from p2pserve.peer.read_ahead import ReadAhead
from p2pserve.peer.reply_signer import ReplySigner
from p2pserve.peer.sampling import Choice
from p2pserve.peer.sessions import SessionTable
from p2pserve.peer.timing import RecentTimes
from p2pserve.peer.worker import ComputeWorker, Job
from p2pserve.peer.inbound import InboundStream, close_writer, error_for, refuse_stream
from p2pserve.protocol import (
    FRAME_PREFIX,
    CloseSession,
    DirectOffer,
    ErrorReply,
    Forward,
    ForwardResult,
    FrameLimits,
    GetStats,
    PeerStats,
    OpenDirect,
    AllowPush,
    AwaitResult,
    PushBatch,
    PushForward,
    OpenSession,
    SessionClosed,
    SessionOpened,
    check_prefix,
    decode_request,
    error_reply,
    tokens_bytes,
)
from p2pserve.transport.frames import tensor_from_wire, tensor_to_wire, write_frame
from p2pserve.types import SessionId

log = logging.getLogger(__name__)


#: A refused payload up to this size is read and dropped, keeping its stream in sync.
DISCARD_BYTES = 64 * 1024


class SessionHandler:
    """Serves the session protocol on any transport's streams (libp2p, the direct path)."""

    def __init__(
        self,
        spec: ModelSpec,
        table: SessionTable,
        worker: ComputeWorker,
        limits: FrameLimits,
        request_timeout_s: float,
        admission: AdmissionConfig = AdmissionConfig(),
        *,
        signer: ReplySigner | None = None,
        forwarder=None,
        direct=None,
        metrics=None,
    ):
        """``signer`` signs replies (default: a fresh key); ``forwarder`` takes push-mode steps, ``direct``
        offers the direct TCP path, ``metrics`` counts error replies (each None: done without)."""
        self.spec = spec
        self.table = table
        self.worker = worker
        self.limits = limits
        self.request_timeout_s = request_timeout_s
        self.admission = admission
        self.quota = StreamQuota(admission)
        self.payloads = PayloadBudget(admission.max_inflight_payload_bytes)
        self.streams_open = 0
        self.direct = direct
        self.metrics = metrics
        self.forwarder = forwarder
        self.inline_window_s = worker.throttle.config.inline_lone_decode_s
        self._last_session: str | None = None  # the session of the latest Forward
        self._alone_since = 0.0  # when that session became the only one sending
        self._service = RecentTimes()  # recent Forwards, frame read to reply written
        self.signer = signer if signer is not None else ReplySigner("unnamed", spec.model_id, dtype=spec.dtype)

    async def handle_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, remote: str = "") -> None:
        """A transport's stream handler (``StreamHandler``): serve frames until the client hangs
        up, goes silent too long, or breaks the framing."""
        try:
            self.quota.enter(remote)
        except OverloadedError as e:
            await refuse_stream(reader, writer, e, self.admission.frame_read_timeout_s, self._reply_error)
            return
        stream = InboundStream(remote, writer, ReadAhead(reader, self.limits))
        self.streams_open += 1
        try:
            while await self._serve_frame(reader, writer, stream):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            return
        finally:
            self.streams_open -= 1
            self.quota.leave(stream.charged)
            closed = self.table.close_owned_by(stream)
            if closed:
                log.debug("stream closed; freed %d session(s)", closed)
            close_writer(writer)

    def _read_deadline(self, nbytes: int) -> float:
        """Seconds the rest of a frame of ``nbytes`` may take once its first byte arrived."""
        return self.admission.frame_read_timeout_s + nbytes / self.admission.min_read_rate_bytes_s

    async def _serve_frame(self, reader, writer, stream: InboundStream) -> bool:
        """Read one frame, answer it; False when the stream must end (it is out of sync)."""
        idle = self.admission.stream_idle_timeout_s
        if stream.opened:  # its sessions expire first; then the stream may go too
            idle = max(idle, self.table.idle_timeout_s + 10)
        if stream.ahead.hung_up:  # seen while a request waited: what it sent after is moot
            return False
        prefix, header = stream.ahead.take()  # read while an earlier request waited (peer/read_ahead.py)
        if prefix is None:
            async with asyncio.timeout(idle):
                prefix = await reader.readexactly(FRAME_PREFIX.size)
        try:
            header_len, payload_len = check_prefix(prefix, self.limits)
        except PayloadTooLargeError as e:
            await self._reply_error(writer, e)
            return False  # the header was not read: the stream is out of sync
        t0 = time.perf_counter()
        async with asyncio.timeout(self._read_deadline(header_len + payload_len)):
            header = header if header is not None else await reader.readexactly(header_len)
            msg, refusal = self._admit(header, payload_len, stream)
            if refusal is not None:
                if payload_len > DISCARD_BYTES:
                    await self._reply_error(writer, refusal)
                    return False
                if payload_len:
                    await reader.readexactly(payload_len)
                await write_frame(writer, self._error(refusal, msg))
                return not stream.over_quota  # a forwarded stream its client has no room for ends here
            await self.payloads.acquire(payload_len)
        try:
            async with asyncio.timeout(self._read_deadline(payload_len)):
                payload = await reader.readexactly(payload_len) if payload_len else b""
            reply, out_payload = await self._dispatch(msg, payload, stream)
            if reply is not None:  # None: answered later (a ring batch's ack, peer/forwarding.py)
                async with asyncio.timeout(self._read_deadline(len(out_payload))):
                    await write_frame(writer, reply, out_payload)  # a client that never reads is dropped
        finally:
            await self.payloads.release(payload_len)
        if isinstance(reply, SessionOpened):
            stream.opened = True
        elif isinstance(reply, ForwardResult) and isinstance(msg, Forward):  # not an AwaitResult's wait
            self._service.add(time.perf_counter() - t0)
        return True

    def _admit(self, header: bytes, payload_len: int, stream: InboundStream):
        """Decode a header and bound its payload before any of it is read: ``(msg, None)`` when
        the frame may be read on, ``(msg or None, error)`` when it is refused."""
        msg = None
        try:
            msg = decode_request(header)
            allowed = 0
            if isinstance(msg, (Forward, PushForward)):
                fwd = msg if isinstance(msg, Forward) else msg.forward
                session = (self.forwarder.session_for(fwd.session_id, stream, stream.remote)
                           if fwd is not msg and self.forwarder is not None else self.table.get(fwd.session_id, stream))
                self.quota.charge(stream, session.owner)  # a pushed stream counts as its session owner's
                tokens_left = session.max_length - min(fwd.position, session.position)
                allowed = payload_allowance(tokens_left, session.start == 0, self.spec.hidden_size, self.spec.dtype)
            elif isinstance(msg, PushBatch):  # ring steps of one position each; items are checked one by one
                allowed = len(msg.items) * payload_allowance(1, False, self.spec.hidden_size, self.spec.dtype)
            if payload_len > allowed:
                raise PayloadTooLargeError(
                    f"a payload of {payload_len} bytes exceeds the {allowed} this request may carry"
                )
        except WIRE_ERRORS as e:
            log.info("refused a frame (%s): %s", e.code.value, e.message)
            return msg, e
        return msg, None

    def _error(self, exc: P2PServeError, msg) -> ErrorReply:
        """The ErrorReply answering ``msg`` with ``exc``, counted in the metrics."""
        if self.metrics is not None:
            self.metrics.error(exc)
        return error_for(exc, msg)

    async def _reply_error(self, writer, exc: P2PServeError) -> None:
        if self.metrics is not None:
            self.metrics.error(exc)
        try:
            async with asyncio.timeout(self.admission.frame_read_timeout_s):
                await write_frame(writer, error_reply(exc.code, exc.message))
        except (ConnectionError, RuntimeError, TimeoutError):
            pass

    async def _dispatch(self, msg, payload: bytes, stream: InboundStream) -> tuple[object, bytes]:
        try:
            if isinstance(msg, OpenSession):
                return self._open(msg, stream), b""
            if isinstance(msg, Forward):
                return await self._forward(msg, payload, stream)
            if isinstance(msg, GetStats):
                return self.stats(), b""
            if isinstance(msg, (AllowPush, PushForward, AwaitResult, PushBatch)) and self.forwarder is None:
                raise BadRequestError("this peer does not take push-mode steps")
            if isinstance(msg, AllowPush):
                return await self.forwarder.allow(msg, stream), b""
            if isinstance(msg, PushForward):
                return await self.forwarder.push(msg, payload, stream, stream.remote, self._forward)
            if isinstance(msg, PushBatch):
                return await self.forwarder.push_batch(msg, payload, stream, stream.remote, self._forward)
            if isinstance(msg, AwaitResult):  # None: the owner hung up while it waited
                return await self.forwarder.await_result(msg, stream) or (None, b"")
            if isinstance(msg, OpenDirect):
                return (self.direct.offer(stream.remote) if self.direct else DirectOffer(port=0)), b""
            if isinstance(msg, CloseSession):
                self.table.close(msg.session_id, stream)
                return SessionClosed(session_id=msg.session_id), b""
            raise BadRequestError(f"unexpected message {type(msg).__name__}")
        except WIRE_ERRORS as e:
            log.info("rejected request (%s): %s", e.code.value, e.message)
            return self._error(e, msg), b""
        except Exception as e:  # never crash on input: report and keep serving
            log.exception("internal error while handling a request")
            return self._error(P2PServeError(f"{type(e).__name__}: {e}"), msg), b""

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
            kv_free_token_layers=coarse_free(budget.free, budget.capacity, self.admission.prefix_sharing),
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

    def _open(self, msg: OpenSession, stream: InboundStream) -> SessionOpened:
        if msg.model_id != self.spec.model_id:
            raise ModelMismatchError(f"this peer serves model {self.spec.model_id!r}, not {msg.model_id!r}")
        session = self.table.open(msg, stream, stream.remote)
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
            receipt=self.signer.receipt(stream.remote) if stream.remote else b"",
        )

    async def _forward(self, msg: Forward, payload: bytes, stream: InboundStream,
                       loops: bool = False) -> tuple[ForwardResult, bytes]:
        """Run ``msg`` on the session ``stream`` owns; its signed reply. ``loops``: the session's
        next step follows this one at once (a ring this peer closes on itself)."""
        session = self.table.get(msg.session_id, stream)
        if session.busy:
            raise BadRequestError(f"session {msg.session_id!r} already has a request in flight")
        inputs = tensor_from_wire(msg.tensor, payload)
        check_forward(self.spec, session, msg, inputs)
        n, last = inputs.shape[0], session.end == self.spec.num_layers
        ask = last_hop_ask(self.spec, session, msg, n)
        if msg.position < session.position:
            # The client rewinds: it regenerates a turn, or drops draft tokens it did not accept.
            session.cache.truncate(msg.position)
        self.table.grow(session, msg.position + n)  # the KV blocks this step fills, or OverloadedError
        commitment = self.signer.consume(session.chain, msg.position, payload, n)
        loop = asyncio.get_running_loop()
        job = Job(
            session=session,
            inputs=inputs,
            position=msg.position,
            sample=last,
            future=loop.create_future(),
            loop=loop,
            logit_rows=n if msg.prompt_logprobs and n > 1 else msg.outputs,
            ask=ask,
            # The session is busy until the worker is done with this job (``SessionTable.settle``),
            # not merely until this handler stops waiting: a retry after a timeout must not put a
            # second job on the same cache, nor a Close release KV the worker still writes into.
            on_settled=self.table.settle,
            loops=loops,
        )
        session.job = job
        # A lone decode token, or a lone speculative step (only the tokens it verifies), runs inline.
        # A background session (a witness replay) neither runs inline nor ends another session's
        # streak of being alone: a check must not move a serving session off the inline path.
        alone = not session.background and self._alone(session.id)
        if not (n == msg.outputs and alone and self.worker.run_inline(job)):
            self.worker.submit(job)
        try:
            # asyncio.timeout wraps no extra task around the future (wait_for would): this is
            # on every hop of every token.
            async with asyncio.timeout(self.request_timeout_s):
                result = await job.future
        except TimeoutError:
            job.abandoned = True  # the worker drops it if it has not run yet
            raise OverloadedError(
                f"the request waited over {self.request_timeout_s:.0f} s in this peer; take another route"
            ) from None
        return self._reply(session, msg, n, commitment, result)

    def _reply(self, session, msg: Forward, n: int, commitment: bytes, result) -> tuple[ForwardResult, bytes]:
        """The signed ForwardResult of a step's ``result`` (a token, a list of tokens for a Forward
    with ``outputs`` > 1, or hidden states [n, hidden])."""
        position = msg.position + n
        extra = {}
        if isinstance(result, Choice):  # the token(s), with the log-probabilities asked for
            extra = dict(logprobs=result.logprobs, prompt_logprobs=result.prompt_logprobs)
            result = result.tokens if msg.outputs > 1 else result.tokens[-1]
        if isinstance(result, list):  # speculative verification: the token after each of the last positions
            sig = self.signer.sign(session, msg.position, n, commitment, tokens_bytes(result), kind="tokens",
                                   allowed=msg.allowed, returned=extra)
            return ForwardResult(session_id=session.id, step=msg.step, position=position, tokens=result,
                                 signature=sig, **extra), b""
        if isinstance(result, int):
            sig = self.signer.sign(session, msg.position, n, commitment, token=result, kind="token",
                                   allowed=msg.allowed, returned=extra)
            return ForwardResult(session_id=session.id, step=msg.step, position=position, token=result,
                                 signature=sig, **extra), b""
        meta, data = tensor_to_wire(result)
        sig = self.signer.sign(session, msg.position, n, commitment, data)
        return ForwardResult(session_id=session.id, step=msg.step, position=position, tensor=meta,
                             signature=sig), data

    def _alone(self, session_id: SessionId) -> bool:
        """Whether only ``session_id`` has sent Forwards for ``inline_window_s`` (nobody to batch with)."""
        now = time.monotonic()
        if session_id != self._last_session:
            self._last_session, self._alone_since = session_id, now
        return self.inline_window_s > 0 and now - self._alone_since >= self.inline_window_s
