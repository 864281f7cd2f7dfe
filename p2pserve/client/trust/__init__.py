"""The client's trust machinery, behind one seam (:mod:`p2pserve.client.trust.protocol`).

Re-execution of sampled hops on witnesses (``verifier``, ``witness_pool``, ``tape``), where the
witnesses come from (``verify_sources``), and rolling a request back past a caught peer
(``rollback``), and the timing of peers' hops for the service reports (``observer``). A pipeline
sees only :mod:`~p2pserve.client.trust.protocol` (``StepTrust``, ``HopObserver``):
:class:`~p2pserve.client.trust.session.VerifiedSession` and ``observer.ServiceObserver`` implement it.
"""
