"""RecentTimes: the window behind the medians a peer reports."""

from p2pserve.peer.timing import RecentTimes


def test_median_over_the_window_only():
    t = RecentTimes(window=3)
    assert t.median_ms == 0.0
    for s in (0.100, 0.001, 0.002, 0.003):  # the 100 ms sample drops out
        t.add(s)
    assert t.median_ms == 2.0
