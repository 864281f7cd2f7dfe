"""Selective reads from a safetensors checkpoint.

Only the tensors a shard needs are ever read: safetensors files start with a JSON header of
offsets, so listing names costs a header read, and `get_tensor` maps just that tensor's bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from p2pserve.errors import UnknownModelError


class CheckpointIndex:
    """Maps tensor names to the safetensors file that holds them."""

    def __init__(self, model_path: str | Path):
        self.root = Path(model_path)
        index_file = self.root / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            self._where = {name: self.root / fname for name, fname in weight_map.items()}
        else:
            files = sorted(self.root.glob("*.safetensors"))
            if not files:
                raise UnknownModelError(f"no *.safetensors files in {self.root}")
            self._where = {}
            for f in files:
                with safe_open(str(f), framework="pt") as handle:
                    for name in handle.keys():
                        self._where[name] = f

    def has(self, name: str) -> bool:
        """True if the checkpoint stores a tensor with this name."""
        return name in self._where

    def names_with_prefix(self, prefix: str) -> list[str]:
        """All tensor names starting with ``prefix``."""
        return [n for n in self._where if n.startswith(prefix)]

    def read(self, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read just these tensors, grouped per file, cast to ``dtype``."""
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._where[name], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for f, group in by_file.items():
            with safe_open(str(f), framework="pt") as handle:
                for name in group:
                    t = handle.get_tensor(name)
                    out[name] = t.to(dtype) if t.is_floating_point() else t
        return out
