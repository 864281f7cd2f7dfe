"""Compatibility re-export: ``DHTConfig`` now lives in :mod:`p2pserve.config` with every role's
config. Kept only for modules outside the control plane that still import it from here; import
it from ``p2pserve.config`` in new code."""

from p2pserve.config import DHTConfig

__all__ = ["DHTConfig"]
