"""The Python API: ``p2pserve.AsyncClient`` (asyncio) and ``p2pserve.Client`` (blocking).

::

    import p2pserve

    with p2pserve.Client(initial_peers=["/ip4/1.2.3.4/tcp/31337/p2p/Qm..."]) as client:
        reply = client.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=64)
        print(reply, reply.finish_reason, reply.route)
        for piece in client.chat_stream([{"role": "user", "content": "Tell me a story"}]):
            print(piece, end="", flush=True)

    # a fixed set of peers, no control plane: (multiaddr with /p2p/<id>, start, end) each
    client = p2pserve.Client(peers=[("/ip4/127.0.0.1/tcp/4001/p2p/Qm...", 0, 30)])

Every request gets its own pipeline (IWRR over the plan's flows, or over the known peers) and
survives peer failures (``FailoverSession``): bans, re-routes and replays as needed. Bans are
shared by all requests of one client, so a dead peer is avoided once, not once per request.

``chat``/``generate`` return a :class:`Reply`: the reply text (a ``str``) that also carries the
tokens, the finish reason, the route(s) taken and timings. The streaming variants yield text
pieces as they become final (incomplete UTF-8 and possible stop-string prefixes held back).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Optional, Sequence, Union

from p2pserve.client.connection import Hop
from p2pserve.client.failover import FailoverSession, FailoverState, PeerListRoutes, chain_session_factory
from p2pserve.client.generation import GenerationParams, GenerationResult, stream_generate
from p2pserve.config import ClientConfig
from p2pserve.errors import BadRequestError, ConfigError
from p2pserve.protocol import SamplingParams

PeerEntry = Union[str, tuple[str, int, int]]


class Reply(str):
    """The reply text, with what produced it.

    Attributes: ``tokens`` (generated ids), ``finish_reason`` ("stop" or "length"),
    ``prompt_tokens``, ``route`` (the hops of the last route used), ``routes`` (every route, more
    than one after a failover), ``failures`` (failed hops, as text), ``elapsed_s`` and
    ``first_token_s`` (seconds from the request to the first token).
    """

    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    route: list[Hop]
    routes: list[list[Hop]]
    failures: list[str]
    elapsed_s: float
    first_token_s: Optional[float]

    @property
    def text(self) -> str:
        """The reply as a plain ``str``."""
        return str.__str__(self)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole request."""
        return len(self.tokens) / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def route_text(self) -> str:
        """The route as 'peer[a:b) -> peer[b:c)' (last route; earlier ones after ' | ')."""
        return " | ".join(" -> ".join(str(h) for h in r) for r in self.routes) or "(none)"


def parse_peer(entry: PeerEntry) -> tuple[str, int, int, tuple[str, ...]]:
    """``(peer_id, start, end, maddrs)`` from ``(maddr, start, end)`` or ``'MADDR@START:END'``."""
    if isinstance(entry, str):
        maddr, sep, span = entry.rpartition("@")
        if not sep or ":" not in span:
            raise ConfigError(f"peer {entry!r}: expected MULTIADDR@START:END")
        start, end = span.split(":", 1)
    else:
        maddr, start, end = entry
    if "/p2p/" not in maddr:
        raise ConfigError(f"peer address {maddr!r} must end with /p2p/<peer id>")
    try:
        start, end = int(start), int(end)
    except ValueError:
        raise ConfigError(f"peer {entry!r}: layer range must be integers") from None
    if not 0 <= start < end:
        raise ConfigError(f"peer {entry!r}: invalid layer range [{start}, {end})")
    return maddr.rsplit("/p2p/", 1)[1], start, end, (maddr,)


@dataclass
class _Request:
    """One request's inputs, validated."""

    prompt_ids: list[int]
    params: GenerationParams
    max_length: int


class AsyncClient:
    """An asyncio client for one model in one swarm (or over a fixed set of peers).

    Give ``initial_peers`` (DHT multiaddrs) to discover peers and the plan through the control
    plane, or ``peers`` for a fixed set. ``model`` is the local checkpoint (tokenizer + shapes;
    ``None`` = the embedded default). ``swarm_model`` is the model name used for DHT keys
    (defaults to the checkpoint's ``model_id``). ``seed`` decorrelates this client's IWRR cycles
    from other clients' (random by default; pass one for reproducible routes).
    """

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        model: Optional[str] = None,
        *,
        peers: Optional[Sequence[PeerEntry]] = None,
        config: ClientConfig = ClientConfig(),
        swarm_model: Optional[str] = None,
        dht_config=None,
        seed: Optional[int] = None,
        max_length: int = 4096,
        model_info=None,
    ):
        if not initial_peers and not peers and dht_config is None:
            raise ConfigError("give initial_peers (a swarm) or peers (a fixed set of peers)")
        self.initial_peers = tuple(initial_peers)
        self.model = model
        self.peers = [parse_peer(p) for p in peers] if peers else None
        self.config = config
        self.swarm_model = swarm_model
        self.dht_config = dht_config
        self.seed = seed if seed is not None else random.SystemRandom().getrandbits(63)
        self.max_length = max_length
        self.info = model_info
        self.failover = FailoverState(config)
        self._p2p = None
        self._swarm = None
        self._peer_routes: Optional[PeerListRoutes] = None
        self.swarm_routes = None
        self._started = False

    # ----------------------------------------------------------------------------- lifecycle

    async def start(self) -> "AsyncClient":
        """Load the tokenizer and join the network (idempotent)."""
        if self._started:
            return self
        if self.info is None:
            from p2pserve.client.chain import LocalModelInfo

            self.info = await asyncio.to_thread(LocalModelInfo.load, self.model)
        spec = self.info.spec
        self.max_length = min(self.max_length, spec.max_position_embeddings or self.max_length)
        if self.peers is not None:
            from p2pserve.client.chain import create_client_p2p

            self._p2p = await create_client_p2p()
            self._peer_routes = PeerListRoutes(spec.num_layers, self.peers, seed=self.seed)
        else:
            from p2pserve.client.swarm_routes import SwarmRoutes
            from p2pserve.dht.config import DHTConfig
            from p2pserve.dht.swarm import Swarm

            cfg = self.dht_config or DHTConfig(
                model=self.swarm_model or spec.model_id, initial_peers=self.initial_peers, client_mode=True
            )
            self._swarm = await asyncio.to_thread(Swarm.create, cfg)
            self._p2p = await self._swarm.dht.replicate_p2p()
            self.swarm_routes = SwarmRoutes(self._swarm, seed=self.seed, num_layers=spec.num_layers)
        self._started = True
        return self

    async def close(self) -> None:
        """Leave the network."""
        if self._p2p is not None and self._swarm is None:
            await self._p2p.shutdown()
        if self._swarm is not None:
            await asyncio.to_thread(self._swarm.shutdown)
        self._p2p = self._swarm = None
        self._started = False

    async def __aenter__(self) -> "AsyncClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def model_id(self) -> str:
        """The checkpoint's id (directory name + config hash)."""
        return self.info.spec.model_id

    # ----------------------------------------------------------------------------- requests

    def chat_prompt(self, messages) -> list[int]:
        """Token ids of ``messages`` with the chat template (raises BadRequestError on bad input)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise BadRequestError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise BadRequestError(f"messages[{i}] must be an object with string 'role' and 'content'")
            if m["role"] not in ("system", "user", "assistant"):
                raise BadRequestError(f"messages[{i}].role must be system, user or assistant, got {m['role']!r}")
            clean.append({"role": m["role"], "content": m["content"]})
        return self.info.chat_ids(clean)

    def text_prompt(self, prompt) -> list[int]:
        """Token ids of a raw prompt (str, or a list of token ids, used as is)."""
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequestError("the prompt is empty")
            return list(self.info.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.info.spec.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise BadRequestError(f"token ids out of range [0, {vocab}): {bad[:5]}")
            return list(prompt)
        raise BadRequestError("prompt must be a non-empty string or a non-empty list of token ids")

    def _request(self, prompt_ids, max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos) -> _Request:
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not all(isinstance(s, str) and s for s in stop):
            raise BadRequestError("stop must be a string or a list of non-empty strings")
        if seed is None:
            # unseeded sampling still needs a fixed seed per request, so that replay is exact
            seed = random.SystemRandom().getrandbits(62) if temperature > 0 else 0
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool):
            raise BadRequestError("max_new_tokens must be an integer")
        params = GenerationParams(max_new_tokens=max_new_tokens, temperature=float(temperature), top_p=float(top_p),
                                  top_k=int(top_k), seed=int(seed), stop=tuple(stop), ignore_eos=ignore_eos)
        params.validate()
        if len(prompt_ids) >= self.max_length:
            raise BadRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this client allows at most {self.max_length - 1} "
                f"(max context {self.max_length})"
            )
        # the session holds the prompt and every generated token but the last
        max_length = min(self.max_length, len(prompt_ids) + max_new_tokens)
        return _Request(prompt_ids, params, max_length)

    def _session(self, req: _Request) -> FailoverSession:
        if not self._started:
            raise ConfigError("the client is not started: use 'async with AsyncClient(...)' or await start()")
        spec = self.info.spec
        p = req.params
        sampling = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)
        factory = chain_session_factory(self._p2p, spec.model_id, spec.num_layers, req.max_length, sampling, self.config)
        routes = self._peer_routes if self._peer_routes is not None else self.swarm_routes.for_request(req.max_length)
        return FailoverSession(routes, factory, req.max_length, self.config, self.failover)

    async def _stream(self, req: _Request, sink: list, session: Optional[FailoverSession] = None,
                      t0: Optional[float] = None) -> AsyncIterator[str]:
        """Run one request, yielding text pieces; appends the finished Reply to ``sink``."""
        t0 = time.perf_counter() if t0 is None else t0
        first = None
        result = GenerationResult()
        session = session if session is not None else self._session(req)
        try:
            async for event in stream_generate(session, req.prompt_ids, req.params, self.info.eos_ids,
                                               self.info.tokenizer, result):
                if first is None:
                    first = time.perf_counter() - t0
                if event.text:
                    yield event.text
        finally:
            await session.close()
        if first is None and result.tokens:
            first = time.perf_counter() - t0  # the only token was EOS
        sink.append(self._reply(result, session, time.perf_counter() - t0, first))

    @staticmethod
    def _reply(result: GenerationResult, session: FailoverSession, elapsed: float, first) -> Reply:
        reply = Reply(result.text)
        reply.tokens = list(result.tokens)
        reply.finish_reason = result.finish_reason
        reply.prompt_tokens = result.prompt_tokens
        reply.route = list(session.route)
        reply.routes = [list(r) for r in session.route_log]
        reply.failures = [str(f) for f in session.failures]
        reply.elapsed_s = elapsed
        reply.first_token_s = first
        return reply

    async def _complete(self, req: _Request) -> Reply:
        sink: list[Reply] = []
        async for _ in self._stream(req, sink):
            pass
        return sink[0]

    async def chat(self, messages, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, seed: Optional[int] = None, stop=None, ignore_eos: bool = False) -> Reply:
        """Answer a conversation (list of {'role', 'content'}); returns the reply text as a Reply."""
        return await self._complete(self._request(self.chat_prompt(messages), max_new_tokens, temperature, top_p,
                                                  top_k, seed, stop, ignore_eos))

    def chat_stream(self, messages, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, seed: Optional[int] = None, stop=None, ignore_eos: bool = False) -> "ReplyStream":
        """Like ``chat``, yielding text pieces; the stream's ``reply`` is set when it ends.

        Bad input raises here, before anything is yielded.
        """
        req = self._request(self.chat_prompt(messages), max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos)
        return ReplyStream(self, req)

    async def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, seed: Optional[int] = None, stop=None, ignore_eos: bool = False) -> Reply:
        """Continue a raw prompt (a string, tokenized without chat template, or token ids)."""
        return await self._complete(self._request(self.text_prompt(prompt), max_new_tokens, temperature, top_p,
                                                  top_k, seed, stop, ignore_eos))

    def generate_stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                        top_k: int = 0, seed: Optional[int] = None, stop=None, ignore_eos: bool = False) -> "ReplyStream":
        """Like ``generate``, yielding text pieces."""
        req = self._request(self.text_prompt(prompt), max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos)
        return ReplyStream(self, req)


class ReplyStream:
    """An async iterator of text pieces; ``reply`` holds the finished :class:`Reply` afterwards."""

    def __init__(self, client: AsyncClient, req: _Request):
        self._sink: list[Reply] = []
        self.session = client._session(req)
        self._gen = client._stream(req, self._sink, self.session, time.perf_counter())
        self.request = req

    async def open(self) -> None:
        """Open the route now, so that "no route" / "overloaded" surface before any text.

        (The HTTP server calls this before it commits to a 200 streaming response.)
        """
        try:
            await self.session.open()
        except BaseException:
            await self._gen.aclose()
            await self.session.close()
            raise

    def __aiter__(self) -> "ReplyStream":
        return self

    async def __anext__(self) -> str:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        """Stop early (closes the sessions on the peers)."""
        await self._gen.aclose()

    @property
    def reply(self) -> Optional[Reply]:
        """The finished reply (None until the stream is exhausted)."""
        return self._sink[0] if self._sink else None


class Client:
    """The blocking client: an ``AsyncClient`` on an event loop in a background thread.

    Same arguments and methods as :class:`AsyncClient`; ``chat_stream``/``generate_stream``
    return a plain iterator of text pieces (with ``.reply`` once exhausted).
    """

    def __init__(self, initial_peers: Sequence[str] = (), model: Optional[str] = None, **kwargs):
        self._async = AsyncClient(initial_peers, model, **kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="p2pserve-client", daemon=True)
        self._thread.start()
        try:
            self._call(self._async.start())
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def close(self) -> None:
        """Leave the network and stop the background loop."""
        if self._loop.is_running():
            try:
                self._call(self._async.close())
            finally:
                self._stop_loop()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def model_id(self) -> str:
        """The checkpoint's id."""
        return self._async.model_id

    @property
    def aclient(self) -> AsyncClient:
        """The underlying AsyncClient (runs on this client's loop)."""
        return self._async

    def chat(self, messages, **kwargs) -> Reply:
        """See :meth:`AsyncClient.chat`."""
        return self._call(self._async.chat(messages, **kwargs))

    def generate(self, prompt, **kwargs) -> Reply:
        """See :meth:`AsyncClient.generate`."""
        return self._call(self._async.generate(prompt, **kwargs))

    def chat_stream(self, messages, **kwargs) -> "SyncReplyStream":
        """See :meth:`AsyncClient.chat_stream`."""
        return SyncReplyStream(self, self._async.chat_stream(messages, **kwargs))

    def generate_stream(self, prompt, **kwargs) -> "SyncReplyStream":
        """See :meth:`AsyncClient.generate_stream`."""
        return SyncReplyStream(self, self._async.generate_stream(prompt, **kwargs))


class SyncReplyStream:
    """A blocking iterator over a :class:`ReplyStream` running on the client's loop."""

    def __init__(self, client: Client, stream: ReplyStream):
        self._client = client
        self._stream = stream

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            return self._client._call(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        """Stop early."""
        self._client._call(self._stream.aclose())

    @property
    def reply(self) -> Optional[Reply]:
        """The finished reply (None until exhausted)."""
        return self._stream.reply
