"""Which checkpoint tensors, and so which safetensors files, a layer range needs.

The same choice ``Shard.load`` makes when it reads a range: every tensor of decoder layers
[start, end); the embeddings when the range holds layer 0; the final norm and the LM head when
it ends at the last layer, or the embedding matrix in the head's place when embeddings are tied
and the checkpoint stores no head. A peer that fetches weights from the hub asks this module
which files to download, so it never fetches a file none of its tensors live in.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# a weight file named by an index: a plain file at the repository's root
_WEIGHT_FILE = re.compile(r"^[A-Za-z0-9_][\w.-]*\.safetensors$")


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor name belongs to (``model.layers.7.mlp...`` -> 7), else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def tensors_for_range(names: Iterable[str], num_layers: int, start: int, end: int, tied: bool) -> set[str]:
    """The tensors of ``names`` that layers [start, end) of a ``num_layers``-layer model read."""
    names = set(names)
    wanted = {n for n in names if (i := layer_of(n)) is not None and start <= i < end}
    if start == 0:
        wanted.add(EMBED)
    if end == num_layers:
        wanted.add(NORM)
        if HEAD in names:
            wanted.add(HEAD)
        elif tied:
            wanted.add(EMBED)
    return wanted & names


def files_for_range(weight_map: Mapping[str, str], num_layers: int, start: int, end: int, tied: bool) -> set[str]:
    """The files (values of an index's ``weight_map``) holding the tensors layers [start, end) read."""
    return {weight_map[n] for n in tensors_for_range(weight_map, num_layers, start, end, tied)}


def check_weight_map(index: object, where: str) -> dict[str, str]:
    """The ``weight_map`` of a parsed ``model.safetensors.index.json``, validated: tensor name ->
    file name, every file a plain ``*.safetensors`` name at the repository root (an index from the
    network must not steer a download anywhere else). Raises ``ValueError`` naming ``where``."""
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{where}: no weight_map")
    for name, fname in weight_map.items():
        if not isinstance(name, str) or not isinstance(fname, str) or not _WEIGHT_FILE.match(fname) or ".." in fname:
            raise ValueError(f"{where}: bad weight_map entry {name!r}: {fname!r}")
    return dict(weight_map)


def is_weight_file(name: str) -> bool:
    """Whether ``name`` is a root-level ``*.safetensors`` file name."""
    return bool(_WEIGHT_FILE.match(name)) and ".." not in name
