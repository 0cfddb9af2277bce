"""A coordinator that did not run for a while (its host stalled: a VM pause, SIGSTOP, a
laptop's sleep) moves every lease on by that while instead of failing every learner at
once; a learner that stays silent while the coordinator runs still fails one lease later."""

from diloco.coordinator.core.membership import ACTIVE, FAILED, HeartbeatStats
from diloco.coordinator.core.stall import STALL_SLACK_S, STALL_TICK_S, StallWatch
from tests.unit.test_coordinator_membership import OPEN, membership


def test_the_watch_reports_a_gap_beyond_a_tick_once():
    watch = StallWatch(last_s=100.0)
    assert watch.stalled(100.0 + STALL_TICK_S) == 0.0  # a tick on time
    assert watch.stalled(100.5 + STALL_TICK_S + STALL_SLACK_S) == 0.0  # late, within the slack
    start = watch.last_s
    assert watch.stalled(start + 15.0) == 15.0 - STALL_TICK_S  # a stall: the gap beyond the tick
    assert watch.stalled(start + 15.0) == 0.0  # reported once
    assert watch.stalled(start + 15.1) == 0.0
    assert watch.total_s == 15.0 - STALL_TICK_S
    assert watch.stalled(start) == 0.0 and watch.last_s == start + 15.1  # a clock going back is no stall


def test_a_pause_moves_live_leases_drains_and_joins_on_by_the_stall():
    # Nobody is heard after the stall either: the hold of a coordinator that hears nobody
    # (test_coordinator_isolation.py) is off, so that the lease is what is seen.
    m = membership(lease_s=5.0, drain_timeout_s=30.0, join_timeout_s=60.0, isolation_hold_leases=0.0)
    m.join("", "", "", "", now=10.0, credential=OPEN)
    m.heartbeat("L0", HeartbeatStats(tokens=64, inner_steps=1), now=12.0)  # lease until 17
    m.join("", "", "", "", now=12.0, credential=OPEN)
    m.drain(["L1"], now=12.0)  # drain deadline 42
    m.add_launch("x1", "default", now=12.0)  # join deadline 72
    m.pause(15.0, now=28.0)  # the coordinator did not run from 13 to 28
    m.expire(28.0)
    assert m.learner("L0").state == ACTIVE and m.learner("L0").heartbeat_s == 27.0
    assert m.learner("L1").drain_deadline_s == 57.0
    assert m.launches["x1"].launched_s == 27.0
    m.expire(31.9)
    assert m.learner("L0").state == ACTIVE
    m.expire(32.0)  # silent since: one lease after it was last heard of while the coordinator ran
    assert m.learner("L0").state == FAILED


def test_a_pause_never_revives_a_lease_that_had_run_out_before_the_stall():
    m = membership(lease_s=5.0)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.pause(3.0, now=20.0)  # heard of at 0, lease to 5; the stall was later
    assert m.learner("L0").heartbeat_s == 3.0
    m.expire(20.0)
    assert m.learner("L0").state == FAILED
