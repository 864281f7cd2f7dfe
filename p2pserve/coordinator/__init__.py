"""The placement coordinator: a thin async shell (``service``) over a pure ``replan()``.

``snapshot`` (the swarm's records at one instant), ``trigger`` (why to re-plan), ``targets``
(where peers should be, via ``p2pserve.placement``), ``plan_record`` (the Plan a leader
publishes) and ``replan`` (the round's decision) do no I/O; ``service`` talks to the swarm
through ``p2pserve.dht.view.SwarmView`` only.
"""
