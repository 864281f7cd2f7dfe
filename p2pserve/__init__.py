"""p2pserve: peer-to-peer serving of large language models.

Heavy dependencies (torch, hivemind) are imported lazily so that `p2pserve plan --help`
and the pure planning/simulation code start fast. ``p2pserve.Client`` and
``p2pserve.AsyncClient`` (the Python API, :mod:`p2pserve.client.api`) load on first access.
"""

__version__ = "0.1.0"

_LAZY = {"Client": "p2pserve.client.api", "AsyncClient": "p2pserve.client.api", "Reply": "p2pserve.client.api"}

__all__ = ["Client", "AsyncClient", "Reply", "__version__"]


def __getattr__(name: str):
    """Import the client API only when ``p2pserve.Client`` / ``AsyncClient`` is first used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
