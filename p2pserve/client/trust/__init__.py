"""The client's trust machinery, behind one seam (:mod:`p2pserve.client.trust.protocol`).

Re-execution of sampled hops on witnesses (``verifier``, ``witness_pool``, ``tape``), where the
witnesses come from (``verify_sources``), and rolling a request back past a caught peer
(``rollback``). A pipeline sees only :class:`~p2pserve.client.trust.protocol.StepTrust`:
:class:`~p2pserve.client.trust.session.VerifiedSession` is the implementation.
"""
