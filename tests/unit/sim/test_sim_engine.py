"""Event engine and links: ordering, FIFO, timing."""

from p2pserve.sim.engine import EventLoop
from p2pserve.sim.link import Link


def test_events_run_in_time_order_and_fifo_on_ties():
    loop = EventLoop()
    seen = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")  # same time: scheduled later, runs later
    loop.at(5.0, seen.append, "late")
    loop.run(3.0)
    assert seen == ["a", "b", "c"]
    assert loop.now == 3.0
    assert loop.pending() == 1


def test_events_scheduled_from_callbacks_and_never_in_the_past():
    loop = EventLoop()
    times = []

    def tick(n):
        times.append(loop.now)
        if n:
            loop.after(0.5, tick, n - 1)
            loop.at(-1.0, lambda _: times.append(("past", loop.now)))

    loop.at(0.0, tick, 2)
    loop.run(float("inf"))
    assert times[0] == 0.0
    assert ("past", 0.0) in times and ("past", 0.5) in times
    assert [t for t in times if not isinstance(t, tuple)] == [0.0, 0.5, 1.0]


def test_link_is_fifo_one_message_at_a_time():
    loop = EventLoop()
    got = []
    link = Link(loop, 0, 1, bandwidth=1000.0, latency=0.01, deliver=lambda jobs: got.append((loop.now, jobs)))
    link.send(["a"], 100)  # 0.01 + 0.1
    link.send(["b"], 10)  # queued: starts at 0.11, takes 0.02
    loop.at(0.05, lambda _: link.send(["c"], 0))  # queued behind b: 0.13 + 0.01
    loop.run(10)
    assert [j for _, j in got] == [["a"], ["b"], ["c"]]
    times = [t for t, _ in got]
    assert abs(times[0] - 0.11) < 1e-12
    assert abs(times[1] - 0.13) < 1e-12
    assert abs(times[2] - 0.14) < 1e-12
    assert link.messages == 3 and not link.busy


def test_link_idle_gap_restarts_immediately():
    loop = EventLoop()
    got = []
    link = Link(loop, 0, 1, bandwidth=1e6, latency=0.001, deliver=lambda jobs: got.append(loop.now))
    link.send([1], 0)
    loop.at(1.0, lambda _: link.send([2], 0))
    loop.run(10)
    assert abs(got[0] - 0.001) < 1e-12 and abs(got[1] - 1.001) < 1e-12
