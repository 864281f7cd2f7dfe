"""Fake peers for the client's tests: the real client code runs over an in-memory transport against them."""

from __future__ import annotations

# The client's tests run the real client code (pipeline, connections, frame codec) over an
# in-memory transport against fake peers, instead of faking the client's own objects.
from p2pserve.transport.memory import MemoryNetwork, MemoryTransport  # noqa: F401  (shipped from here)
from p2pserve.types import PeerId

FAKE_MODEL_ID = "fake-model"


def fake_next_token(history: list[int]) -> int:
    """The fake peers' 'model': the next token depends on the whole history, like a real one's."""
    return (sum((i + 1) * t for i, t in enumerate(history)) * 31 + len(history)) % 1000


class FakePeerNetwork:
    """Fake peers serving the session protocol on a :class:`MemoryNetwork`.

    Each peer serves a layer span of a model of ``num_layers`` layers. Hidden states carry the
    token ids in column 0, so the peer holding the last layer knows its session's whole token
    history and answers :func:`fake_next_token` of it: a replay that lost or garbled a token
    would change the output, as with a real model.

    Switches: :meth:`kill` (streams cut, dials refused); ``kill_after[peer] = n`` (the peer dies
    right after the n-th token sampled network-wide); ``refuse[peer] = code`` (answer every
    OpenSession with that error code) and ``refuse_once`` (only the next one); ``stall`` (peers
    that never answer an OpenSession; ``stall_released`` lists each such stream its client
    closed); ``corrupt[peer] = how`` (its Forward replies lie: ``"token"`` a token and no hidden
    states from a hop before the last, ``"vocab"`` a token outside the vocabulary, ``"nan"``
    hidden states holding NaN, ``"position"`` a wrong position, ``"wrong"`` a well-formed wrong token from the last layers). Records: ``sampled`` holds, for every token sampled, how many tokens its Forward
    carried.
    """

    def __init__(self, num_layers: int = 8, hidden_size: int = 4):
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.network = MemoryNetwork()
        self.spans: dict[str, tuple[int, int]] = {}
        self.sessions: dict[tuple[str, str], dict] = {}
        self.kill_after: dict[str, int] = {}
        self.refuse: dict[str, str] = {}
        self.refuse_once: dict[str, str] = {}
        self.sampled: list[int] = []
        self.stall: set[str] = set()
        self.stall_released: list[str] = []
        self.corrupt: dict[str, str] = {}

    def add(self, peer_id: PeerId, start: int, end: int):
        """Start a peer serving layers [start, end); returns the Hop of its whole span."""
        from p2pserve.client.hop import Hop
        from p2pserve.protocol import SESSION_PROTOCOL

        self.spans[peer_id] = (start, end)

        async def handler(reader, writer, remote) -> None:
            await self._serve(peer_id, reader, writer)

        self.network.serve(peer_id, SESSION_PROTOCOL, handler)
        return Hop(peer_id, start, end, (f"/memory/p2p/{peer_id}",))

    def client(self, name: str = "client") -> MemoryTransport:
        """A client node on the network."""
        return self.network.transport(name)

    def kill(self, peer_id: PeerId) -> None:
        """The peer dies: its streams end and new dials are refused."""
        self.network.disconnect(peer_id)

    async def _serve(self, peer_id: PeerId, reader, writer) -> None:
        import asyncio

        from p2pserve.protocol import FrameLimits, decode_request
        from p2pserve.transport.frames import read_frame, write_frame

        while True:
            try:
                header, payload = await read_frame(reader, FrameLimits())
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            msg = decode_request(header)
            if peer_id in self.stall and type(msg).__name__ == "OpenSession":
                await reader.read()  # no answer; wait until the client gives up on the stream
                self.stall_released.append(peer_id)
                return
            reply, out = self._answer(peer_id, msg, payload)
            try:
                await write_frame(writer, reply, out)
            except ConnectionError:
                return
            for victim, n in list(self.kill_after.items()):
                if len(self.sampled) >= n:
                    del self.kill_after[victim]
                    self.kill(victim)

    def _answer(self, peer_id: PeerId, msg, payload: bytes):
        from p2pserve.protocol import (
            CloseSession,
            DirectOffer,
            ErrorReply,
            Forward,
            OpenDirect,
            OpenSession,
            SessionClosed,
            SessionOpened,
        )

        if isinstance(msg, OpenSession):
            code = self.refuse_once.pop(peer_id, None) or self.refuse.get(peer_id)
            if code is not None:
                return ErrorReply(code=code, message=f"{peer_id} refuses ({code})", session_id=msg.session_id), b""
            self.sessions[(peer_id, msg.session_id)] = {"start": msg.start, "end": msg.end, "tokens": []}
            lo, hi = self.spans[peer_id]
            return SessionOpened(session_id=msg.session_id, start=msg.start, end=msg.end, served_start=lo, served_end=hi,
                                 hidden_size=self.hidden_size, dtype="float32", peer_version="fake"), b""
        if isinstance(msg, Forward):
            return self._forward(peer_id, msg, payload)
        if isinstance(msg, CloseSession):
            self.sessions.pop((peer_id, msg.session_id), None)
            return SessionClosed(session_id=msg.session_id), b""
        if isinstance(msg, OpenDirect):
            return DirectOffer(port=0), b""
        return ErrorReply(code="bad_request", message=f"fake peers do not answer {type(msg).__name__}"), b""

    def _forward(self, peer_id: PeerId, msg, payload: bytes):
        import torch

        from p2pserve.protocol import ErrorReply, ForwardResult
        from p2pserve.transport.frames import tensor_from_wire, tensor_to_wire

        session = self.sessions.get((peer_id, msg.session_id))
        if session is None:
            return ErrorReply(code="unknown_session", message=f"unknown session {msg.session_id!r}"), b""
        inputs = tensor_from_wire(msg.tensor, payload)
        ids = inputs.tolist() if session["start"] == 0 else inputs[:, 0].long().tolist()
        del session["tokens"][msg.position:]
        session["tokens"].extend(ids)
        position = msg.position + len(ids)
        how = self.corrupt.get(peer_id)
        if how == "token" or (how == "vocab" and session["end"] == self.num_layers):
            token = 10**6 if how == "vocab" else 1
            return ForwardResult(session_id=msg.session_id, step=msg.step, position=position, token=token), b""
        if how == "position":
            position += 1
        if session["end"] == self.num_layers:
            self.sampled.append(len(ids))
            history = session["tokens"]
            if msg.outputs > 1:  # speculative verification: the token after each of the last positions
                tokens = [fake_next_token(history[:len(history) - msg.outputs + 1 + i]) for i in range(msg.outputs)]
                return ForwardResult(session_id=msg.session_id, step=msg.step, position=position, tokens=tokens), b""
            token = fake_next_token(history)
            if how == "wrong":  # well formed and wrong: only re-execution elsewhere tells
                token = (token + 1) % 1000
            return ForwardResult(session_id=msg.session_id, step=msg.step, position=position, token=token), b""
        hidden = torch.zeros(len(ids), self.hidden_size)
        hidden[:, 0] = torch.tensor(ids, dtype=torch.float32)
        if how == "nan":
            hidden[:, 1] = float("nan")
        meta, data = tensor_to_wire(hidden)
        return ForwardResult(session_id=msg.session_id, step=msg.step, position=position, tensor=meta), data

    def model_info(self, vocab_size: int = 1000, max_length: int = 4096):
        """A ``LocalModelInfo`` of the fake model (no tokenizer: token ids in, token ids out)."""
        from p2pserve.client.model_info import LocalModelInfo
        from p2pserve.model.spec import ModelSpec

        spec = ModelSpec(model_id=FAKE_MODEL_ID, family="llama", hidden_size=self.hidden_size,
                         num_layers=self.num_layers, num_heads=1, num_kv_heads=1, head_dim=self.hidden_size,
                         intermediate_size=self.hidden_size, vocab_size=vocab_size, dtype="float32",
                         tie_word_embeddings=False, max_position_embeddings=max_length)
        return LocalModelInfo("fake", spec, None, set())


class ByteTokenizer:
    """A tokenizer whose every token is one byte of UTF-8 (for the text-streaming logic)."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The bytes as UTF-8, undecodable ones as U+FFFD (as byte-level BPE tokenizers do)."""
        return bytes(ids).decode("utf-8", errors="replace")


class FixedRoutes:
    """A route provider that always offers ``hops``, whatever is masked; counts ``invalidate()``s.

    For failover tests that need a provider blind to bans (only the retry bound stops them).
    """

    def __init__(self, hops):
        self.hops = list(hops)
        self.invalidated = 0

    async def route(self, masks):
        """The same hops every time."""
        return list(self.hops)

    def invalidate(self) -> None:
        """Count the call."""
        self.invalidated += 1


class OracleDrafter:
    """A draft for the fake peers' model (``client/drafts.py``'s ``Drafter``): it proposes what
    :func:`fake_next_token` will answer, except that every ``wrong_every``-th token it proposes is
    off by one, so that verification both accepts and rejects."""

    blocking = False

    def __init__(self, wrong_every: int = 4):
        self.wrong_every = wrong_every
        self.proposed = 0

    def session(self) -> "OracleDrafter":
        return self

    def propose(self, context, k: int) -> list[int]:
        history, out = list(context), []
        for _ in range(k):
            token = fake_next_token(history)
            self.proposed += 1
            if self.wrong_every and self.proposed % self.wrong_every == 0:
                token = (token + 1) % 1000
            out.append(token)
            history.append(token)
        return out
