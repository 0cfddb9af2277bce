"""Membership and leases with a fake clock: time moves by assignment, never by sleeping."""

from pathlib import Path

import pytest

from diloco.auth import JoinCredential
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.core.membership import (
    FAILED_LAUNCHES_KEPT,
    MAX_GONE_KEPT,
    MAX_REASON_CHARS,
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
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted

PLAN = "ab" * 32
OPEN = JoinCredential("test", 64, None)
"""A credential that admits every learner these tests join, credited as they report."""


def membership(**cfg) -> Membership:
    cfg.setdefault("pools", ("default", "spot"))
    return Membership(CoordinatorConfig(data_dir=Path("/nonexistent"), **cfg), PLAN)


def kinds(m: Membership) -> list[tuple[str, str]]:
    return [(c.kind, c.learner.id if c.learner else c.stop_launch) for c in m.take_changes()]


def test_join_then_first_heartbeat_makes_a_learner_active():
    m = membership()
    a = m.join("", "host:1", "", PLAN, now=100.0, credential=OPEN)
    b = m.join("spot", "host:2", "", "", now=100.5, credential=OPEN)
    assert (a.id, a.state, a.pool) == ("L0", JOINING, "default")
    assert (b.id, b.pool) == ("L1", "spot")
    m.heartbeat("L0", HeartbeatStats(tokens=64, inner_steps=2, version_lag=1), now=101.0)
    assert m.learner("L0").state == ACTIVE and m.learner("L0").tokens == 64
    assert kinds(m) == [("joined", "L0"), ("joined", "L1"), ("active", "L0")]
    m.heartbeat("L0", HeartbeatStats(), now=101.5)
    assert kinds(m) == []  # already active: nothing to announce


def test_a_heartbeats_counts_are_dated_when_taken_within_its_previous_heartbeat_and_its_arrival():
    """A heartbeat a stalled coordinator held arrives with counts older than its arrival; a
    learner's clock may say anything, so the date is bounded by what the coordinator saw."""
    m = membership(lease_s=30.0)
    m.join("", "host:1", "", "", now=100.0, credential=OPEN)
    m.heartbeat("L0", HeartbeatStats(tokens=64, counted_s=100.4), now=106.0)  # sent before a 5 s stall
    assert m.learner("L0").counted_s == 100.4 and m.learner("L0").heartbeat_s == 106.0
    m.heartbeat("L0", HeartbeatStats(tokens=96), now=107.0)  # not said: when it arrived
    assert m.learner("L0").counted_s == 107.0
    m.heartbeat("L0", HeartbeatStats(tokens=128, counted_s=50.0), now=108.0)  # before its previous heartbeat
    assert m.learner("L0").counted_s == 107.0
    m.heartbeat("L0", HeartbeatStats(tokens=160, counted_s=1e12), now=109.0)  # in the future
    assert m.learner("L0").counted_s == 109.0


def test_lease_decision_and_expiry_with_a_fake_clock():
    m = membership(lease_s=5.0)
    learner = m.join("", "", "", "", now=10.0, credential=OPEN)
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
    m.join("", "", "", "", now=0.0, credential=OPEN)
    with pytest.raises(FailedPrecondition, match="L0 was marked failed .lease expired.*join again"):
        m.heartbeat("L0", HeartbeatStats(), now=7.0)
    # The failure is still announced although the call raised.
    assert kinds(m) == [("joined", "L0"), ("failed", "L0")]


def test_unknown_learner_and_departed_learner():
    m = membership()
    with pytest.raises(NotFound, match="unknown learner 'L7'"):
        m.heartbeat("L7", HeartbeatStats(), now=0.0)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.leave("L0", "done", now=1.0)
    m.leave("L0", "again", now=1.5)  # idempotent
    assert m.learner("L0").state == LEFT and m.learner("L0").reason == "done"
    with pytest.raises(FailedPrecondition, match="L0 has left .done.; join again"):
        m.heartbeat("L0", HeartbeatStats(), now=2.0)
    assert kinds(m) == [("joined", "L0"), ("left", "L0")]


def test_plan_hash_must_match():
    with pytest.raises(FailedPrecondition, match="fragment plan"):
        membership().join("", "", "", "cd" * 32, now=0.0, credential=OPEN)


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
    m.join("", "", "", "", now=1.0, credential=OPEN)  # a learner started by hand takes the third slot
    assert m.occupied() == 3
    with pytest.raises(ResourceExhausted, match="cap of 3"):
        m.join("", "", "", "", now=1.0, credential=OPEN)
    learner = m.join("", "", "x1", "", now=2.0, credential=OPEN)  # a launched learner brings its own slot
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
    m.join("", "", "x2", "", now=1.0, credential=OPEN)
    m.take_changes()
    m.launch_ended("x1", "exit code 2", now=2.0)  # before joining: frees its slot
    m.launch_ended("x2", "killed by SIGKILL", now=2.0)  # after: its learner fails now
    assert "x1" not in m.launches
    assert m.learner("L0").state == FAILED and m.learner("L0").reason == "process ended: killed by SIGKILL"
    assert [c.kind for c in m.take_changes()] == ["launch_ended", "failed"]


def test_select_for_removal():
    m = membership()
    for t in range(4):
        m.join("", "", "", "", now=float(t), credential=OPEN)
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
    m.join("", "", "x0", "", now=0.0, credential=OPEN)
    m.join("", "", "", "", now=0.0, credential=OPEN)
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
    m.join("", "a", "", "", now=0.0, credential=OPEN)
    m.join("spot", "b", "", "", now=0.0, credential=OPEN)
    m.leave("L1", "bye", now=1.0)
    m.add_launch("x9", "spot", now=1.0)
    state = m.to_state()
    back = Membership.from_state(m.cfg, PLAN, state)
    assert back.to_state() == state
    back.renew_all(1000.0)  # the coordinator was down far longer than a lease
    back.expire(1004.0)
    assert back.learner("L0").state == JOINING
    assert back.join("", "", "", "", now=1000.0, credential=OPEN).id == "L2"  # ids are never reused
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
    m.join("", "host:1", "", PLAN, now=100.0, credential=OPEN)
    m.join("", "host:2", "", PLAN, now=100.0, credential=OPEN)
    m.heartbeat("L0", HeartbeatStats(tokens=64, inner_steps=2), now=101.0)
    m.heartbeat("L1", HeartbeatStats(tokens=128, inner_steps=4), now=101.0)
    m.leave("L0", "finished", now=102.0, final=(192, 6))
    m.leave("L1", "finished", now=102.0, final=(64, 2))
    assert (m.learner("L0").tokens, m.learner("L0").inner_steps) == (192, 6)
    assert (m.learner("L1").tokens, m.learner("L1").inner_steps) == (128, 4)
    m.leave("L0", "again", now=103.0, final=(10**9, 10**9))  # already left: nothing changes
    assert m.learner("L0").tokens == 192


def test_reported_tokens_are_credited_at_most_at_the_credential_s_rate():
    """A learner claiming 1e12 tokens (in heartbeats, or in its Leave) is credited at most
    its credential's tokens/s times its time in the run; many ids of one credential,
    claiming together, raise nobody's credit (each is bounded by the ceiling alone)."""
    m = membership()
    sybils = JoinCredential("sybils", 4, 1000.0)
    for _ in range(4):
        m.join("", "host:1", "", PLAN, now=0.0, credential=sybils)
    for t in (1.0, 2.0, 3.0):
        for i in range(4):
            m.heartbeat(f"L{i}", HeartbeatStats(tokens=10**10 * int(t), inner_steps=int(t)), now=t)
        assert [m.learner(f"L{i}").tokens for i in range(4)] == [int(1000 * t)] * 4
    m.leave("L3", "done", now=3.5, final=(10**12, 10**7))
    assert m.learner("L3").tokens == 3500
    m.heartbeat("L0", HeartbeatStats(tokens=10, inner_steps=3), now=4.0)  # its highest claim stands
    assert m.learner("L0").tokens == 4000
    honest = m.join("", "host:2", "", PLAN, now=4.0, credential=JoinCredential("h", 1, 1000.0))
    m.heartbeat(honest.id, HeartbeatStats(tokens=500, inner_steps=1), now=5.0)  # under the ceiling: as claimed
    assert m.learner(honest.id).tokens == 500
    nothing = m.join("", "host:3", "", PLAN, now=4.0, credential=JoinCredential("zero", 1, 0.0))
    m.heartbeat(nothing.id, HeartbeatStats(tokens=500, inner_steps=1), now=5.0)
    assert m.learner(nothing.id).tokens == 0 and m.learner(nothing.id).claimed == 500
    launched = m.join("", "host:4", "", PLAN, now=4.0, credential=OPEN)  # no ceiling: as it reports
    m.heartbeat(launched.id, HeartbeatStats(tokens=10**9, inner_steps=1), now=5.0)
    assert m.learner(launched.id).tokens == 10**9
    assert m.tokens_total == sum(l.tokens for l in m.learners.values())


def test_a_join_credential_admits_its_limit_of_live_learners():
    m = membership()
    one = JoinCredential("one", 1, None)
    first = m.join("", "host:1", "", PLAN, now=0.0, credential=one)
    with pytest.raises(PermissionDenied, match="'one' admits at most 1 learner at once"):
        m.join("", "host:2", "", PLAN, now=0.0, credential=one)
    three = JoinCredential("three", 3, None)
    for _ in range(3):
        m.join("", "host:3", "", PLAN, now=0.0, credential=three)
    with pytest.raises(PermissionDenied, match="admits at most 3 learners at once, and 3 are members"):
        m.join("", "host:3", "", PLAN, now=0.0, credential=three)
    m.leave(first.id, "done", now=1.0)  # a learner that left frees its slot
    again = m.join("", "host:2", "", PLAN, now=1.0, credential=one)
    back = Membership.from_state(m.cfg, PLAN, m.to_state())  # the counts outlive a restart
    assert back.learner(again.id).credential == "one"
    with pytest.raises(PermissionDenied):
        back.join("", "host:2", "", PLAN, now=2.0, credential=one)


def test_the_run_s_token_total_outlives_pruned_learners_and_restarts(monkeypatch):
    import diloco.coordinator.core.membership as core

    monkeypatch.setattr(core, "MAX_GONE_KEPT", 1)
    m = membership()
    for i in range(3):
        m.join("", "host", "", PLAN, now=0.0, credential=OPEN)
        m.heartbeat(f"L{i}", HeartbeatStats(tokens=100 * (i + 1), inner_steps=1), now=1.0)
    m.leave("L0", "done", now=2.0, final=(150, 2))
    m.leave("L1", "done", now=2.0)
    m.take_changes()
    m.join("", "host", "", PLAN, now=3.0, credential=OPEN)  # a join prunes the gone beyond the one kept
    assert "L0" not in m.learners and m.tokens_total == 150 + 200 + 300
    back = Membership.from_state(m.cfg, PLAN, m.to_state())
    assert back.tokens_total == 650
    old = m.to_state()
    del old["tokens_total"]  # a state file from before the total: what its learners hold
    assert Membership.from_state(m.cfg, PLAN, old).tokens_total == 500


def test_a_learner_that_leaves_because_it_failed_is_failed_with_its_reason():
    """A learner whose task raised says so in its Leave: it is counted failed, not left,
    and its reason (what users are shown) is kept, cut to a bound."""
    m = membership()
    for _ in range(3):
        m.join("", "host:1", "", PLAN, now=100.0, credential=OPEN)
    m.leave("L0", "failed to start: task 'x': boom", now=101.0, failed=True)
    m.leave("L1", "finished", now=101.0)
    m.leave("L2", "x" * 10_000, now=101.0, failed=True)
    assert [(l.state, l.reason) for l in (m.learner("L0"), m.learner("L1"))] == [
        (FAILED, "failed to start: task 'x': boom"), (LEFT, "finished")]
    assert m.learner("L2").state == FAILED and m.learner("L2").reason == "x" * MAX_REASON_CHARS
    m.leave("L1", "now failed", now=102.0, failed=True)  # already left: nothing changes
    assert (m.learner("L1").state, m.learner("L1").reason) == (LEFT, "finished")


def test_launches_that_never_join_are_remembered_with_why():
    m = membership(join_timeout_s=60.0)
    for launch_id in ("a", "b", "c"):
        m.add_launch(launch_id, "default", 0.0)
    m.launch_ended("a", "exit code 2: diloco: error: bad flag", 5.0)
    m.join("default", "host:1", "c", "", 6.0, credential=OPEN)
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


def test_changes_say_why_and_which_process_to_stop_and_how():
    """Each transition is announced with its reason; a departure names the learner's
    launch to stop, gently only when the learner left by itself."""
    m = membership(lease_s=5.0)
    m.add_launch("x0", "default", now=0.0)
    m.join("", "host:1", "x0", "", now=0.0, credential=OPEN)
    m.join("spot", "host:2", "", "", now=0.0, credential=OPEN)
    m.join("", "host:3", "", "", now=0.0, credential=OPEN)
    m.heartbeat("L0", HeartbeatStats(), now=1.0)
    m.heartbeat("L2", HeartbeatStats(), now=2.0)  # heard within the last 3/4 lease: L1's silence is news
    m.leave("L0", "", now=2.0)  # no reason given
    m.expire(5.0)  # L1 never heartbeat
    m.remove(["L2"], "removed by an operator", now=5.5)
    got = [(c.kind, c.learner.id, c.reason, c.stop_launch, c.gently) for c in m.take_changes()]
    assert got == [
        ("joined", "L0", "joined pool default (launch x0)", "", False),
        ("joined", "L1", "joined pool spot", "", False),
        ("joined", "L2", "joined pool default", "", False),
        ("active", "L0", "first heartbeat", "", False),
        ("active", "L2", "first heartbeat", "", False),
        ("left", "L0", "left", "x0", True),
        ("failed", "L1", "lease expired: no heartbeat for 5.0 s (lease 5 s)", "", False),
        ("left", "L2", "removed by an operator", "", False),
    ]
    l0 = m.learner("L0")
    assert (l0.address, l0.launch_id, l0.joined_s, l0.state, l0.reason) == ("host:1", "x0", 0.0, LEFT, "left")


def test_remove_makes_live_learners_leave_and_skips_departed_ones():
    m = membership()
    m.add_launch("x1", "default", now=0.0)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.join("", "", "x1", "", now=0.0, credential=OPEN)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.leave("L0", "done", now=1.0)
    m.take_changes()
    m.remove(["L0", "L1"], "scaled down", now=2.0)
    assert [(l.id, l.state, l.reason) for l in m.listing(include_gone=True)] == [
        ("L0", LEFT, "done"), ("L1", LEFT, "scaled down"), ("L2", JOINING, ""),
    ]
    (change,) = m.take_changes()
    assert (change.kind, change.learner.id, change.reason, change.stop_launch, change.gently) == (
        "left", "L1", "scaled down", "x1", False,
    )
    with pytest.raises(NotFound, match="unknown learner 'L9'"):
        m.remove(["L9"], "", now=3.0)


def test_launch_failures_record_when_they_happened():
    m = membership(join_timeout_s=60.0)
    m.add_launch("a", "default", now=0.0)
    m.add_launch("b", "spot", now=10.0)
    m.launch_ended("a", "exit code 2", now=5.0)
    m.expire(70.0)
    assert [(x.launch_id, x.pool, x.failed_s) for x in m.failed_launches.values()] == [
        ("a", "default", 5.0), ("b", "spot", 70.0),
    ]
    assert [(c.kind, c.learner, c.reason, c.stop_launch) for c in m.take_changes()] == [
        ("launch_ended", None, "launch a ended before joining: exit code 2", ""),
        ("launch_ended", None, "launch b did not join within 60 s", "b"),
    ]


def test_a_launch_ending_that_is_unknown_or_of_a_departed_learner_changes_nothing():
    m = membership()
    m.add_launch("x1", "default", now=0.0)
    m.join("", "", "x1", "", now=0.0, credential=OPEN)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.leave("L0", "finished", now=1.0)
    m.take_changes()
    m.launch_ended("zz", "exit code 0", now=2.0)
    m.launch_ended("x1", "exit code 0", now=2.0)  # L0 already left: it stays left
    assert [(l.state, l.reason) for l in m.listing(include_gone=True)] == [(LEFT, "finished"), (JOINING, "")]
    assert m.take_changes() == [] and m.failed_launches == {}


def test_a_learner_whose_launch_timed_out_may_still_join():
    m = membership(join_timeout_s=60.0, max_learners=2)
    m.add_launch("x1", "default", now=0.0)
    m.expire(60.0)
    learner = m.join("", "host:1", "x1", "", now=61.0, credential=OPEN)  # late, but there is room
    assert (learner.id, learner.launch_id) == ("L0", "x1")


def test_a_launch_id_is_taken_only_by_the_launch_that_has_not_joined():
    """Members see each other's launch ids: a learner joining with one copied from a
    member (or made up) gets none, so its leaving stops nobody's process."""
    m = membership()
    m.add_launch("x1", "default", now=0.0)
    assert m.join("", "host:1", "x1", "", now=1.0, credential=OPEN).launch_id == "x1"
    assert m.join("", "host:2", "x1", "", now=2.0, credential=OPEN).launch_id == ""
    assert m.join("", "host:3", "made-up", "", now=2.0, credential=OPEN).launch_id == ""
    m.take_changes()
    m.leave("L1", "done", now=3.0)
    assert [c.stop_launch for c in m.take_changes()] == [""]


def test_the_cap_counts_what_is_already_taken():
    m = membership(max_learners=3)
    assert m.check_launch(3, "spot") == "spot"  # exactly the free slots
    m.add_launch("x1", "default", now=0.0)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    assert m.check_launch(1, "") == "default"
    with pytest.raises(ResourceExhausted, match=r"^cannot add 2 learners: 2 of the cap of 3 are taken$"):
        m.check_launch(2, "")


def test_a_drain_to_a_count_takes_a_new_count_and_a_drain_now_is_final():
    """A token budget moves allotments as learners over- or undershoot theirs; an
    operator's drain now ends an allotment's wait, and nothing moves it after that."""
    m = membership(drain_timeout_s=30.0, lease_s=100.0, credential_lifetime_s=200.0)
    for _ in range(3):
        m.join("", "", "", "", now=0.0, credential=OPEN)
    m.drain(["L0", "L1", "L2"], now=10.0, after_tokens={"L0": 5000, "L1": 7000})
    m.take_changes()
    assert [l.id for l in m.drain(["L0", "L1"], now=12.0, after_tokens={"L0": 6000, "L1": 7000})] == ["L0"]
    assert (m.learner("L0").drain_after_tokens, m.learner("L0").reason) == (6000, "drained at 6,000 tokens")
    assert [l.id for l in m.drain(["L0", "L2"], now=13.0, after_tokens={"L0": 4500, "L2": 100})] == ["L0"]
    assert m.learner("L0").drain_after_tokens == 4500 and m.learner("L2").drain_after_tokens == 0  # L2: now, final
    assert [l.id for l in m.drain(["L1"], now=14.0)] == ["L1"]
    assert (m.learner("L1").drain_after_tokens, m.learner("L1").reason) == (0, "removed by an operator (drain)")
    assert m.drain(["L1"], now=15.0, after_tokens={"L1": 9000}) == [] and m.learner("L1").drain_after_tokens == 0
    assert m.take_changes() == [] and m.learner("L0").drain_deadline_s == 40.0  # no new event, the same deadline


def test_drain_sets_a_deadline_once_and_only_for_live_learners():
    m = membership(drain_timeout_s=30.0, lease_s=100.0, credential_lifetime_s=200.0)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.leave("L1", "finished", now=1.0)
    m.take_changes()
    m.drain(["L0", "L1"], now=10.0)
    m.drain(["L0"], now=20.0)  # already draining: the deadline does not move
    l0 = m.learner("L0")
    assert (l0.state, l0.reason, l0.drain_deadline_s) == (DRAINING, "removed by an operator (drain)", 40.0)
    assert (m.learner("L1").state, m.learner("L1").reason) == (LEFT, "finished")
    assert [(c.kind, c.learner.id, c.reason) for c in m.take_changes()] == [
        ("draining", "L0", "removed by an operator (drain)"),
    ]
    assert m.next_deadline() == 40.0  # before its lease ends at 100
    m.expire(39.9)
    assert m.learner("L0").state == DRAINING
    m.expire(40.0)
    assert m.learner("L0").state == LEFT


def test_expiry_looks_past_departed_learners():
    m = membership(lease_s=5.0)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.leave("L0", "finished", now=1.0)
    m.expire(5.0)
    assert m.learner("L1").state == FAILED


def test_next_deadline_includes_launches_waiting_to_join():
    m = membership(join_timeout_s=60.0)
    m.add_launch("x1", "default", now=10.0)
    assert m.next_deadline() == 70.0


def test_renewing_after_a_restart_gives_pending_launches_a_fresh_join_timeout():
    m = membership(join_timeout_s=60.0)
    m.add_launch("x1", "default", now=0.0)
    m.renew_all(1000.0)
    m.expire(1059.9)
    assert list(m.launches) == ["x1"]
    m.expire(1060.0)
    assert m.launches == {}


def test_reset_says_why_everyone_left():
    m = membership()
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.take_changes()
    m.reset("restored from snapshot 3", now=1.0)
    assert m.learner("L0").reason == "restored from snapshot 3"
    assert [(c.kind, c.reason) for c in m.take_changes()] == [("left", "restored from snapshot 3")]


def test_select_edges():
    m = membership()
    for t in range(3):
        m.join("", "", "", "", now=float(t), credential=OPEN)
    assert [l.id for l in m.select([], 1)] == ["L2"]
    assert [l.id for l in m.select([], 3)] == ["L2", "L1", "L0"]  # all of them
    with pytest.raises(InvalidArgument, match=r"^give learner ids or a count, not both$"):
        m.select(["L1"], 1)
    m.leave("L0", "", now=5.0)
    m.leave("L1", "", now=5.0)
    with pytest.raises(FailedPrecondition, match=r"^already gone: L0, L1$"):
        m.select(["L0", "L1", "L2"], 0)


def test_plan_mismatch_names_both_plans():
    with pytest.raises(FailedPrecondition) as error:
        membership().join("", "", "", "0123456789abcdef", now=0.0, credential=OPEN)
    assert str(error.value) == "fragment plan 0123456789ab differs from the run's abababababab: check the model flags"


def test_departed_learners_beyond_the_kept_number_are_forgotten_oldest_first():
    m = membership(max_learners=4)
    for t in range(MAX_GONE_KEPT + 2):
        m.join("", "", "", "", now=0.0, credential=OPEN)
        m.leave(f"L{t}", "", now=0.0)
    m.join("", "", "", "", now=0.0, credential=OPEN)  # a live learner is never forgotten
    ids = [l.id for l in m.listing(include_gone=True)]
    assert len(ids) == MAX_GONE_KEPT + 1 and ids[:2] == ["L2", "L3"] and ids[-1] == f"L{MAX_GONE_KEPT + 2}"


def test_state_file_keeps_the_learner_counter_and_the_run_plan():
    m = membership()
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    assert m.to_state()["next_learner"] == 2
    cfg = m.cfg
    fresh = Membership.from_state(cfg, PLAN, {})  # a first start: nothing yet
    assert fresh.join("", "", "", "", now=0.0, credential=OPEN).id == "L0"
    with pytest.raises(FailedPrecondition, match="fragment plan"):
        fresh.join("", "", "", "cd" * 32, now=0.0, credential=OPEN)
    # The counter in the file wins over the records (the learners it counted may be gone) ...
    assert Membership.from_state(cfg, PLAN, {"next_learner": 7}).join("", "", "", "", now=0.0, credential=OPEN).id == "L7"
    # ... and the records win over a counter that is behind: ids are never reused.
    state = m.to_state()
    state["next_learner"] = 0
    assert Membership.from_state(cfg, PLAN, state).join("", "", "", "", now=0.0, credential=OPEN).id == "L2"


def test_a_learner_record_with_a_bad_id_is_refused():
    record = {"id": "X3", "pool": "default", "address": "", "launch_id": "", "state": LEFT, "joined_s": 0.0,
              "heartbeat_s": 0.0}
    with pytest.raises(InvalidArgument, match=r"^corrupt coordinator state: bad learner record \{'id': 'X3'"):
        Membership.from_state(membership().cfg, PLAN, {"learners": [record]})


def test_a_member_that_heartbeats_but_trains_nothing_fails_after_the_idle_timeout():
    """A silent member (it heartbeats, its counts never grow) is failed like a dead one,
    with the reason; progress renews it, a draining learner has its own deadline, and
    next_deadline wakes the coordinator for it."""
    # No hold for a coordinator that hears nobody: L1 alone beats below, every 4 s of a 5 s
    # lease, slower than a learner may (every half lease), so 4 s of silence look like it.
    m = membership(idle_timeout_s=30.0, lease_s=5.0, credential_lifetime_s=60.0, isolation_hold_leases=0.0)
    for _ in range(3):
        m.join("", "host:1", "", PLAN, now=0.0, credential=OPEN)
    for t in range(2, 30, 2):  # every learner beats; only L1 trains
        for learner_id in ("L0", "L1", "L2"):
            trained = t * 10 if learner_id == "L1" else 0
            m.heartbeat(learner_id, HeartbeatStats(tokens=trained, inner_steps=trained // 10), now=float(t))
    m.drain(["L2"], now=28.0)
    assert m.next_deadline() == 30.0  # L0's idle deadline comes before any lease
    m.heartbeat("L0", HeartbeatStats(tokens=0, inner_steps=0), now=29.9)
    m.heartbeat("L1", HeartbeatStats(tokens=280, inner_steps=28), now=29.9)  # no new progress since t=28
    m.heartbeat("L2", HeartbeatStats(tokens=0, inner_steps=0), now=29.9)
    m.expire(30.0)
    assert m.learner("L0").state == FAILED and m.learner("L0").reason.startswith("trained nothing for 30.0 s")
    assert m.learner("L1").state == ACTIVE and m.learner("L2").state == DRAINING
    for t in (33.0, 37.0, 41.0, 45.0, 49.0, 53.0, 57.0, 57.9):  # beating within its lease, training nothing more
        m.heartbeat("L1", HeartbeatStats(tokens=280, inner_steps=28), now=t)
    assert m.learner("L1").state == ACTIVE
    m.expire(58.0)  # its last progress was at 28 s
    assert m.learner("L1").state == FAILED and m.learner("L1").reason.startswith("trained nothing for 30.0 s")
    # Off with 0, and a coordinator restart gives everyone a fresh start.
    off = membership(idle_timeout_s=0.0, lease_s=5.0, credential_lifetime_s=60.0)
    off.join("", "host:1", "", PLAN, now=0.0, credential=OPEN)
    for t in range(1, 100):
        off.heartbeat("L0", HeartbeatStats(), now=float(t))
    assert off.learner("L0").state == ACTIVE
    again = membership(idle_timeout_s=30.0, lease_s=5.0, credential_lifetime_s=60.0)
    again.join("", "host:1", "", PLAN, now=0.0, credential=OPEN)
    again.renew_all(100.0)
    again.expire(104.0)
    assert again.learner("L0").state == JOINING
    with pytest.raises(InvalidArgument, match="idle timeout"):
        membership(idle_timeout_s=-1.0)


def test_the_learner_cap_keeps_the_coordinators_clock_under_the_wire_limit():
    """Every learner the coordinator lists (live, and the gone it keeps), every shard and
    itself fit in one clock on the wire; a cap above that is refused by name."""
    from diloco.coordinator.config import MAX_LEARNERS, MAX_SHARDS
    from diloco.convert import MAX_CLOCK_ENTRIES

    assert MAX_LEARNERS + MAX_GONE_KEPT + MAX_SHARDS + 1 <= MAX_CLOCK_ENTRIES
    membership(max_learners=MAX_LEARNERS)
    with pytest.raises(InvalidArgument, match=f"max learners must be in \\[1, {MAX_LEARNERS}\\], got 2049"):
        membership(max_learners=MAX_LEARNERS + 1)
    with pytest.raises(InvalidArgument, match=f"at most {MAX_SHARDS} shards"):
        membership(shards=tuple(f"127.0.0.1:{7000 + i}" for i in range(MAX_SHARDS + 1)))


def test_the_chart_caps_learners_as_the_coordinator_does():
    import json

    from diloco.coordinator.config import MAX_LEARNERS

    schema = json.loads((Path(__file__).resolve().parents[2] / "k8s" / "diloco" / "values.schema.json").read_text())
    assert schema["properties"]["coordinator"]["properties"]["maxLearners"]["maximum"] == MAX_LEARNERS


def test_expiry_looks_at_every_learner_only_once_a_deadline_may_have_come():
    """``expire`` runs on every call; it scanned every learner each time (with 256 learners,
    half of a heartbeat's cost). It now keeps the earliest deadline: a heartbeat moves only
    its own learner's later and keeps it; a join, a drain, a launch or a pause, which may
    bring one earlier, make it look again. Each step below would go wrong if it did not."""
    m = membership(lease_s=10.0, drain_timeout_s=2.0, join_timeout_s=4.0)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    m.join("", "", "", "", now=0.0, credential=OPEN)
    assert m.next_deadline() == 10.0
    m.heartbeat("L1", HeartbeatStats(tokens=1), now=5.0)  # L1's lease runs to 15: the earliest is still L0's
    m.expire(9.9)
    assert all(l.live for l in m.learners.values()) and m.next_deadline() == 10.0
    m.expire(10.0)
    assert (m.learner("L0").state, m.learner("L1").state) == (FAILED, ACTIVE) and m.next_deadline() == 15.0
    m.drain(["L1"], now=11.0)  # its drain ends at 13, before its lease
    assert m.next_deadline() == 13.0
    m.expire(13.0)
    assert m.learner("L1").state == LEFT and m.learner("L1").reason == "drain timed out after 2 s"
    assert m.next_deadline() is None
    m.join("", "", "", "", now=20.0, credential=OPEN)  # no deadline before: one now
    assert m.next_deadline() == 30.0
    m.add_launch("x0", "default", now=21.0)  # its join times out at 25, before L2's lease
    assert m.next_deadline() == 25.0
    m.expire(25.0)
    assert "x0" not in m.launches and m.learner("L2").live
    m.pause(3.0, now=29.0)  # the coordinator stalled 3 s: L2's lease moves on by it
    assert m.next_deadline() == 33.0
    m.expire(32.9)
    assert m.learner("L2").live
