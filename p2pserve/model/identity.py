"""The swarm's model name: one rule that every role applies to the same ``--model``.

Every member of a swarm finds the others under DHT keys that contain the model's name
(``dht/keys.py``), so peers, coordinators, clients, ``chat``, ``api``, ``status`` and ``demo`` must
all derive the same name. Precedence, highest first (the only place it is written down):

1. ``--swarm-model NAME`` (``AsyncClient(swarm_model=...)``): the name as given;
2. the swarm file's ``model``;
3. from ``--model`` itself:

   * a checkpoint folder (a directory holding ``config.json``) gives its checkpoint id,
     ``ModelSpec.model_id``: the family plus a digest of ``config.json`` and the weight files
     (``model/checkpoint_id.py``), so two members pointing at copies of the same checkpoint
     meet, and different checkpoints never mix;
   * a hub id (``ORG/NAME``, optionally ``@REVISION``; ``model/hub.py``) gives the checkpoint id
     of its snapshot, the same as a local copy of those files; only the configs, the index and
     the tokenizer are fetched to derive it;
   * ``default`` (or nothing, where the role has a default model) gives the embedded default's
     checkpoint id (converting it on first use);
   * anything else, a bare name that is neither a folder nor of the hub's ``ORG/NAME`` shape,
     stays as it is (a coordinator or ``status`` may know a model only by name; a peer or a
     client needs a checkpoint to load).

Whichever step gives the name, a weight-only quantization (``--quant int8``, ``model/quant.py``)
is appended as ``@int8``: quantized and full-width weights of one checkpoint are different models
to the swarm, so no route mixes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from p2pserve.errors import ConfigError, UnknownModelError
from p2pserve.model.default import DEFAULT_MODEL_NAME, resolve_model
from p2pserve.model.hub import parse_hub_ref
from p2pserve.model.quant import check_quant, with_quant

DEFAULT_NAMES = (None, "", "default", DEFAULT_MODEL_NAME)


def checkpoint_of(model: Optional[str]) -> Optional[Path]:
    """The checkpoint folder ``--model`` names, or None for a bare model name.

    ``default`` (and None) is the embedded default model, converted on first use; a hub id is
    its snapshot folder, with what a client reads fetched into it. A directory without
    ``config.json`` is an error rather than a name: its owner meant a checkpoint.
    """
    if model in DEFAULT_NAMES:
        return resolve_model(model)
    if parse_hub_ref(model) is not None:
        from p2pserve.model.locate import model_folder

        return model_folder(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelError(f"model folder {model!r} holds no config.json")
        return path
    return None


def derived_name(model: Optional[str], spec=None) -> str:
    """The name ``--model`` alone gives (step 3 of the module's precedence).

    ``spec`` is the checkpoint's ``ModelSpec`` when the caller loaded it already (a peer, a
    client): its ``model_id`` is the name, and nothing is read again.
    """
    if spec is not None:
        return spec.model_id
    folder = checkpoint_of(model)
    if folder is None:
        return str(model)
    from p2pserve.model.spec import load_spec

    return load_spec(folder).model_id


def swarm_model_name(model: Optional[str], *, swarm_model: Optional[str] = None, file_model: Optional[str] = None,
                     spec=None, quant: Optional[str] = None) -> str:
    """The swarm's model name for ``--model`` (see the module docstring for the precedence).

    ``swarm_model`` is ``--swarm-model``, ``file_model`` the swarm file's ``model``; ``spec`` the
    loaded checkpoint's ``ModelSpec`` if the caller has it; ``quant`` (else ``spec.quant``) the
    weight-only quantization, which the name then ends in. Raises ``ConfigError`` on an empty
    ``--swarm-model`` or a scheme that cannot run here, ``UnknownModelError`` on a folder that is
    not a checkpoint.
    """
    quant = check_quant(quant or (spec.quant if spec is not None else None))
    return with_quant(explicit_name(swarm_model, file_model) or derived_name(model, spec), quant)


def explicit_name(swarm_model: Optional[str], file_model: Optional[str]) -> Optional[str]:
    """Steps 1 and 2 of the precedence: ``--swarm-model``, else the swarm file's ``model``, else
    None (the name then follows from ``--model``). A client command resolves these before it
    has loaded its checkpoint."""
    if swarm_model is not None:
        if not swarm_model.strip():
            raise ConfigError("--swarm-model is empty")
        return swarm_model
    return file_model or None
