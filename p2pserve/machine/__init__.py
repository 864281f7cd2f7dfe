"""The machine agent (``p2pserve machine``): a machine's slots offered to the swarm as TP groups."""
