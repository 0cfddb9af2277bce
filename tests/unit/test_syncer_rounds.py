import pytest

from diloco.syncer.config import RoundConfig
from diloco.syncer.core.rounds import Close, RoundView, Timings, Wait, decide_round


def view(pushed, live, quorum_at=None, grace=0.0):
    return RoundView(frozenset(pushed), frozenset(live), opened_at=0.0, quorum_at=quorum_at, grace_s=grace)


def test_waits_without_pushes():
    d = decide_round(view([], ["a", "b"]), 1.0, RoundConfig(quorum=1))
    assert isinstance(d, Wait) and d.deadline is None and "no pushes" in d.reason


def test_waits_below_quorum_with_reason():
    d = decide_round(view(["a"], ["a", "b", "c"]), 1.0, RoundConfig(quorum=2))
    assert isinstance(d, Wait)
    assert d.reason == "1/2 pushes for quorum (3 live)"


def test_grace_window_then_close():
    cfg = RoundConfig(quorum=1)
    v = view(["a"], ["a", "b"], quorum_at=10.0, grace=1.5)
    early = decide_round(v, 10.4, cfg)
    assert isinstance(early, Wait) and early.deadline == pytest.approx(11.5)
    assert "grace ends in 1.10 s" in early.reason
    late = decide_round(v, 11.5, cfg)
    assert isinstance(late, Close) and late.grace_s == pytest.approx(1.5)


def test_early_close_when_every_live_learner_pushed():
    d = decide_round(view(["a", "b"], ["a", "b"], quorum_at=10.0, grace=5.0), 10.1, RoundConfig(quorum=1))
    assert isinstance(d, Close) and "all 2 live learners pushed" in d.reason


def test_never_stalls_when_fewer_live_learners_than_quorum():
    d = decide_round(view(["a"], ["a"]), 1.0, RoundConfig(quorum=3))
    assert isinstance(d, Close)


def test_no_grace_closes_at_quorum():
    d = decide_round(view(["a"], ["a", "b"], quorum_at=1.0, grace=0.0), 1.0, RoundConfig(quorum=1))
    assert isinstance(d, Close) and d.grace_s == 0.0


def test_adaptive_grace_formula_and_clamp():
    t = Timings(step_time_s=1.0, quorum_time_s=0.2, sync_time_s=0.3)
    cfg = RoundConfig(grace_mode="auto", grace_gamma=0.5, overlap_steps=2, grace_max_s=5.0)
    assert t.grace_s(cfg) == pytest.approx(0.5 * (2 * 1.0 - 0.5))
    assert t.grace_s(RoundConfig(grace_mode="auto", grace_gamma=0.5, overlap_steps=2, grace_max_s=0.1)) == pytest.approx(0.1)
    slow_sync = Timings(step_time_s=0.1, quorum_time_s=1.0, sync_time_s=1.0)
    assert slow_sync.grace_s(cfg) == 0.0
    assert Timings().grace_s(cfg) == 0.0
    assert t.grace_s(RoundConfig(grace_mode="off")) == 0.0
    assert t.grace_s(RoundConfig(grace_mode="fixed", grace_fixed_s=0.7)) == 0.7


def test_ema():
    t = Timings()
    t.observe("step_time_s", 1.0, 0.5)
    t.observe("step_time_s", 3.0, 0.5)
    assert t.step_time_s == pytest.approx(2.0)


@pytest.mark.parametrize(
    "kwargs",
    [dict(quorum=0), dict(grace_mode="maybe"), dict(grace_gamma=1.0), dict(grace_max_s=-1), dict(ema_factor=0)],
)
def test_bad_config(kwargs):
    from diloco.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        RoundConfig(**kwargs)


def test_every_decision_says_why_exactly():
    cfg = RoundConfig(quorum=1)
    assert decide_round(view([], ["a"]), 1.0, cfg).reason == "no pushes yet"
    assert decide_round(view(["a"], ["a", "b"], quorum_at=1.0), 1.0, cfg).reason == "quorum 1/2 reached, no grace"
    expired = decide_round(view(["a"], ["a", "b"], quorum_at=1.0, grace=0.25), 1.3, cfg)
    assert expired == Close("quorum 1/2 + grace 0.25 s expired", 0.25)


def test_a_grace_under_one_second_is_still_waited():
    d = decide_round(view(["a"], ["a", "b"], quorum_at=1.0, grace=0.5), 1.2, RoundConfig(quorum=1))
    assert isinstance(d, Wait) and d.deadline == pytest.approx(1.5)


def test_all_live_pushed_reports_the_grace_spent_since_the_quorum():
    cfg = RoundConfig(quorum=1)
    d = decide_round(view(["a", "b"], ["a", "b"], quorum_at=10.0, grace=5.0), 10.25, cfg)
    assert d.grace_s == pytest.approx(0.25)
    # No quorum time yet (both arrived at once): nothing was spent.
    assert decide_round(view(["a", "b"], ["a", "b"]), 3.0, cfg).grace_s == 0.0


def test_quorum_counts_only_live_learners_pushes():
    # "x" pushed and then was declared failed: it no longer counts toward K = 2.
    d = decide_round(view(["a", "x"], ["a", "b", "c"]), 1.0, RoundConfig(quorum=2))
    assert isinstance(d, Wait) and d.reason == "1/2 pushes for quorum (3 live)"
    # Without a live set (no membership yet) every push counts.
    d = decide_round(view(["a", "x"], []), 1.0, RoundConfig(quorum=2))
    assert isinstance(d, Close) and d.reason == "quorum 2/0 reached, no grace"


def test_the_window_starts_at_the_quorum_not_at_the_decision():
    cfg = RoundConfig(quorum=1)
    # Quorum reached at 10; deciding at 12 with a 1.5 s grace: it has expired.
    assert isinstance(decide_round(view(["a"], ["a", "b"], quorum_at=10.0, grace=1.5), 12.0, cfg), Close)
    # Quorum not stamped yet: the window starts now.
    d = decide_round(view(["a"], ["a", "b"], grace=1.5), 12.0, cfg)
    assert isinstance(d, Wait) and d.deadline == pytest.approx(13.5)


def test_adaptive_grace_with_only_some_timings_observed():
    cfg = RoundConfig(grace_mode="auto", grace_gamma=0.5, overlap_steps=2, grace_max_s=5.0)
    assert Timings(step_time_s=1.0).grace_s(cfg) == pytest.approx(1.0)
    assert Timings(step_time_s=1.0, sync_time_s=0.4).grace_s(cfg) == pytest.approx(0.8)
    assert Timings(step_time_s=1.0, quorum_time_s=0.4).grace_s(cfg) == pytest.approx(0.8)


def test_a_draining_learners_push_counts_but_no_round_waits_for_a_draining_learner():
    cfg = RoundConfig(quorum=2)
    drain = dict(opened_at=0.0, quorum_at=None, grace_s=5.0)
    # a (live) and d (draining) pushed: quorum 2 reached; b is live and still awaited (grace).
    d = decide_round(RoundView(frozenset("ad"), frozenset("ab"), draining=frozenset("d"), **drain), 1.0, cfg)
    assert isinstance(d, Wait) and d.reason == "2/2 learners; grace ends in 5.00 s"
    # Every live learner pushed: d, draining and silent, is not waited for.
    d = decide_round(RoundView(frozenset("a"), frozenset("a"), draining=frozenset("d"), **drain), 1.0, cfg)
    assert isinstance(d, Close) and d.reason == "all 1 live learners pushed"
    # Everyone is draining: the pushes that came close the round at once, whatever K and grace.
    d = decide_round(RoundView(frozenset("d"), frozenset(), draining=frozenset("de"), **drain), 1.0, cfg)
    assert isinstance(d, Close) and d.reason == "every learner is draining (2): none left to wait for"
    # A push from a learner that is neither live nor draining does not count.
    d = decide_round(RoundView(frozenset("x"), frozenset("ab"), draining=frozenset("d"), **drain), 1.0, cfg)
    assert isinstance(d, Wait) and d.reason == "0/2 pushes for quorum (2 live)"
