"""The typed swarm file, and the one rule that merges it with a command's flags.

A :class:`SwarmFile` (TOML or JSON, see ``bootstrap/swarm.toml``) holds what every member of one
swarm must agree on; it is validated on load. A command builds its role's config
(:mod:`p2pserve.config`) with :func:`merge`: a flag that was given wins over the file, even when
it is 0 or empty, and a value neither gives keeps the dataclass default (commands use argparse
defaults of ``None`` to tell a flag that was not given).
"""

from __future__ import annotations

import json
import tomllib
from typing import Any, Mapping, Optional

import msgspec

from p2pserve.errors import ConfigError


class _FileTable(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Base of the swarm file's tables: every field optional (None = the file does not set it),
    unknown keys rejected so that a typo fails loudly instead of being ignored."""

    def values(self) -> dict[str, Any]:
        """The fields this table sets, by name."""
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}


class Timing(_FileTable, frozen=True):
    """``[timing]``: refresh periods (seconds) of every member; each record lives
    ``max(2 x refresh, max_clock_skew)``."""

    peer_refresh: Optional[float] = None
    link_refresh: Optional[float] = None
    candidate_refresh: Optional[float] = None
    plan_refresh: Optional[float] = None
    max_clock_skew: Optional[float] = None
    report_ttl: Optional[float] = None
    evidence_ttl: Optional[float] = None
    handover_max_wait: Optional[float] = None


class ModelSettings(_FileTable, frozen=True):
    """``[models."<name>"]``: what a coordinator needs to plan one model."""

    num_layers: Optional[int] = None
    activation_bytes: Optional[int] = None  # hidden_size x bytes per element of the activations
    replan_period: Optional[float] = None
    link_change_threshold: Optional[float] = None
    objective: Optional[str] = None
    solve_time_limit: Optional[float] = None


class SwarmFile(_FileTable, frozen=True):
    """What every member of one swarm must agree on: its id, bootstrap addresses, trusted
    coordinator keys, the members' peer ids if it admits only those, refresh periods and, per model, the coordinator's planning settings."""

    swarm_id: Optional[str] = None
    model: Optional[str] = None  # default model of commands not given --model
    initial_peers: Optional[tuple[str, ...]] = None
    trusted_coordinators: Optional[tuple[str, ...]] = None
    allowed_peers: Optional[tuple[str, ...]] = None  # member peer ids (a private swarm); unset = open
    host_maddrs: Optional[tuple[str, ...]] = None
    announce_maddrs: Optional[tuple[str, ...]] = None
    identity_path: Optional[str] = None
    key_path: Optional[str] = None
    use_relay: Optional[bool] = None
    use_auto_relay: Optional[bool] = None
    client_mode: Optional[bool] = None
    timing: Timing = Timing()
    models: dict[str, ModelSettings] = {}

    @classmethod
    def load(cls, path: Optional[str]) -> "SwarmFile":
        """Parse and validate a swarm file (``.json``, else TOML); an empty file for ``None``."""
        if not path:
            return cls()
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read swarm config {path}: {e}") from e
        try:
            raw = json.loads(data) if str(path).endswith(".json") else tomllib.loads(data.decode())
        except (ValueError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{path}: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a table at top level")
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as e:
            raise ConfigError(f"{path}: {e}") from e

    def dht_values(self) -> dict[str, Any]:
        """The :class:`DHTConfig` fields this file sets (its top level and ``[timing]``)."""
        out = self.values()
        for table in ("timing", "models"):
            out.pop(table, None)
        return {**out, **self.timing.values()}

    def model_settings(self, model: str) -> ModelSettings:
        """The ``[models."<model>"]`` table (empty if absent)."""
        return self.models.get(model, ModelSettings())

    def to_json(self) -> bytes:
        """JSON text of the fields this file sets (what :meth:`load` reads back)."""
        return msgspec.json.encode({**self.values(), "timing": self.timing.values(),
                                    "models": {m: s.values() for m, s in self.models.items()}})


def merge(file: Mapping[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """Config values from a swarm file overlaid by flags: every flag that was given wins.

    "Given" means not ``None``: a flag set to 0, ``False`` or an empty list overrides the file.
    A key neither sets is absent, so the role's config dataclass supplies its default.
    """
    out = {k: v for k, v in file.items() if v is not None}
    out.update({k: v for k, v in flags.items() if v is not None})
    return out
