"""A client for an explicit chain of peers: tokenizer, libp2p node, sessions, chat turns.

This is the inference path without the control plane: the caller names the hops. The swarm
client (``p2pserve.client.swarm``) builds chains from the published plan instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator

from p2pserve.client.connection import Hop
from p2pserve.client.generation import GenerationEvent, GenerationParams, GenerationResult, eos_ids_of, stream_generate
from p2pserve.client.session import InferenceSession
from p2pserve.config import ClientConfig
from p2pserve.model.default import resolve_model
from p2pserve.model.spec import load_spec
from p2pserve.protocol import SamplingParams


def parse_hop(text: str) -> Hop:
    """Parse 'MADDR@START:END' (MADDR ends with /p2p/<peer id>) into a Hop."""
    maddr, _, span = text.rpartition("@")
    start, end = (int(x) for x in span.split(":"))
    peer_id = maddr.rsplit("/p2p/", 1)[1]
    return Hop(peer_id=peer_id, start=start, end=end, maddrs=(maddr,))


@dataclass
class LocalModelInfo:
    """What a client needs locally: tokenizer, spec, generation config."""

    path: str
    spec: object
    tokenizer: object
    eos_ids: set[int] = field(default_factory=set)

    @classmethod
    def load(cls, model: str | None, dtype: str = "float32") -> "LocalModelInfo":
        from transformers import AutoTokenizer, GenerationConfig

        path = str(resolve_model(model))
        tok = AutoTokenizer.from_pretrained(path)
        try:
            gen_cfg = GenerationConfig.from_pretrained(path)
        except OSError:
            gen_cfg = None
        return cls(path, load_spec(path, dtype=dtype), tok, eos_ids_of(tok, gen_cfg))

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation with the generation prompt appended."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)


class ChainChat:
    """A multi-turn chat over one session on a fixed chain; each turn reuses the peers' cache."""

    def __init__(self, session: InferenceSession, model: LocalModelInfo):
        self.session = session
        self.model = model
        self.messages: list[dict] = []

    async def stream(self, user_text: str, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        """Send a user turn; yield the reply as it is generated."""
        self.messages.append({"role": "user", "content": user_text})
        ids = self.model.chat_ids(self.messages)
        result = GenerationResult()
        async for event in stream_generate(self.session, ids, params, self.model.eos_ids, self.model.tokenizer, result):
            yield event
        self.messages.append({"role": "assistant", "content": result.text})
        self.last_result = result


async def open_chain_session(
    p2p, hops: list[Hop], model: LocalModelInfo, max_length: int, params: GenerationParams,
    config: ClientConfig = ClientConfig(),
) -> InferenceSession:
    """Open an InferenceSession on ``hops`` with sampling taken from ``params``."""
    sampling = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed)
    session = InferenceSession(p2p, hops, model.spec.model_id, model.spec.num_layers, max_length, sampling, config)
    await session.open()
    return session


async def create_client_p2p(initial_peers: list[str] = ()):
    """Start a libp2p node for a client (no DHT process needed for an explicit chain)."""
    from hivemind.p2p import P2P

    return await P2P.create(initial_peers=list(initial_peers), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
