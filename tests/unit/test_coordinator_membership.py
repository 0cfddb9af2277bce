"""Membership and leases with a fake clock: time moves by assignment, never by sleeping."""

from pathlib import Path

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.core.membership import (
    FAILED_LAUNCHES_KEPT,
    ACTIVE,
    DRAINING,
    FAILED,
    JOINING,
    LEFT,
    Alive,
    Expired,
    HeartbeatStats,
    Membership,
    decide_lease,
)
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

PLAN = "ab" * 32


def membership(**cfg) -> Membership:
    cfg.setdefault("pools", ("default", "spot"))
    return Membership(CoordinatorConfig(data_dir=Path("/nonexistent"), **cfg), PLAN)


def kinds(m: Membership) -> list[tuple[str, str]]:
    return [(c.kind, c.learner.id if c.learner else c.stop_launch) for c in m.take_changes()]


def test_join_then_first_heartbeat_makes_a_learner_active():
    m = membership()
    a = m.join("", "host:1", "", PLAN, now=100.0)
    b = m.join("spot", "host:2", "", "", now=100.5)
    assert (a.id, a.state, a.pool) == ("L0", JOINING, "default")
    assert (b.id, b.pool) == ("L1", "spot")
    m.heartbeat("L0", HeartbeatStats(tokens=64, inner_steps=2, version_lag=1), now=101.0)
    assert m.learner("L0").state == ACTIVE and m.learner("L0").tokens == 64
    assert kinds(m) == [("joined", "L0"), ("joined", "L1"), ("active", "L0")]
    m.heartbeat("L0", HeartbeatStats(), now=101.5)
    assert kinds(m) == []  # already active: nothing to announce


def test_lease_decision_and_expiry_with_a_fake_clock():
    m = membership(lease_s=5.0)
    learner = m.join("", "", "", "", now=10.0)
    assert decide_lease(learner, 14.9, 5.0) == Alive(15.0, "lease ends in 0.1 s")
    assert isinstance(decide_lease(learner, 15.0, 5.0), Expired)
    assert m.next_deadline() == 15.0
    m.heartbeat("L0", HeartbeatStats(), now=14.0)  # renews until 19.0
    m.expire(18.9)
    assert m.learner("L0").state == ACTIVE
    m.take_changes()
    m.expire(19.0)
    assert m.learner("L0").state == FAILED
    (change,) = m.take_changes()
    assert change.kind == "failed" and change.reason == "lease expired: no heartbeat for 5.0 s (lease 5 s)"
    assert m.next_deadline() is None


def test_heartbeat_after_the_lease_ran_out_fails_the_learner_and_refuses():
    m = membership(lease_s=5.0)
    m.join("", "", "", "", now=0.0)
    with pytest.raises(FailedPrecondition, match="L0 was marked failed .lease expired.*join again"):
        m.heartbeat("L0", HeartbeatStats(), now=7.0)
    # The failure is still announced although the call raised.
    assert kinds(m) == [("joined", "L0"), ("failed", "L0")]


def test_unknown_learner_and_departed_learner():
    m = membership()
    with pytest.raises(NotFound, match="unknown learner 'L7'"):
        m.heartbeat("L7", HeartbeatStats(), now=0.0)
    m.join("", "", "", "", now=0.0)
    m.leave("L0", "done", now=1.0)
    m.leave("L0", "again", now=1.5)  # idempotent
    assert m.learner("L0").state == LEFT and m.learner("L0").reason == "done"
    with pytest.raises(FailedPrecondition, match="L0 has left .done.; join again"):
        m.heartbeat("L0", HeartbeatStats(), now=2.0)
    assert kinds(m) == [("joined", "L0"), ("left", "L0")]


def test_plan_hash_must_match():
    with pytest.raises(FailedPrecondition, match="fragment plan"):
        membership().join("", "", "", "cd" * 32, now=0.0)


def test_launch_requests_are_checked_and_hold_slots_until_join():
    m = membership(max_learners=3, join_timeout_s=60.0, lease_s=1000.0, credential_lifetime_s=2000.0)
    with pytest.raises(InvalidArgument, match="count must be >= 1"):
        m.check_launch(0, "")
    with pytest.raises(NotFound, match="unknown pool 'gpu'; pools: default, spot"):
        m.check_launch(1, "gpu")
    with pytest.raises(ResourceExhausted, match="cannot add 4 learners: 0 of the cap of 3"):
        m.check_launch(4, "")
    assert m.check_launch(2, "") == "default"
    m.add_launch("x1", "default", now=0.0)
    m.add_launch("x2", "default", now=0.0)
    m.join("", "", "", "", now=1.0)  # a learner started by hand takes the third slot
    assert m.occupied() == 3
    with pytest.raises(ResourceExhausted, match="cap of 3"):
        m.join("", "", "", "", now=1.0)
    learner = m.join("", "", "x1", "", now=2.0)  # a launched learner brings its own slot
    assert learner.launch_id == "x1" and m.occupied() == 3
    m.take_changes()
    m.expire(60.0)  # x2 never joined
    (change,) = m.take_changes()
    assert change.kind == "launch_ended" and change.stop_launch == "x2" and "did not join within 60 s" in change.reason
    assert m.occupied() == 2


def test_a_launched_process_that_ends():
    m = membership()
    m.add_launch("x1", "default", now=0.0)
    m.add_launch("x2", "default", now=0.0)
    m.join("", "", "x2", "", now=1.0)
    m.take_changes()
    m.launch_ended("x1", "exit code 2", now=2.0)  # before joining: frees its slot
    m.launch_ended("x2", "killed by SIGKILL", now=2.0)  # after: its learner fails now
    assert "x1" not in m.launches
    assert m.learner("L0").state == FAILED and m.learner("L0").reason == "process ended: killed by SIGKILL"
    assert [c.kind for c in m.take_changes()] == ["launch_ended", "failed"]


def test_select_for_removal():
    m = membership()
    for t in range(4):
        m.join("", "", "", "", now=float(t))
    assert [l.id for l in m.select([], 2)] == ["L3", "L2"]  # newest first
    assert [l.id for l in m.select(["L1", "L1"], 0)] == ["L1"]
    with pytest.raises(NotFound, match="L9"):
        m.select(["L9"], 0)
    with pytest.raises(InvalidArgument, match="not both"):
        m.select(["L1"], 1)
    with pytest.raises(InvalidArgument, match="count >= 1"):
        m.select([], 0)
    m.leave("L0", "", now=5.0)
    with pytest.raises(FailedPrecondition, match="already gone: L0"):
        m.select(["L0"], 0)
    with pytest.raises(FailedPrecondition, match="cannot remove 4 learners: 3 are live"):
        m.select([], 4)


def test_drain_then_leave_or_time_out():
    m = membership(drain_timeout_s=30.0, lease_s=100.0, credential_lifetime_s=200.0)
    m.add_launch("x0", "default", now=0.0)
    m.join("", "", "x0", "", now=0.0)
    m.join("", "", "", "", now=0.0)
    m.take_changes()
    m.drain(["L0", "L1"], now=1.0)
    assert m.learner("L0").state == DRAINING
    assert kinds(m) == [("draining", "L0"), ("draining", "L1")]
    m.leave("L1", "drained", now=2.0)
    m.expire(31.0)  # L0 never left
    assert m.learner("L0").state == LEFT and m.learner("L0").reason == "drain timed out after 30 s"
    changes = m.take_changes()
    assert [(c.kind, c.stop_launch) for c in changes] == [("left", ""), ("left", "x0")]


def test_state_round_trip_and_fresh_leases_after_a_restart():
    m = membership(lease_s=5.0)
    m.join("", "a", "", "", now=0.0)
    m.join("spot", "b", "", "", now=0.0)
    m.leave("L1", "bye", now=1.0)
    m.add_launch("x9", "spot", now=1.0)
    state = m.to_state()
    back = Membership.from_state(m.cfg, PLAN, state)
    assert back.to_state() == state
    back.renew_all(1000.0)  # the coordinator was down far longer than a lease
    back.expire(1004.0)
    assert back.learner("L0").state == JOINING
    assert back.join("", "", "", "", now=1000.0).id == "L2"  # ids are never reused
    back.reset("restored from snapshot 3", now=1001.0)
    assert [l.state for l in back.listing(include_gone=True)] == [LEFT, LEFT, LEFT]
    assert back.launches == {}


def test_corrupt_state_is_refused():
    with pytest.raises(InvalidArgument, match="corrupt coordinator state"):
        Membership.from_state(membership().cfg, PLAN, {"learners": [{"id": "L0", "state": "dancing"}]})


def test_a_leave_carries_the_learner_s_final_counts():
    """The last heartbeat can be a second old when a learner finishes: its Leave carries
    its final tokens and steps, so members (and the run's final table) match its summary.
    Counts never go down (a stale or hostile Leave cannot shrink them)."""
    m = membership()
    m.join("", "host:1", "", PLAN, now=100.0)
    m.join("", "host:2", "", PLAN, now=100.0)
    m.heartbeat("L0", HeartbeatStats(tokens=64, inner_steps=2), now=101.0)
    m.heartbeat("L1", HeartbeatStats(tokens=640, inner_steps=20), now=101.0)
    m.leave("L0", "finished", now=102.0, final=(1920, 60))
    m.leave("L1", "finished", now=102.0, final=(64, 2))
    assert (m.learner("L0").tokens, m.learner("L0").inner_steps) == (1920, 60)
    assert (m.learner("L1").tokens, m.learner("L1").inner_steps) == (640, 20)
    m.leave("L0", "again", now=103.0, final=(10**9, 10**9))  # already left: nothing changes
    assert m.learner("L0").tokens == 1920


def test_launches_that_never_join_are_remembered_with_why():
    m = membership(join_timeout_s=60.0)
    for launch_id in ("a", "b", "c"):
        m.add_launch(launch_id, "default", 0.0)
    m.launch_ended("a", "exit code 2: diloco: error: bad flag", 5.0)
    m.join("default", "host:1", "c", "", 6.0)
    m.expire(61.0)
    assert {x.launch_id: (x.pool, x.detail) for x in m.failed_launches.values()} == {
        "a": ("default", "ended before joining: exit code 2: diloco: error: bad flag"),
        "b": ("default", "did not join within 60 s"),
    }
    assert not m.launches
    for i in range(FAILED_LAUNCHES_KEPT):
        m.add_launch(f"x{i}", "spot", 100.0)
        m.launch_ended(f"x{i}", "killed by SIGKILL", 101.0)
    assert len(m.failed_launches) == FAILED_LAUNCHES_KEPT and "a" not in m.failed_launches  # the oldest go first
    assert list(m.failed_launches)[-1] == f"x{FAILED_LAUNCHES_KEPT - 1}"
