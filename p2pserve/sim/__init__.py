"""Discrete-event simulator of a heterogeneous GPU cluster serving one LLM.

Entry points: :func:`p2pserve.sim.run.simulate` (a :class:`~p2pserve.sim.scenario.Scenario` +
a :class:`~p2pserve.sim.run.SimConfig`) and the ``p2pserve sim`` command
(:mod:`p2pserve.cli.sim`). Design, semantics and measured figures: ``docs/sim.md``.
"""
