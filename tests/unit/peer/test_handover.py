"""Make-before-break: when a loaded peer may drop its old range (pure decision)."""

from __future__ import annotations

from p2pserve.peer.handover import OtherPeer, flip_decision

LIMITS = dict(grace_s=10.0, settle_s=5.0, max_wait_s=120.0)


def decide(serving, target, others, waited=0.0):
    """(flips now, why): a bridge is not a flip."""
    step, why = flip_decision(serving, target, others, waited, **LIMITS)
    return step == "flip", why


def test_flips_at_once_when_nothing_is_dropped_or_others_serve_it():
    assert decide(None, (0, 4), [])[0]
    assert decide((0, 4), (0, 6), [])[0]  # grows: drops nothing
    assert decide((0, 4), (2, 6), [OtherPeer(serving=(0, 3))])[0]


def test_waits_for_a_peer_loading_the_dropped_layers_then_gives_up():
    others = [OtherPeer(serving=None, loading=(0, 2))]
    flip, why = decide((0, 4), (2, 6), others, waited=30.0)
    assert not flip and "[0, 2)" in why and "being loaded" in why
    assert decide((0, 4), (2, 6), others, waited=121.0)[0]
    # the plan assigns them to a live peer that has not started loading: also coming
    assigned = [OtherPeer(serving=(6, 8), target=(0, 2))]
    assert not decide((0, 4), (2, 6), assigned, waited=30.0)[0]


def test_a_loaded_newcomer_is_waited_for_until_it_serves():
    """A loaded peer that serves nothing flips by itself: flipping 'together' with it would
    leave its layers unserved until its own flip is announced."""
    newcomer = [OtherPeer(serving=None, loading=(0, 2), loaded=True)]
    assert not decide((0, 4), (2, 6), newcomer, waited=30.0)[0]
    assert decide((0, 4), (2, 6), [OtherPeer(serving=(0, 2))], waited=30.0)[0]


def test_a_swap_of_two_loaded_peers_that_cannot_bridge_flips_together_after_settling():
    partner = [OtherPeer(serving=(5, 8), loading=(0, 2), loaded=True), OtherPeer(serving=(2, 5))]
    assert not decide((0, 2), (5, 8), partner, waited=1.0)[0]  # let the partner see our "loaded" first
    flip, why = decide((0, 2), (5, 8), partner, waited=6.0)
    assert flip and "together" in why


def test_a_swap_bridges_where_old_and_new_ranges_touch_and_no_layer_goes_unserved():
    """Each step of a swap keeps every layer served: the peer whose ranges overlap serves both
    first; its partner, which cannot, waits for that and then flips; the bridge then drops the
    old part."""
    from p2pserve.peer.handover import hull

    assert hull((0, 3), (2, 5)) == (0, 5) and hull((0, 4), (4, 8)) == (0, 8) and hull((3, 7), (0, 2)) is None
    rest = OtherPeer(serving=(5, 8))
    b, a = ((0, 3), (2, 5)), ((3, 7), (0, 2))  # (serving, loaded target) of the two partners
    other = lambda p, serving=None: OtherPeer(serving=serving or p[0], loading=p[1], loaded=True)  # noqa: E731
    step, why = flip_decision(*b, [other(a), rest], 1.0, **LIMITS)
    assert step == "wait"  # settling
    step, why = flip_decision(*b, [other(a), rest], 6.0, **LIMITS)
    assert step == "bridge" and "both" in why
    # the partner never flips together with a peer that can bridge: it waits to see the bridge
    assert flip_decision(*a, [other(b), rest], 60.0, **LIMITS)[0] == "wait"
    assert flip_decision(*a, [other(b, serving=(0, 5)), rest], 0.0, **LIMITS)[0] == "flip"
    # the bridge waits for the partner (a superset never flips together), then drops its old part
    assert flip_decision((0, 5), (2, 5), [other(a), rest], 60.0, **LIMITS)[0] == "wait"
    assert flip_decision((0, 5), (2, 5), [OtherPeer(serving=(0, 2)), rest], 0.0, **LIMITS)[0] == "flip"


def test_two_partners_that_can_both_bridge_both_do():
    left, right = ((0, 4), (4, 8)), ((4, 8), (0, 4))
    assert flip_decision(*left, [OtherPeer(serving=right[0], loading=right[1], loaded=True)], 6.0, **LIMITS)[0] == "bridge"
    assert flip_decision(*right, [OtherPeer(serving=left[0], loading=left[1], loaded=True)], 6.0, **LIMITS)[0] == "bridge"
    assert flip_decision((0, 8), (4, 8), [OtherPeer(serving=(0, 8), loading=(0, 4), loaded=True)], 0.0, **LIMITS)[0] == "flip"


def test_nobody_taking_the_layers_waits_only_the_grace_period():
    assert not decide((0, 4), (2, 6), [OtherPeer(serving=(6, 8))], waited=3.0)[0]
    flip, why = decide((0, 4), (2, 6), [OtherPeer(serving=(6, 8))], waited=11.0)
    assert flip and "nobody is taking layers [0, 2)" in why


def test_a_swap_cut_by_a_new_plan_still_completes():
    """A partner flipped counting on our load; the plan then moved us elsewhere. The layers it
    dropped are served by nobody but our loaded range: they are orphaned, and the handover goes on
    (it flips at once, since the partner serves what we drop)."""
    from p2pserve.peer.handover import orphaned

    partner = OtherPeer(serving=(2, 5))  # flipped from [0, 5) to [2, 5), counting on us for [0, 2)
    assert orphaned((3, 8), (0, 3), [partner]) == {0, 1}
    assert decide((3, 8), (0, 3), [partner, OtherPeer(serving=(4, 8))])[0]
    # once another peer serves them, nothing is orphaned: the load may be discarded
    assert orphaned((3, 8), (0, 3), [partner, OtherPeer(serving=(0, 2))]) == set()
    assert orphaned(None, (0, 3), []) == {0, 1, 2}


def test_a_moved_peer_drops_its_load_unless_layers_of_it_are_orphaned():
    from p2pserve.peer.handover import handover_step

    partner, rest = OtherPeer(serving=(2, 5)), OtherPeer(serving=(4, 8))
    step, why = handover_step((3, 8), (0, 3), [partner, rest], True, 0.0, **LIMITS)
    assert step == "flip" and "[0, 2)" in why  # the swap completes
    covered = [partner, rest, OtherPeer(serving=(0, 2))]
    assert handover_step((3, 8), (0, 3), covered, True, 0.0, **LIMITS)[0] == "drop"
    assert handover_step((3, 8), (0, 3), covered, False, 0.0, **LIMITS)[0] == "flip"


def test_a_tensor_parallel_group_never_bridges_and_is_not_counted_on_to():
    """A TP group loads each range across its ranks and cannot serve a joined one: it waits for
    a partner that can bridge, and flips together with another that cannot."""
    partner = [OtherPeer(serving=(4, 8), loading=(0, 4), loaded=True)]
    assert flip_decision((0, 4), (4, 8), partner, 6.0, **LIMITS, can_bridge=False)[0] == "wait"
    assert flip_decision((0, 4), (4, 8), [OtherPeer(serving=(0, 8))], 0.0, **LIMITS, can_bridge=False)[0] == "flip"
    group = [OtherPeer(serving=(4, 8), loading=(0, 4), loaded=True, tp=2)]
    step, why = flip_decision((0, 4), (4, 8), group, 6.0, **LIMITS, can_bridge=False)
    assert step == "flip" and "together" in why
    assert flip_decision((0, 4), (4, 8), group, 6.0, **LIMITS)[0] == "bridge"
