"""Property-based fuzzing of every decoder of network bytes.

Every byte from the network is hostile until validated: each property here feeds a decoder both
arbitrary bytes and valid messages mutated at the structure and byte level, and asserts that it
returns a validated value or raises a typed error from :mod:`p2pserve.errors`, never anything
else, never hangs, never allocates for a size that is only claimed.

One settings profile, :data:`FUZZ`, serves every property: ``P2PSERVE_FUZZ_EXAMPLES`` examples
each (2,000 by default, what CI runs; ``benchmarks/fuzz.py --examples 100000`` is the long run),
no deadline (the machine is shared and slow), derandomized so CI is reproducible unless
``P2PSERVE_FUZZ_RANDOM=1``, and no example database (the tree stays clean; a failure prints its
reproduction blob instead).

:func:`counted` wraps each property so that the benchmark can report how many examples ran per
decoder, and, when ``P2PSERVE_FUZZ_EXAMPLE_TIMEOUT`` is set (the benchmark does; under pytest,
pytest-timeout owns SIGALRM), fails an example that runs longer than that as stuck.
"""

from __future__ import annotations

import functools
import os
import signal
from collections import Counter

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("P2PSERVE_FUZZ_EXAMPLES", "2000"))
STATEFUL_EXAMPLES = int(os.environ.get("P2PSERVE_FUZZ_STATEFUL_EXAMPLES", "30"))
_RANDOM = os.environ.get("P2PSERVE_FUZZ_RANDOM", "") not in ("", "0")
_EXAMPLE_TIMEOUT_S = float(os.environ.get("P2PSERVE_FUZZ_EXAMPLE_TIMEOUT", "0"))

settings.register_profile(
    "p2pserve-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not _RANDOM,
    database=None,
    print_blob=True,
    # Mutated messages are large on purpose (huge lists), and a busy 2-core machine is slow.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
FUZZ = settings.get_profile("p2pserve-fuzz")

#: Examples run per decoder name, in this process (the benchmark reads it).
RUNS: Counter = Counter()


class StuckExample(AssertionError):
    """One example ran longer than ``P2PSERVE_FUZZ_EXAMPLE_TIMEOUT``: the decoder hangs."""


def _on_alarm(signum, frame):
    raise StuckExample(f"an example ran past {_EXAMPLE_TIMEOUT_S} s")


def counted(name: str):
    """Count each example of a property under the decoder ``name`` (and time it out, if asked)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            RUNS[name] += 1
            if _EXAMPLE_TIMEOUT_S <= 0:
                return fn(*args, **kwargs)
            previous = signal.signal(signal.SIGALRM, _on_alarm)
            signal.setitimer(signal.ITIMER_REAL, _EXAMPLE_TIMEOUT_S)
            try:
                return fn(*args, **kwargs)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)

        run.decoder = name
        return run

    return wrap
