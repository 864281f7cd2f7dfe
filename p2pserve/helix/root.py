"""Where the Helix (ASPLOS'25) artifact data is read from.

One root directory holds ``clusters/``, ``layouts/``, ``profiles/``, ``node_throughput/`` and
``traces/``. It is, first match wins:

1. the directory given explicitly (the ``--data`` flag of ``p2pserve plan`` / ``p2pserve sim``);
2. ``$P2PSERVE_HELIX_DATA``;
3. the copy shipped inside this package, ``p2pserve/helix/data/`` (Apache-2.0: the licence and
   the authors' README sit next to it). The copy leaves out big files no code reads: the MILP
   models (``*.lp``), Gurobi solutions (``*.sol``) and logs (``trace.txt``), and the Alpaca and
   ShareGPT length traces.

Relative cluster and layout names resolve against the root's ``clusters/`` and ``layouts/``, so
``--cluster single_cluster/cluster24.ini`` works from any directory.
"""

from __future__ import annotations

import os
from pathlib import Path

from p2pserve.errors import ConfigError

#: Environment variable naming a data root (overrides the packaged copy).
ENV_VAR = "P2PSERVE_HELIX_DATA"
#: The copy of the artifact data shipped with the package.
PACKAGED_ROOT = Path(__file__).resolve().parent / "data"


def data_root(explicit: str | os.PathLike | None = None) -> Path:
    """The data root: ``explicit`` if given, else ``$P2PSERVE_HELIX_DATA``, else the packaged copy.

    Raises :class:`ConfigError` when the chosen directory does not exist.
    """
    if explicit is not None:
        return _existing_dir(Path(explicit), "--data")
    env = os.environ.get(ENV_VAR)
    if env:
        return _existing_dir(Path(env), ENV_VAR)
    return _existing_dir(PACKAGED_ROOT, "the packaged Helix data")


def _existing_dir(path: Path, what: str) -> Path:
    if not path.is_dir():
        raise ConfigError(f"{what}: {str(path)!r} is not a directory holding the Helix data")
    return path


def resolve_file(name: str | os.PathLike, kind: str, root: Path | None = None) -> Path:
    """A data file named by the user: ``name`` itself when it exists, else ``<root>/<kind>/<name>``.

    ``kind`` is ``clusters`` or ``layouts``. Raises :class:`ConfigError` when neither exists.
    """
    path = Path(name)
    if path.is_file():
        return path
    base = root if root is not None else data_root()
    candidate = base / kind / path
    if candidate.is_file():
        return candidate
    raise ConfigError(f"no file {str(name)!r} here nor under {base / kind}")
