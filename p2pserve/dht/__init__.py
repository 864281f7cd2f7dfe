"""The control plane's DHT layer: with ``p2pserve.transport``, the only code that touches hivemind.

Roles depend on the protocols in ``view`` (``SwarmView``, ``SwarmReader``, ``LinkProbes``);
``swarm``, ``prober`` and ``node`` implement them over hivemind. ``records``, ``keys``,
``election`` and ``announcer`` are pure or hivemind-free.
"""
