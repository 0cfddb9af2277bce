"""What one push may count for: clipping against the other learners' latest pushes."""

import math

import pytest

from diloco.syncer.core.bounds import (ANCHOR_DISTANCE_RATIO, ANCHOR_VERSION_SLACK, FALLBACK_PERIOD_S, FALLBACK_RATIO,
                                       FLOOR_RATIO, LEARNERS_REMEMBERED, STALE_INTERVALS, STALE_MIN_S, AnchorOffer,
                                       Influence, Push, choose_anchor, gate)


def norm_never_needed():
    """A fragment of norm 1: its floor (``FLOOR_RATIO``) is below every reference here."""
    return 1.0


def judged(influence: Influence) -> Influence:
    """Every learner on record agrees with a reference that others turned: directions are
    judged (``Bound.unvouched`` false), so only the norm bounds clip."""
    for learner in influence.latest:
        influence.agreed(learner, 0.5)
    influence.turned(["R1", "R2"])
    return influence


def history(*pushes: Push) -> Influence:
    influence = Influence()
    for push in pushes:
        influence.record([push])
    return judged(influence)


def test_with_no_other_learner_on_record_a_delta_is_held_to_the_fragment_norm_per_period():
    influence = Influence()
    (bound,) = influence.bounds([Push("L0", 5.0, 100.0, 0.0)], 3.0, lambda: 8.0)
    assert bound.clip == pytest.approx(FALLBACK_RATIO * 8.0 / 5.0)
    assert bound.weight_cap == math.inf
    (small,) = influence.bounds([Push("L0", 0.5, 100.0, 0.0)], 3.0, lambda: 8.0)
    assert small.clip == 1.0
    # A fragment of norm under 1 is taken as 1: a zero-initialised fragment still trains.
    (zero,) = influence.bounds([Push("L0", 0.2, 100.0, 0.0)], 3.0, lambda: 0.0)
    assert zero.clip == 1.0
    # Alone, pushing again soon after the fragment's last merge: the rest of the period.
    influence.record([Push("L0", 2.0, 100.0, 0.0)])
    (soon,) = influence.bounds([Push("L0", 2.0, 100.0, FALLBACK_PERIOD_S / 4)], 3.0, lambda: 8.0)
    assert soon.clip == pytest.approx(FALLBACK_RATIO * 8.0 / 4 / 2.0)
    (later,) = influence.bounds([Push("L0", 2.0, 100.0, 2 * FALLBACK_PERIOD_S)], 3.0, lambda: 8.0)
    assert later.clip == 1.0
    # Its own earlier pushes do not vouch for a learner.
    (own,) = history(Push("L0", 100.0, 1.0, 0.0)).bounds([Push("L0", 5.0, 1.0, 10.0)], 3.0, lambda: 8.0)
    assert own.clip == pytest.approx(FALLBACK_RATIO * 8.0 / 5.0)


def test_a_learner_alone_in_the_run_is_held_per_push_not_per_time():
    """The only member of a run has nothing to be compared with: a per-time bound would only
    throttle fast hardware. Its pushes are held to ``FALLBACK_RATIO`` x the fragment's norm
    each, however soon they come; with other members (about to push) the per-time fallback."""
    influence = history(Push("L0", 2.0, 100.0, 0.0))
    soon = [Push("L0", 1.0, 100.0, FALLBACK_PERIOD_S / 100)]
    (alone,) = influence.bounds(soon, 3.0, lambda: 8.0, members=frozenset({"L0"}))
    assert alone.clip == 1.0
    (big,) = influence.bounds([Push("L0", 4.0, 100.0, 0.05)], 3.0, lambda: 8.0, members=frozenset({"L0"}))
    assert big.clip == pytest.approx(FALLBACK_RATIO * 8.0 / 4.0)
    (waiting,) = influence.bounds(soon, 3.0, lambda: 8.0, members=frozenset({"L0", "L1"}))
    assert waiting.clip == pytest.approx(FALLBACK_RATIO * 8.0 / 100)
    (unknown,) = influence.bounds(soon, 3.0, lambda: 8.0)
    assert unknown.clip == waiting.clip


def test_a_peer_pushing_zeros_or_crumbs_cannot_clip_the_others_below_the_floor():
    for crumb in (0.0, 1e-4):
        influence = history(Push("L1", crumb, 10.0, 0.0))
        (bound,) = influence.bounds([Push("L0", 3.0, 10.0, 0.5)], 3.0, lambda: 8.0)
        assert bound.clip == pytest.approx(3.0 * FLOOR_RATIO * 8.0 / 3.0)
        (honest,) = influence.bounds([Push("L0", 0.048 * 8.0, 10.0, 0.5)], 3.0, lambda: 8.0)
        assert honest.clip == 1.0  # the median honest delta passes untouched


def test_a_record_not_refreshed_for_long_is_no_reference():
    influence = Influence()
    for t in (0.0, 1.0, 2.0):  # L0 and L1 push every second
        influence.record([Push("L0", 1.0, 10.0, t), Push("L1", 0.1, 10.0, t)])
    judged(influence)
    stale_s = max(STALE_MIN_S, STALE_INTERVALS * 1.0)
    (fresh,) = influence.bounds([Push("L0", 1.0, 10.0, 2.0 + stale_s - 1)], 3.0, lambda: 1.0)
    assert fresh.clip == pytest.approx(0.3)  # L1's 0.1 still bounds it
    # L1 stopped pushing: long after, L0 is alone on record (a member, L1 still listed).
    (later,) = influence.bounds([Push("L0", 1.0, 10.0, 2.0 + stale_s + 1)], 3.0, lambda: 1.0,
                                members=frozenset({"L0", "L1"}))
    assert later.clip == pytest.approx(FALLBACK_RATIO)


def test_a_delta_is_clipped_to_the_multiple_of_the_other_learners_median():
    influence = history(Push("L0", 1.0, 10.0, 0.0), Push("L1", 2.0, 10.0, 0.0), Push("L2", 100.0, 10.0, 0.0))
    (bound,) = influence.bounds([Push("L3", 30.0, 10.0, 1.0)], 3.0, norm_never_needed)
    assert bound.clip == pytest.approx(3.0 * 2.0 / 30.0)  # median of 1, 2, 100 is 2: the outlier moves it one rank
    (honest,) = influence.bounds([Push("L3", 5.9, 10.0, 1.0)], 3.0, norm_never_needed)
    assert honest.clip == 1.0
    # Of an even count the lower middle: one learner of two cannot raise the other's bound.
    two = history(Push("L0", 1.0, 10.0, 0.0), Push("L2", 1000.0, 10.0, 0.0))
    (bound,) = two.bounds([Push("L3", 30.0, 10.0, 1.0)], 3.0, norm_never_needed)
    assert bound.clip == pytest.approx(3.0 / 30.0)


def test_pushing_more_often_than_the_others_buys_no_more_movement():
    """The bound shrinks with the time since the learner's own previous merged push, against
    the others' typical interval: movement per unit of time is bounded, not per push."""
    influence = Influence()
    for t in (0.0, 2.0, 4.0):  # L0 and L1 push every 2 s with norm 1
        influence.record([Push("L0", 1.0, 10.0, t), Push("L1", 1.0, 10.0, t + 0.1)])
    influence.record([Push("L2", 1.0, 10.0, 4.0)])
    judged(influence)
    (flood,) = influence.bounds([Push("L2", 3.0, 10.0, 4.2)], 3.0, norm_never_needed)
    assert flood.clip == pytest.approx(3.0 * (0.2 / 2.0) / 3.0)
    (later,) = influence.bounds([Push("L2", 3.0, 10.0, 9.0)], 3.0, norm_never_needed)
    assert later.clip == 1.0  # a slow learner is not bounded by more than the multiple
    # A learner's first push has no interval: the plain bound.
    (first,) = influence.bounds([Push("L3", 3.0, 10.0, 4.2)], 3.0, norm_never_needed)
    assert first.clip == 1.0


def test_a_weight_is_capped_so_that_its_tokens_count_at_most_the_multiple_of_the_others():
    influence = history(Push("L0", 1.0, 100.0, 0.0), Push("L1", 1.0, 400.0, 0.0), Push("L2", 1.0, 1e24, 0.0))
    (bound,) = influence.bounds([Push("L3", 1.0, 1e24, 1.0)], 3.0, norm_never_needed)
    assert bound.weight_cap == pytest.approx(9 * 400.0)


def test_the_other_pushes_of_the_same_round_are_the_others_latest():
    influence = history(Push("L0", 100.0, 1e6, 0.0), Push("L1", 100.0, 1e6, 0.0))
    round_ = [Push("L0", 1.0, 10.0, 5.0), Push("L1", 1.0, 10.0, 5.0), Push("L2", 50.0, 1e9, 5.0)]
    b0, b1, b2 = influence.bounds(round_, 3.0, norm_never_needed)
    assert b2.clip == pytest.approx(3.0 / 50.0) and b2.weight_cap == pytest.approx(90.0)
    assert b0.clip == 1.0 and b1.clip == 1.0
    # Bounds read the reference; only record changes it.
    assert influence.latest["L0"].norm == 100.0


def test_the_reference_keeps_raw_values_so_honest_growth_is_not_ratcheted_down():
    """A run's first full sync period makes deltas ~20x its first pushes': clipped values
    stored as the reference would clip every honest push after that one."""
    influence = history(Push("L0", 0.05, 10.0, 0.0), Push("L1", 0.05, 10.0, 0.0))
    round_ = [Push("L2", 1.0, 10.0, 1.0)]
    (first,) = influence.bounds(round_, 3.0, norm_never_needed)
    assert first.clip < 1.0
    influence.record(round_)
    influence.record([Push("L0", 1.1, 10.0, 1.1)])
    (second,) = influence.bounds([Push("L1", 1.2, 10.0, 1.2)], 3.0, norm_never_needed)
    assert second.clip == 1.0


def test_the_reference_remembers_the_newest_learners_and_forgets_a_gone_one():
    influence = Influence()
    for i in range(LEARNERS_REMEMBERED + 5):
        influence.record([Push(f"L{i}", 1.0, 1.0, float(i))])
    assert len(influence.latest) == LEARNERS_REMEMBERED
    assert "L0" not in influence.latest and f"L{LEARNERS_REMEMBERED + 4}" in influence.latest
    influence.forget("L10")
    assert "L10" not in influence.latest
    # A learner pushing again moves to the newest end.
    influence.record([Push("L5", 2.0, 1.0, 100.0)])
    assert next(reversed(influence.latest)) == "L5" and influence.latest["L5"].interval == pytest.approx(95.0)


def test_the_gate_counts_a_push_by_how_its_direction_agrees_with_the_others():
    assert gate(0.30, 0.40) == 1.0 and gate(0.20, 0.40) == 1.0  # at m / 2 and above: whole
    assert gate(0.15, 0.40) == pytest.approx(0.5)
    assert gate(0.10, 0.40) == 0.0 and gate(-0.5, 0.40) == 0.0  # at m / 4 and below: nothing
    # Nothing to compare with, or others that do not agree with the reference themselves.
    assert gate(None, 0.4) == gate(0.0, None) == gate(-1.0, 0.0) == gate(-1.0, -0.2) == 1.0


def test_a_push_whose_direction_nothing_judges_shares_the_fragments_fallback():
    """Others on record but no agreement measured yet (a fragment's start), an agreement not
    above 0, or a reference only the pusher turned: the gate lets the push through, so its
    norm is held to ``FALLBACK_RATIO`` x the fragment's norm per ``FALLBACK_PERIOD_S``
    since the last such push, shared by those of one round."""
    influence = Influence()
    influence.record([Push("L0", 1.0, 10.0, 0.0), Push("L1", 1.0, 10.0, 0.0)])
    (first,) = influence.bounds([Push("L2", 3.0, 10.0, 1.0)], 3.0, lambda: 8.0)
    assert first.unvouched and first.agreement is None
    assert first.clip == pytest.approx(FALLBACK_RATIO * 8.0 / 3.0)  # none before it: a whole period
    influence.record([Push("L2", 3.0, 10.0, 1.0)], unvouched={"L2"})
    assert influence.unvouched_at == 1.0
    soon = 1.0 + FALLBACK_PERIOD_S / 8
    (one,) = influence.bounds([Push("L0", 1.0, 10.0, soon)], 3.0, lambda: 8.0)
    assert one.clip == pytest.approx(FALLBACK_RATIO * 8.0 / 8)
    both = influence.bounds([Push("L0", 1.0, 10.0, soon), Push("L1", 1.0, 10.0, soon)], 3.0, lambda: 8.0)
    assert [b.clip for b in both] == pytest.approx([FALLBACK_RATIO * 8.0 / 8 / 2] * 2)
    # The others turn away from the reference: still nothing judges the direction.
    for learner in ("L0", "L1", "L2"):
        influence.agreed(learner, -0.3)
    influence.turned(["L0", "L1"])
    (against,) = influence.bounds([Push("L3", 1.0, 10.0, soon)], 3.0, lambda: 8.0)
    assert against.unvouched and against.agreement == -0.3 and against.clip < 1.0
    # They agree with it: judged, only the norm bound.
    for learner in ("L0", "L1", "L2"):
        influence.agreed(learner, 0.4)
    (judged_push,) = influence.bounds([Push("L3", 1.0, 10.0, soon)], 3.0, lambda: 8.0)
    assert not judged_push.unvouched and judged_push.clip == 1.0


def test_a_learner_gated_out_does_not_leave_the_others_unjudged():
    """Of two others, the lower middle is the lower: a negating learner's cosine (gated out,
    counted 0) would make every honest push's agreement negative, and nothing would judge
    them again. Whether a push is judged reads the others whose latest push counted; the
    gate reads them all (there the gated-out learner's low cosine lets the honest ones
    vouch for each other: left out of it, a learner gated once by chance had no say, and
    an attacker's pushes became the only voice: docs/results/trust/direction-bootstrap/)."""
    influence = history(Push("L0", 1.0, 1.0, 0.0), Push("L1", 1.0, 1.0, 0.0))
    influence.agreed("L0", -0.9, counted=0.0)
    influence.agreed("L1", 0.4)
    (bound,) = influence.bounds([Push("L2", 1.0, 1.0, 1.0)], 3.0, norm_never_needed)
    assert bound.agreement == -0.9 and not bound.unvouched
    influence.agreed("L0", -0.9, counted=0.5)  # counted in part: it has its say again
    (bound,) = influence.bounds([Push("L2", 1.0, 1.0, 1.0)], 3.0, norm_never_needed)
    assert bound.agreement == -0.9 and bound.unvouched
    influence.agreed("L1", 0.4, counted=0.0)
    influence.agreed("L0", 0.3, counted=0.0)  # no other counted: nothing judges it
    (bound,) = influence.bounds([Push("L2", 1.0, 1.0, 1.0)], 3.0, norm_never_needed)
    assert bound.agreement == 0.3 and bound.unvouched


def test_a_reference_turned_by_one_learner_alone_does_not_vouch_for_it():
    influence = Influence()
    assert not influence.vouches("L0")
    influence.turned(["L0"])
    assert not influence.vouches("L0") and influence.vouches("L1")
    influence.turned(["L1", "L2", "L3"])
    assert influence.turned_by == {"L0", "L1"}  # two names tell the cases apart
    assert all(influence.vouches(learner) for learner in ("L0", "L1", "L9"))
    alone = Influence()
    alone.record([Push("L5", 1.0, 10.0, 0.0), Push("L6", 1.0, 10.0, 0.0)])
    alone.agreed("L5", 0.5)
    alone.agreed("L6", 0.5)
    alone.turned(["L7"])
    (own,) = alone.bounds([Push("L7", 1.0, 10.0, 1.0)], 3.0, lambda: 8.0)
    (other,) = alone.bounds([Push("L8", 1.0, 10.0, 1.0)], 3.0, lambda: 8.0)
    assert own.unvouched and not other.unvouched


def test_a_push_is_gated_against_the_median_of_the_other_learners_agreement():
    influence = history(Push("L0", 1.0, 1.0, 0.0), Push("L1", 1.0, 1.0, 0.0), Push("L2", 1.0, 1.0, 0.0))
    for learner, cos in (("L0", 0.3), ("L1", 0.5), ("L2", 0.05)):
        influence.agreed(learner, cos)
    influence.agreed("L9", 0.9)  # no push on record: nothing to attach it to
    assert "L9" not in influence.latest
    (bound,) = influence.bounds([Push("L3", 1.0, 1.0, 1.0)], 3.0, norm_never_needed)
    assert bound.agreement == 0.3
    (own,) = influence.bounds([Push("L2", 1.0, 1.0, 1.0)], 3.0, norm_never_needed)
    assert own.agreement == 0.3  # of L0 and L1: the lower middle
    # A learner's next push keeps its last agreement until its round measures the new one.
    influence.record([Push("L0", 1.0, 1.0, 2.0)])
    assert influence.latest["L0"].cos == 0.3


def test_a_learner_counts_for_nothing_when_its_latest_push_was_merged_at_nothing():
    """``negligible`` looks at a push as merged (its raw norm x the factor its round gave it),
    and a new push counts in full until its own round has judged it."""
    influence = history(Push("L0", 1.0, 1.0, 0.0), Push("L1", 2.9, 1.0, 0.0), Push("L2", 0.001, 1.0, 0.0))
    assert influence.negligible(0.01) == {"L2"}  # crumbs
    influence.agreed("L1", -0.9, 0.0)  # gated out: a large raw push that moved nothing
    influence.agreed("L0", None, 0.5)  # no cosine measured: the last one stays
    assert influence.negligible(0.01) == {"L1", "L2"} and influence.latest["L1"].cos == -0.9
    influence.record([Push("L1", 1.0, 1.0, 1.0)])
    assert influence.negligible(0.01) == {"L2"} and influence.latest["L1"].counted == 1.0
    # Snapshots carry it; one written before it existed (six fields) counts in full.
    state = influence.to_state(now=2.0)
    assert Influence.from_state(state, now=7.0).latest["L0"].counted == 0.5
    state["latest"] = [row[:6] for row in state["latest"]]
    assert {s.counted for s in Influence.from_state(state, now=7.0).latest.values()} == {1.0}


def anchors(*offers):
    return [AnchorOffer(*o) for o in offers]


def test_an_anchor_is_the_newest_that_agrees_with_the_others_versions_and_norms():
    assert choose_anchor([]) is None
    assert choose_anchor(anchors((10**6, 4816.0))) == 0  # alone: nothing to compare with
    assert choose_anchor(anchors((9, 4.8), (12, 4.9))) == 1  # the newer of two honest anchors
    # One learner's anchor at version +1e6, or with values x1000, loses to the honest ones.
    assert choose_anchor(anchors((100, 4.8), (10**6, 4.8), (101, 4.9))) == 2
    assert choose_anchor(anchors((100, 4.8), (101, 4816.0))) == 0
    assert choose_anchor(anchors((100, 4.8), (101, 4.8), (101, 4816.0))) == 1
    assert choose_anchor(anchors((100, 4.8), (100 + ANCHOR_VERSION_SLACK, 4.8))) == 1
    assert choose_anchor(anchors((100, 4.8), (101 + ANCHOR_VERSION_SLACK, 4.8))) == 0
    # Same version: the nearest the reference values.
    assert choose_anchor(anchors((100, 4.8, 0.2), (100, 4.8, 0.1), (100, 4.7, 0.3))) == 1


def test_an_anchor_in_another_direction_loses_though_its_norm_and_version_agree():
    # Negated values keep the norm: 2 x the norm from the median of the others' values.
    assert choose_anchor(anchors((100, 4.8, 0.05), (101, 4.8, 0.04), (102, 4.8, 9.6))) == 1
    # The limit is ANCHOR_DISTANCE_RATIO x the lower median distance.
    assert choose_anchor(anchors((100, 4.8, 0.1), (101, 4.8, 0.1), (102, 4.8, 0.1 * ANCHOR_DISTANCE_RATIO))) == 2
    assert choose_anchor(anchors((100, 4.8, 0.1), (101, 4.8, 0.1), (102, 4.8, 0.11 * ANCHOR_DISTANCE_RATIO))) == 1
    # Two offers, one negated, compared with their median (their mean): nothing tells them
    # apart, the newer wins; against a snapshot's values the negated one is far and points away.
    assert choose_anchor(anchors((100, 4.8, 4.8), (101, 4.8, 4.8))) == 1
    assert choose_anchor(anchors((100, 4.8, 0.5), (101, 4.8, 9.1)), snapshot_norm=4.6) == 0
    # Alone against a snapshot: taken only if it points the snapshot's way (cosine > 0).
    assert choose_anchor(anchors((101, 4.8, 9.1)), snapshot_norm=4.6) is None
    assert choose_anchor(anchors((101, 4.8, 0.5)), snapshot_norm=4.6) == 0
    assert choose_anchor(anchors((101, 4.8, 6.6)), snapshot_norm=4.6) == 0  # cosine 0.01: not against it
