"""Every setting of p2pserve, as frozen dataclasses, one module per role.

Defaults, their documentation and their validation (in ``__post_init__``, so a Python caller
gets the same error as a command-line user) live only here:

* :mod:`~p2pserve.config.peer`: :class:`PeerConfig` and what it holds (admission, batching,
  push forwarding, tensor parallelism, link probing, the ``/metrics`` endpoint);
* :mod:`~p2pserve.config.client`: :class:`ClientConfig`, :class:`PushConfig`,
  :class:`SpeculativeConfig`;
* :mod:`~p2pserve.config.http`: :class:`ApiConfig` (the OpenAI-compatible server) and
  :class:`DashboardConfig`;
* :mod:`~p2pserve.config.dht`: :class:`DHTConfig` (every member's view of the swarm),
  :class:`ProberConfig`, :class:`BootstrapConfig`;
* :mod:`~p2pserve.config.coordinator`: :class:`CoordinatorConfig`, :class:`ComputeProbeConfig`;
* :mod:`~p2pserve.config.machine`: :class:`MachineConfig`; :mod:`~p2pserve.config.metrics`:
  :class:`MetricsConfig`;
* :mod:`~p2pserve.config.swarm_file`: the typed swarm file and :func:`merge`, the one rule by
  which a command builds its role's config from that file and its flags (a value neither gives
  keeps the dataclass default).

The settings of the pure libraries (``PlannerConfig``, ``GroupingConfig`` and ``ChurnConfig`` in
``placement/``, the simulator's in ``sim/``) stay beside them: they hold those libraries' own
types (a ``WorkloadModel``), and this package imports no role or library, only the wire
limits of :mod:`p2pserve.protocol` and :mod:`p2pserve.errors`.
"""

from p2pserve.config.client import PUSH_MODES, ClientConfig, PushConfig, SpeculativeConfig
from p2pserve.config.coordinator import ComputeProbeConfig, CoordinatorConfig
from p2pserve.config.dht import BootstrapConfig, DHTConfig, ProberConfig, ttl_for
from p2pserve.config.http import ApiConfig, DashboardConfig
from p2pserve.config.machine import MachineConfig
from p2pserve.config.metrics import MetricsConfig
from p2pserve.config.peer import AdmissionConfig, BatchingConfig, ForwardingConfig, PeerConfig, TPConfig

__all__ = [
    "PUSH_MODES", "AdmissionConfig", "ApiConfig", "BatchingConfig", "BootstrapConfig", "ClientConfig",
    "ComputeProbeConfig", "CoordinatorConfig", "DHTConfig", "DashboardConfig", "ForwardingConfig", "MachineConfig",
    "MetricsConfig", "PeerConfig", "ProberConfig", "PushConfig", "SpeculativeConfig", "TPConfig", "ttl_for",
]
