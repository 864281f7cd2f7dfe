"""Election and plan choice (pure)."""

from p2pserve.dht.election import SignedPlan, choose_plan, elect_leader, next_epoch
from p2pserve.dht.records import CoordinatorCandidate, Plan


def cand(cid, prio=0, start=0.0):
    return CoordinatorCandidate(model="m", coordinator_id=cid, priority=prio, start_time=start, public_key="k")


def test_priority_then_oldest_then_id():
    assert elect_leader([]) is None
    assert elect_leader([cand("a", 0), cand("b", 5)]).coordinator_id == "b"
    assert elect_leader([cand("a", 1, 10.0), cand("b", 1, 5.0)]).coordinator_id == "b"
    assert elect_leader([cand("b", 1, 5.0), cand("a", 1, 5.0)]).coordinator_id == "a"


def test_every_candidate_agrees_whatever_the_order():
    cs = [cand("x", 1, 3.0), cand("y", 2, 9.0), cand("z", 2, 1.0), cand("w", 2, 1.0)]
    leaders = {elect_leader(cs[i:] + cs[:i]).coordinator_id for i in range(len(cs))}
    assert leaders == {"w"}


def test_epochs_and_plan_choice():
    assert next_epoch([]) == 1
    assert next_epoch([3, 7, 2]) == 8

    def sp(epoch, leader, signer="s"):
        return SignedPlan(Plan(model="m", epoch=epoch, leader_id=leader, num_layers=1), signer)

    assert choose_plan([]) is None
    assert choose_plan([sp(1, "a"), sp(3, "b"), sp(2, "c")]).plan.leader_id == "b"
    # a tie (two leaders for a moment) resolves to the lowest leader id, deterministically
    assert choose_plan([sp(4, "b"), sp(4, "a")]).plan.leader_id == "a"
    assert choose_plan([sp(4, "a"), sp(4, "b")]).plan.leader_id == "a"
