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

Every request gets its own :class:`~p2pserve.client.pipeline.Pipeline` (IWRR over the plan's
flows, or over the known peers) that survives peer failures: it bans, re-routes and replays as
needed. Bans are shared by all requests of one client, so a dead peer is avoided once, not once
per request.

``chat``/``generate`` return a :class:`~p2pserve.client.reply.Reply`: the reply text (a ``str``)
that also carries the tokens, the finish reason, the route(s) taken and timings. The streaming
variants yield text pieces as they become final (incomplete UTF-8 and possible stop-string
prefixes held back).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
from typing import Any, Iterator, Optional, Sequence

from p2pserve.client.drafts import Drafter, make_drafter
from p2pserve.client.failover import FailoverState
from p2pserve.client.generation import Generation
from p2pserve.client.hop import parse_peer
from p2pserve.client.model_info import LocalModelInfo
from p2pserve.client.node import client_transport
from p2pserve.client.params import GenerationParams
from p2pserve.client.pipeline import Pipeline
from p2pserve.client.reply import Reply, ReplyStream
from p2pserve.client.route_providers import PeerListRoutes, RouteProvider
from p2pserve.client.choices import choices
from p2pserve.client.tools.requests import clean_messages, parse_tools, with_forced_call, with_tool_calls
from p2pserve.config import ClientConfig
from p2pserve.config.client import with_settings
from p2pserve.errors import BadRequestError, ConfigError
from p2pserve.metrics import ClientMetrics
from p2pserve.model.quant import check_quant
from p2pserve.transport import Transport

__all__ = ["AsyncClient", "Client", "Reply", "ReplyStream", "SyncReplyStream"]


class AsyncClient:
    """An asyncio client for one model in one swarm (or over a fixed set of peers).

    Its settings are one :class:`~p2pserve.config.ClientConfig`: ``initial_peers`` (DHT
    multiaddrs) to discover peers and the plan through the control plane, or ``peers`` for a
    fixed set; ``model``, the local checkpoint (tokenizer + shapes; None = the embedded default),
    loaded by :meth:`start` unless ``model_info`` is given; the swarm's membership; ``seed``
    (random by default: decorrelates this client's IWRR cycles from other clients');
    ``speculative`` decoding and ``quant`` (docs/speculative.md, docs/quantization.md).
    ``transport`` is used as given instead of a libp2p node of the client's own (tests pass an
    in-memory one).
    """

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        model: Optional[str] = None,
        *,
        config: ClientConfig = ClientConfig(),
        model_info: Optional[LocalModelInfo] = None,
        transport: Optional[Transport] = None,
        **settings: Any,
    ):
        """Every setting is a field of ``config``; ``initial_peers``, ``model`` and ``settings``
        (``peers=``, ``seed=``, ``speculative=``, any ``ClientConfig`` field) only build it."""
        config = with_settings(config, initial_peers, model, settings)
        if not config.initial_peers and not config.peers and config.dht_config is None:
            raise ConfigError("give initial_peers (a swarm) or peers (a fixed set of peers)")
        self.speculative, self.speculative_config = config.speculative, config.speculative_config
        self.quant = check_quant(config.quant)
        self.drafter: Optional[Drafter] = None  # made by start() when speculative is on
        self.initial_peers, self.model = config.initial_peers, config.model
        self.peers = [parse_peer(p) for p in config.peers] if config.peers else None
        self.config = config
        self.swarm_model, self.swarm_id, self.dht_config = config.swarm_model, config.swarm_id, config.dht_config
        self.trusted_coordinators = config.trusted_coordinators
        self.seed = config.seed if config.seed is not None else random.SystemRandom().getrandbits(63)
        self.max_length = config.max_length
        self.info = model_info
        self.failover = FailoverState(config)
        self.swarm_routes = None  # a SwarmRoutes in swarm mode, once started
        self.verifier = None  # a client.trust.verifier.Verifier once started, when config.verify_share > 0
        self._given_transport = transport
        self._transport: Optional[Transport] = None
        self._swarm = None
        self._peer_routes: Optional[PeerListRoutes] = None
        self.observer = None  # a ServiceObserver in swarm mode (client/trust/observer.py)
        self.metrics = ClientMetrics()  # this client's series (docs/metrics.md); `p2pserve api` serves them
        self._reporting: Optional[asyncio.Task] = None
        self._started = False

    # ----------------------------------------------------------------------------- lifecycle

    async def start(self) -> "AsyncClient":
        """Load the tokenizer and join the network (idempotent)."""
        if self._started:
            return self
        if self.info is None:
            self.info = await asyncio.to_thread(LocalModelInfo.load, self.model, quant=self.quant)
        spec = self.info.spec
        self.max_length = min(self.max_length, spec.max_position_embeddings or self.max_length)
        if self.peers is not None:
            self._peer_routes = PeerListRoutes(spec.num_layers, self.peers, seed=self.seed)
            self._transport = self._given_transport or await client_transport(self.config)
        else:
            await self._join_swarm()
        self._start_verifier()
        if self.speculative:
            self.drafter = await asyncio.to_thread(make_drafter, self.speculative, spec.vocab_size,
                                                   self.info.tokenizer, self.speculative_config)
        self._started = True
        return self

    async def _join_swarm(self) -> None:
        """Start a client DHT node, read routes through it and dial peers through its libp2p node."""
        from p2pserve.client.swarm_routes import SwarmRoutes
        from p2pserve.config import DHTConfig
        from p2pserve.dht.swarm import Swarm
        from p2pserve.model.identity import swarm_model_name

        spec = self.info.spec
        cfg = self.dht_config
        if cfg is None:
            membership = {"swarm_id": self.swarm_id} if self.swarm_id else {}
            name = swarm_model_name(self.model, swarm_model=self.swarm_model, spec=spec)
            cfg = DHTConfig(model=name, initial_peers=self.initial_peers,
                            client_mode=True, trusted_coordinators=self.trusted_coordinators, **membership)
        cfg = dataclasses.replace(cfg, num_layers=spec.num_layers)
        self._swarm = await asyncio.to_thread(Swarm.create, cfg)
        if self._given_transport is not None:
            self._transport = self._given_transport
        else:
            self._transport = await client_transport(self.config, await self._swarm.dht.replicate_p2p())
        self.swarm_routes = SwarmRoutes(self._swarm, seed=self.seed, num_layers=spec.num_layers, quant=spec.quant)
        if self.config.report_period_s > 0:  # observed service rates, for the coordinators' claim checks
            from p2pserve.client.trust.observer import ReportPublisher, ServiceObserver

            self.observer = ServiceObserver(self.config.report_window)
            publisher = ReportPublisher(self._swarm, self.observer, self.config.report_period_s)
            self._reporting = asyncio.create_task(publisher.run())

    def _start_verifier(self) -> None:
        """Verify a share of every hop's outputs on another replica (``ClientConfig.verify_share``)."""
        from p2pserve.client.trust.verify_sources import peer_list_verifier, swarm_verifier

        if self.config.verify_share <= 0:
            return
        spec, seed = self.info.spec, self.seed + 1
        if self.peers is not None:
            self.verifier = peer_list_verifier(self._transport, spec.model_id, spec.num_layers, self.config,
                                               self.peers, self.failover, seed, dtype=spec.dtype)
        else:
            self.verifier = swarm_verifier(self._transport, spec.model_id, spec.num_layers, self.config,
                                           self.swarm_routes, self._swarm, self.failover, seed, dtype=spec.dtype)

    async def close(self) -> None:
        """Leave the network (a transport given to the constructor stays open: it is the caller's)."""
        if self.verifier is not None:
            await self.verifier.close()
        if self._reporting is not None:
            self._reporting.cancel()
            self._reporting = None
        if self._transport is not None and self._transport is not self._given_transport:
            await self._transport.close()
        if self._swarm is not None:
            await asyncio.to_thread(self._swarm.shutdown)
        self._transport = self._swarm = None
        self._started = False

    async def __aenter__(self) -> "AsyncClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def model_id(self) -> str:
        """The checkpoint's id (directory name + config hash, then ``@SCHEME`` if quantized)."""
        return self.info.spec.model_id

    # ----------------------------------------------------------------------------- requests

    def chat_prompt(self, messages, tools: Optional[list] = None) -> list[int]:
        """Token ids of ``messages`` and ``tools`` through the chat template (BadRequestError on bad input)."""
        return self.info.chat_ids(clean_messages(messages), parse_tools(tools, None).tools if tools else None)

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

    def generation(self, prompt_ids: list[int], params: GenerationParams, fork_of=None) -> Generation:
        """A generation after ``prompt_ids`` on a new pipeline (validated: bad input raises here).

        ``fork_of``, another generation (or its ``ReplyStream``) after the same prompt: this one's
        route forks that one's sessions once it has run the prompt, so the prompt is computed
        once (``Pipeline.fork_from``; a request's choices, ``client/choices.py``).
        The caller closes ``generation.pipeline`` when done (a :class:`ReplyStream` does).
        """
        sampling = params.validate()
        if len(prompt_ids) >= self.max_length:
            raise BadRequestError(f"the prompt has {len(prompt_ids)} tokens; this client allows at most "
                                  f"{self.max_length - 1} (max context {self.max_length})")
        if not self._started:
            raise ConfigError("the client is not started: use 'async with AsyncClient(...)' or await start()")
        # the pipeline holds the prompt and every generated token but the last
        max_length = min(self.max_length, len(prompt_ids) + params.max_new_tokens)
        spec = self.info.spec
        # the last hop needs the history or a mask each step: the client drives (log-probabilities
        # alone come back with each step's reply on every path, rings included)
        extras = params.extras
        pipeline = Pipeline(self._transport, self._routes_for(max_length), spec.model_id, spec.num_layers,
                            max_length, sampling, self.config, self.failover, vocab_size=spec.vocab_size,
                            observer=self.observer, trust=self.verifier and self.verifier.session(), metrics=self.metrics,
                            extras=extras)
        parent = getattr(fork_of, "generation", fork_of)
        if parent is not None and parent._prompt == list(prompt_ids):
            pipeline.fork_from(parent.pipeline, len(prompt_ids) - 1)  # the last row is sampled per choice
        self.metrics.requests.inc()
        return Generation(pipeline, prompt_ids, params, self.info.eos_ids, self.info.tokenizer,
                          recompute_past=spec.recompute_past, metrics=self.metrics,
                          drafter=self.drafter.session() if self.drafter is not None and not (extras or sampling.logprobs)
                          else None,
                          speculative=self.speculative_config)

    def _routes_for(self, max_length: int) -> RouteProvider:
        if self._peer_routes is not None:
            return self._peer_routes
        return self.swarm_routes.for_request(max_length)

    async def chat(self, messages, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                   top_k: int = 0, seed: Optional[int] = None, stop=None, ignore_eos: bool = False, *,
                   params: Optional[GenerationParams] = None, tools=None, tool_choice=None, n: int = 1,
                   **sampling):
        """Answer a conversation (list of {'role', 'content'}); returns the reply text as a Reply
        (a list of ``n`` Replies, seeds ``seed + i``, when ``n`` > 1: ``client/choices.py``).

        ``params`` replaces the keyword parameters when given; ``sampling`` keywords are
        :class:`GenerationParams` fields (``min_p``, the penalties, ``logit_bias``, ``logprobs``,
        ``response_format``...). ``tools`` / ``tool_choice`` as in the OpenAI API: ``Reply.tool_calls``.
        """
        params = params or GenerationParams.of(max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, **sampling)
        tool_request = parse_tools(tools, tool_choice)
        ids = self.chat_prompt(messages, tools and tool_request.template_tools)
        params = with_forced_call(params, tool_request)
        if n > 1:
            return [with_tool_calls(r, tool_request, self.info) for r in await choices(self, ids, params, n, _drained)]
        return with_tool_calls(await _drained(self.generation(ids, params)), tool_request, self.info)

    def chat_stream(self, messages, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                    top_k: int = 0, seed: Optional[int] = None, stop=None, ignore_eos: bool = False, *,
                    params: Optional[GenerationParams] = None, **sampling) -> ReplyStream:
        """Like ``chat``, yielding text pieces; the stream's ``reply`` is set when it ends.

        Bad input raises here, before anything is yielded.
        """
        params = params or GenerationParams.of(max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, **sampling)
        return ReplyStream(self.generation(self.chat_prompt(messages), params))

    async def generate(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, seed: Optional[int] = None, stop=None, ignore_eos: bool = False, *,
                       params: Optional[GenerationParams] = None, **sampling) -> Reply:
        """Continue a raw prompt (a string, tokenized without chat template, or token ids)."""
        params = params or GenerationParams.of(max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, **sampling)
        return await _drained(self.generation(self.text_prompt(prompt), params))

    def generate_stream(self, prompt, max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                        top_k: int = 0, seed: Optional[int] = None, stop=None, ignore_eos: bool = False, *,
                        params: Optional[GenerationParams] = None, fork_of=None, **sampling) -> ReplyStream:
        """Like ``generate``, yielding text pieces; ``fork_of`` as in :meth:`generation`."""
        params = params or GenerationParams.of(max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, **sampling)
        return ReplyStream(self.generation(self.text_prompt(prompt), params, fork_of))


async def _drained(gen: Generation) -> Reply:
    """Run ``gen`` to its end and close its pipeline (even when it fails): the whole reply."""
    try:
        async for _ in gen:
            pass
    finally:
        await gen.pipeline.close()
    return Reply.of(gen)


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
