"""C kernels shipped as source in ``p2pserve/model/kernels/``, built for this machine on first use.

Built with the system C compiler (``$CC``, else ``cc``; the one ``torch.compile``'s CPU backend
needs too) for the host CPU (``-march=native``) with OpenMP, and loaded with ``ctypes``. A
kernel's OpenMP team is the calling thread's, and the process shares one OpenMP runtime with
torch (the library is found by its soname), so it runs with the thread count torch runs with.

The library is cached under ``$P2PSERVE_CACHE/kernels`` by a digest of the source, the flags,
the compiler's version and the CPU's flags, so a cache carried to another machine is built again
rather than run on a CPU it was not built for. Several processes may build it at once: each
writes its own file and renames it into place.

Floating point: the flags let the compiler reorder sums (a vectorised reduction), never
``-ffast-math`` as a whole, which would link code that flushes denormals to zero in the whole
process and change every other result in it. Reordered sums are deterministic for one build.

:func:`load` returns None where nothing can be built (no compiler, a build error); callers then
keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from p2pserve.model.default import cache_dir

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("kernels")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros")
BUILD_TIMEOUT_S = 120.0

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def compiler() -> str | None:
    """The C compiler to build with, or None when there is none."""
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _digest(source: bytes, cc: str) -> str:
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = b""
    h = hashlib.sha256(source)
    for part in (" ".join(FLAGS).encode(), version, _cpu_flags().encode()):
        h.update(b"\0" + part)
    return h.hexdigest()[:16]


def build(name: str) -> Path | None:
    """The shared library of ``kernels/<name>.c`` for this machine, built unless cached; None
    when it cannot be built here."""
    cc = compiler()
    if cc is None:
        log.info("no C compiler (%s): the %s kernel is not built", os.environ.get("CC", "cc"), name)
        return None
    source = (SOURCES / f"{name}.c").read_bytes()
    out = cache_dir() / "kernels" / f"{name}-{_digest(source, cc)}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCES / f"{name}.c"), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            log.warning("building the %s kernel failed: %s", name, done.stderr.strip()[-2000:])
            return None
        os.replace(tmp, out)
        return out
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("building the %s kernel failed: %s", name, e)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(name: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` loaded into this process (built first if needed), once; None where it
    cannot be built or loaded."""
    with _lock:
        if name not in _loaded:
            path = build(name)
            lib = None
            if path is not None:
                try:
                    lib = ctypes.CDLL(str(path))
                except OSError as e:
                    log.warning("loading the %s kernel failed: %s", name, e)
            _loaded[name] = lib
        return _loaded[name]
