"""Fakes for unit tests of pure logic, shipped once here instead of copied into each test.

Integration tests use real hivemind nodes, real peer processes and real models; these fakes
stand in only around the decision logic:

* :class:`FakeClock` — a clock moved by hand (``p2pserve.clock``'s seam);
* :class:`FakeSwarm` on a :class:`FakeSwarmStore` — the swarm protocol (``dht.view.SwarmView``)
  in memory, several nodes sharing one store; :class:`MissingReads` — one whose peer reads miss
  chosen peers; :class:`FakeDHT` — hivemind's store/get in memory, under the real ``Swarm``;
* :class:`~p2pserve.testing.probes.FakeLinkProbes` — a link prober that measures nothing;
* :class:`MemoryTransport` on a :class:`MemoryNetwork` — the transport protocol in memory;
  :class:`FakePeerNetwork` — fake peers on it, for the real client pipeline;
* :class:`FakeClient` — a finished-reply client for the OpenAI server;
* :class:`InstantPipeline` — a pipeline whose steps cost nothing, under the real generation
  loop; :class:`InstantClient` — the OpenAI server's client over such pipelines (what the API
  spends per token is measured with them);
* :class:`~p2pserve.testing.verdicts.ScriptedVerifier` — convicts a peer at a chosen step;
* ``python -m p2pserve.testing.synthetic_peer`` — a peer process that announces without a model.
* :func:`~p2pserve.testing.direct.answer_direct_session` — a session handler that only offers the
  direct path (``p2pserve.testing.direct``); ``p2pserve.testing.delay_relay`` — a delaying relay.
"""

from p2pserve.testing.clock import FakeClock
from p2pserve.testing.instant import InstantClient, InstantPipeline
from p2pserve.testing.openai import FakeClient, FakeReplyStream, fake_reply
from p2pserve.testing.peers import (
    FAKE_MODEL_ID,
    ByteTokenizer,
    FakePeerNetwork,
    FixedRoutes,
    MemoryNetwork,
    MemoryTransport,
    fake_next_token,
)
from p2pserve.testing.probes import FakeLinkProbes
from p2pserve.testing.swarm import FakeDHT, FakeSwarm, FakeSwarmStore, MissingReads, StoredRecord
from p2pserve.testing.verdicts import ScriptedVerifier

__all__ = [
    "FAKE_MODEL_ID", "ByteTokenizer", "FakeClient", "FakeClock", "FakeDHT", "FakeLinkProbes", "FakePeerNetwork",
    "FakeReplyStream", "FakeSwarm", "FakeSwarmStore", "FixedRoutes", "InstantClient", "InstantPipeline",
    "MemoryNetwork", "MemoryTransport", "MissingReads", "ScriptedVerifier", "StoredRecord", "fake_next_token",
    "fake_reply",
]
