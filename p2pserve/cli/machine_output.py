"""Machine-readable output that stays machine-readable.

``p2pserve plan --json`` and ``p2pserve sim --json`` promise exactly one JSON document on standard
output. Native libraries do not know that: HiGHS prints its banner ("Running HiGHS …") from C++
straight to file descriptor 1 when a solver object is made, before any option can silence it.
Redirecting ``sys.stdout`` does not catch that, so :func:`stdout_to_stderr` moves the descriptor
itself for the duration of the work and hands back a writer on the real standard output.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Iterator, TextIO


@contextlib.contextmanager
def stdout_to_stderr(active: bool = True) -> Iterator[TextIO]:
    """Send everything written to fd 1 (Python or native) to fd 2 while the block runs.

    Yields a text stream on the original standard output, for the one document the command
    prints. With ``active=False`` nothing is moved and ``sys.stdout`` is yielded.
    """
    if not active:
        yield sys.stdout
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with os.fdopen(os.dup(saved), "w", closefd=True) as real:
            try:
                yield real
            finally:
                real.flush()
                sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def print_json(doc: object, out: TextIO) -> None:
    """One indented JSON document and a newline on ``out``."""
    out.write(json.dumps(doc, indent=2) + "\n")
