"""What a client needs of the model locally: tokenizer, shapes (the spec), end-of-reply ids.

No weights: a client tokenizes, applies the chat template and checks shapes; the peers compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pserve.client.generation import eos_ids_of
from p2pserve.model.locate import model_folder
from p2pserve.model.spec import load_spec


@dataclass
class LocalModelInfo:
    """The local checkpoint's tokenizer, spec and generation EOS ids (``tokenizer`` may be None:
    a caller driving the swarm with token ids only)."""

    path: str
    spec: object
    tokenizer: object
    eos_ids: set[int] = field(default_factory=set)

    @classmethod
    def load(cls, model: str | None, dtype: str = "float32", quant: str | None = None) -> "LocalModelInfo":
        """Load from a checkpoint directory, a hub id (``ORG/NAME[@REVISION]``: its configs and
        tokenizer are fetched, never its weights) or None (the embedded default); ``quant`` names
        the weight-only quantization of the peers to use (it joins the spec's model id)."""
        from transformers import AutoTokenizer, GenerationConfig

        path = str(model_folder(model))
        tok = AutoTokenizer.from_pretrained(path)
        try:
            gen_cfg = GenerationConfig.from_pretrained(path)
        except OSError:
            gen_cfg = None
        return cls(path, load_spec(path, dtype=dtype, quant=quant), tok, eos_ids_of(tok, gen_cfg))

    def chat_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """Token ids of a conversation with the generation prompt appended (``tools``: OpenAI
        function tools, rendered by the checkpoint's chat template)."""
        out = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)
