"""p2pserve: peer-to-peer serving of large language models.

Heavy dependencies (torch, hivemind) are imported lazily so that `p2pserve plan --help`
and the pure planning/simulation code start fast.
"""

__version__ = "0.1.0"
