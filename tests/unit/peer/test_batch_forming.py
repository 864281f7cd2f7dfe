"""Batch forming's decision (peer/batch_forming.py): when a step waits for due sessions. Pure logic,
times given explicitly."""

from __future__ import annotations

from types import SimpleNamespace

from p2pserve.peer.batch_forming import ArrivalForecast


def session():
    return SimpleNamespace(closed=False)


def steady(forecast: ArrivalForecast, sid: str, s, times: list[float]) -> None:
    for t in times:
        forecast.arrived(sid, s, t)


def test_a_lone_session_never_waits():
    f = ArrivalForecast()
    a = session()
    steady(f, "a", a, [0.0, 0.1, 0.2, 0.3])
    assert f.hold_s({"a"}, ready_at=0.3, now=0.3, horizon=0.05) == 0.0


def test_a_step_waits_for_a_session_due_within_the_horizon_and_no_longer():
    f = ArrivalForecast()
    a, b = session(), session()
    steady(f, "a", a, [0.0, 0.1, 0.2])
    steady(f, "b", b, [0.01, 0.11])  # due at 0.21
    assert abs(f.hold_s({"a"}, ready_at=0.2, now=0.2, horizon=0.05) - 0.05) < 1e-9  # hold until ready + horizon
    assert f.hold_s({"a"}, ready_at=0.2, now=0.23, horizon=0.05) > 0  # b is late, still within the horizon
    assert f.hold_s({"a"}, ready_at=0.2, now=0.25, horizon=0.05) == 0.0  # the horizon is spent
    f.arrived("b", b, 0.215)
    assert f.hold_s({"a", "b"}, ready_at=0.2, now=0.215, horizon=0.05) == 0.0  # everyone due is here


def test_sessions_due_later_than_the_horizon_overdue_or_closed_are_not_waited_for():
    f = ArrivalForecast()
    a, later, gone, closed = session(), session(), session(), session()
    steady(f, "a", a, [0.0, 0.1, 0.2])
    steady(f, "later", later, [0.0, 0.2])  # due at 0.4
    steady(f, "gone", gone, [0.0, 0.05])  # due at 0.1: overdue by more than the horizon at 0.2
    steady(f, "closed", closed, [0.1, 0.2])  # due at 0.3 but closed
    closed.closed = True
    assert f.hold_s({"a"}, ready_at=0.2, now=0.2, horizon=0.05) == 0.0
    assert len(f) == 3  # the closed session was forgotten


def test_a_session_with_one_forward_has_no_period_and_is_not_waited_for():
    f = ArrivalForecast()
    a, new = session(), session()
    steady(f, "a", a, [0.0, 0.1, 0.2])
    f.arrived("new", new, 0.19)
    assert f.hold_s({"a"}, ready_at=0.2, now=0.2, horizon=0.05) == 0.0


def test_no_horizon_no_hold_and_a_reused_id_starts_over():
    f = ArrivalForecast()
    a, b, b2 = session(), session(), session()
    steady(f, "a", a, [0.0, 0.1, 0.2])
    steady(f, "b", b, [0.0, 0.1])
    assert f.hold_s({"a"}, ready_at=0.2, now=0.2, horizon=0.0) == 0.0
    b.closed = True
    f.hold_s({"a"}, ready_at=0.2, now=0.2, horizon=0.0)  # off, closed sessions still leave
    assert len(f) == 1
    b.closed = False
    f.arrived("b", b2, 0.15)  # a new session under a closed one's id: no period yet
    assert f.hold_s({"a"}, ready_at=0.2, now=0.2, horizon=0.05) == 0.0


def test_silent_sessions_are_forgotten():
    f = ArrivalForecast()
    a, quiet = session(), session()
    steady(f, "quiet", quiet, [0.0, 0.1])
    steady(f, "a", a, [5.0, 5.1])
    f.hold_s({"a"}, ready_at=5.1, now=5.1, horizon=0.05)
    assert len(f) == 1


def test_active_counts_open_sessions_seen_lately():
    """gLLM's #RD at a peer: sessions still open and not silent for many periods."""
    f = ArrivalForecast()
    a, b, c = session(), session(), session()
    steady(f, "a", a, [0.0, 0.1, 0.2])
    steady(f, "b", b, [0.0, 0.1, 0.2])
    steady(f, "c", c, [0.0, 0.1])
    assert f.active(0.25) == 3
    c.closed = True
    assert f.active(0.25) == 2
    assert f.active(0.2 + 8 * 0.1 + 0.5) == 0  # silent for more than 8 periods (and 1 s): stale
