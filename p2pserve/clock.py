"""Time, behind one seam: decision logic takes a clock, so tests can drive it with a fake.

Two clocks, for two jobs:

* :func:`monotonic` measures durations and deadlines inside one process; it never goes back.
* :func:`wall` is seconds since the epoch, shared by every machine in the swarm: record
  timestamps and expirations in the DHT (hivemind's ``get_dht_time`` is the same clock).

:class:`p2pserve.testing.FakeClock` stands in for either.
"""

from __future__ import annotations

import time
from typing import Callable

#: A clock: a callable returning seconds as a float.
Clock = Callable[[], float]

monotonic: Clock = time.monotonic
wall: Clock = time.time
