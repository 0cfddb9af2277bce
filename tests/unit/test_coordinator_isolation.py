"""A coordinator that hears from no learner while several are members suspects that it is
the one cut off (its own network, not theirs) and fails none of them for lease expiry, for
up to ``isolation_hold_s``; once one is heard again, every lease moves on by the silence,
so that a learner that really went away is still failed one lease after it was last heard
of. One learner silent while the others beat is failed on its lease, as before."""

import pytest

from diloco.coordinator.core.membership import ACTIVE, FAILED, UNHEARD_LEASES, HeartbeatStats
from diloco.errors import InvalidArgument
from tests.unit.test_coordinator_membership import OPEN, membership


def beating(m, ids, start, end, every=1.0, offset=0.2):
    """Heartbeats of ``ids`` from ``start`` to ``end`` (included), every ``every`` s, each
    ``offset`` after the one before it."""
    t = start
    while t <= end + 1e-9:
        for i, learner_id in enumerate(ids):
            m.heartbeat(learner_id, HeartbeatStats(tokens=int(t * 100)), now=t + i * offset)
        t += every


def three(**cfg):
    m = membership(lease_s=5.0, isolation_hold_leases=6.0, **cfg)
    for _ in range(3):
        m.join("", "", "", "", now=0.0, credential=OPEN)
    beating(m, ["L0", "L1", "L2"], 1.0, 10.0)  # last heard: L0 at 10.0, L1 10.2, L2 10.4
    m.take_changes()
    return m


def test_an_unheard_coordinator_holds_every_failure_and_moves_the_leases_on_when_it_hears_again():
    m = three()
    m.expire(15.0)  # L0's lease ran out, and nobody has been heard for 4.6 s
    assert [l.state for l in m.learners.values()] == [ACTIVE] * 3
    changes = m.take_changes()
    assert [(c.kind, c.learner) for c in changes] == [("unheard", None)]
    assert "no learner heard for 4.6 s" in changes[0].reason
    # No deadline in the past (the runtime's timer would spin): the next is the hold's end.
    assert m.next_deadline() == 10.4 + 30.0
    m.expire(19.9)
    assert all(l.state == ACTIVE for l in m.learners.values()) and m.take_changes() == []
    # L1 is heard again after 9.6 s of silence: every lease moves on by it.
    m.heartbeat("L1", HeartbeatStats(tokens=2000), now=20.0)
    changes = m.take_changes()
    assert [(c.kind, c.learner) for c in changes] == [("heard", None)]
    assert "after 9.6 s of silence" in changes[0].reason
    assert abs(m.learner("L0").heartbeat_s - 19.6) < 1e-9 and m.learner("L2").heartbeat_s == 20.0
    # L0 went away during the silence: failed one lease after it was last heard of.
    beating(m, ["L1", "L2"], 21.0, 24.0)
    m.expire(24.5)
    assert m.learner("L0").state == ACTIVE
    m.expire(24.6)
    assert m.learner("L0").state == FAILED and m.learner("L0").reason.startswith("lease expired")
    assert (m.learner("L1").state, m.learner("L2").state) == (ACTIVE, ACTIVE)


def test_the_hold_ends_after_isolation_hold_s_of_silence_and_the_silent_fail():
    m = three()
    m.expire(15.0)
    assert m.next_deadline() == 40.4
    m.expire(40.3)
    assert all(l.state == ACTIVE for l in m.learners.values())
    m.expire(40.4)  # heard of last at 10.4: 30 s of silence, a fleet that died together
    assert [l.state for l in m.learners.values()] == [FAILED] * 3
    assert [c.kind for c in m.take_changes()] == ["unheard", "failed", "failed", "failed"]


def test_one_learner_silent_while_the_others_beat_is_failed_on_its_lease():
    m = three()
    beating(m, ["L1", "L2"], 11.0, 14.0)  # L0 went silent at 10.0; the others are heard
    m.expire(14.9)
    assert m.learner("L0").state == ACTIVE
    m.expire(15.0)
    assert m.learner("L0").state == FAILED
    assert [c.kind for c in m.take_changes()] == ["failed"]


def test_a_lone_member_and_a_hold_of_0_fail_on_the_lease():
    lone = membership(lease_s=5.0, isolation_hold_leases=6.0)
    lone.join("", "", "", "", now=0.0, credential=OPEN)
    lone.heartbeat("L0", HeartbeatStats(), now=1.0)
    lone.expire(6.0)  # one member: its silence and the coordinator's cannot be told apart
    assert lone.learner("L0").state == FAILED
    off = membership(lease_s=5.0, isolation_hold_leases=0.0)
    for _ in range(2):
        off.join("", "", "", "", now=0.0, credential=OPEN)
    beating(off, ["L0", "L1"], 1.0, 10.0)
    off.expire(15.0)
    assert off.learner("L0").state == FAILED


def test_silence_shorter_than_three_quarters_of_a_lease_is_not_suspected():
    """Learners beat at most every half lease: a heartbeat late by up to a quarter of a
    lease is no silence of everyone's."""
    assert UNHEARD_LEASES * 8.0 == 6.0
    for last_heard, held in ((3.05, False), (2.95, True)):
        m = membership(lease_s=8.0, isolation_hold_leases=6.0)
        for _ in range(2):
            m.join("", "", "", "", now=0.0, credential=OPEN)
        m.heartbeat("L0", HeartbeatStats(), now=1.0)  # L0's last: its lease runs out at 9
        m.heartbeat("L1", HeartbeatStats(), now=last_heard)
        m.expire(9.0)  # L1 silent for 5.95 s (under 6), or 6.05 s
        assert m.learner("L0").state == (ACTIVE if held else FAILED), last_heard


def test_a_stall_of_the_coordinator_is_no_silence_of_the_learners():
    """The coordinator's own stall (``pause``) moves when it last heard on too: after it,
    the learners are not unheard."""
    m = three()
    m.pause(30.0, now=40.0)  # it did not run from 10.5 to 40
    m.expire(40.0)
    assert all(l.state == ACTIVE for l in m.learners.values()) and m.take_changes() == []
    assert m.heard_s == 40.0 and m.unheard(40.0) is False


def test_a_learner_whose_process_ended_cleanly_without_a_heard_leave_has_left():
    """A learner that finished its steps while its coordinator was cut off could not say
    Leave; its process ending with exit code 0 says it for it (no replacement for it), and
    any other end still fails it."""
    m = membership(lease_s=5.0)
    for launch in ("x0", "x1"):
        m.add_launch(launch, "default", now=0.0)
        m.join("", "", launch, "", now=0.0, credential=OPEN)
    m.take_changes()
    m.launch_ended("x0", "exit code 0", now=3.0, clean=True)
    m.launch_ended("x1", "exit code 1: Traceback", now=3.0)
    assert [(c.kind, c.learner.id, c.reason, c.stop_launch, c.gently) for c in m.take_changes()] == [
        ("left", "L0", "process ended cleanly (exit code 0); its Leave was not heard", "x0", False),
        ("failed", "L1", "process ended: exit code 1: Traceback", "x1", False),
    ]


def test_members_that_ended_during_the_silence_still_count_towards_it():
    """Three members were heard last; two finish while the coordinator is cut off (their
    processes end cleanly, their Leaves lost): the third, alone now, is still held, since
    its silence began among three."""
    m = membership(lease_s=5.0, isolation_hold_leases=6.0)
    for launch in ("x0", "x1", "x2"):
        m.add_launch(launch, "default", now=0.0)
        m.join("", "", launch, "", now=0.0, credential=OPEN)
    beating(m, ["L0", "L1", "L2"], 1.0, 10.0)
    m.launch_ended("x1", "exit code 0", now=12.0, clean=True)
    m.launch_ended("x2", "exit code 0", now=13.0, clean=True)
    m.expire(15.0)
    assert m.learner("L0").state == ACTIVE
    # A member that left with a Leave the coordinator heard was heard: one member is left,
    # and its silence is its own.
    solo = membership(lease_s=5.0, isolation_hold_leases=6.0)
    for _ in range(2):
        solo.join("", "", "", "", now=0.0, credential=OPEN)
    beating(solo, ["L0", "L1"], 1.0, 10.0)
    solo.leave("L1", "finished", now=10.5)
    solo.expire(15.0)
    assert solo.learner("L0").state == FAILED


@pytest.mark.parametrize("hold", [0.5, -1.0, float("inf"), float("nan")])
def test_a_hold_that_could_hold_nothing_is_refused(hold):
    with pytest.raises(InvalidArgument, match=r"isolation hold must be 0 leases \(off\) or at least 1 \(a shorter one "
                                              r"holds no failure\), got"):
        membership(lease_s=5.0, isolation_hold_leases=hold)
    assert membership(lease_s=45.0, isolation_hold_leases=1.0).cfg.isolation_hold_s == 45.0
    assert membership(lease_s=45.0).cfg.isolation_hold_s == 270.0  # 6 leases by default
