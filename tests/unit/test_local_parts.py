"""The pure parts of diloco local: chaos flag parsing, goodput's slot time, uptime, and
the timeline's state spans."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.cli.chaos import DEFAULT_FAULT_S, ChaosConfig, FaultSpec, learner_pid, parse_chaos, parse_learner_device, parse_scavenge, parse_slow
from diloco.errors import InvalidArgument
from diloco.files import atomic_write
from diloco.telemetry import prometheus_target
from diloco.cli.local.config import PROMETHEUS_TARGETS, LocalConfig
from diloco.cli.local.supervisor import Cluster
from diloco.cli.local.run import allot
from diloco.cli.metrics import (MIN_PERIOD_S, PERIOD_SLACK, bytes_per_1k_tokens, curve_marks, curve_path, expected_period,
                           goodput, slot_seconds, start_s, tape_stats, uptime, wire_bytes)
from diloco.tape import TapeWriter
from diloco.cli.timeline import learner_intervals


def test_chaos_flags_parse_and_reject_nonsense():
    assert parse_scavenge("3@40") == (3, 40.0)
    assert parse_slow("L1:1.5") == (1, 1.5) and parse_slow("2:3") == (2, 3.0)
    for bad in ("3", "x@1", "3@"):
        with pytest.raises(InvalidArgument, match="N@SECONDS"):
            parse_scavenge(bad)
    for bad in ("L1", "L1:x", "L1:0.5", "L-1:2"):
        with pytest.raises(InvalidArgument, match="--slow-learner"):
            parse_slow(bad)
    with pytest.raises(InvalidArgument, match="kill-learner-every"):
        ChaosConfig(kill_every_s=0)
    with pytest.raises(InvalidArgument, match="scavenge"):
        ChaosConfig(scavenge=(0, 5.0))
    assert not ChaosConfig().active and ChaosConfig(restart_shard_at_s=3).active
    with pytest.raises(InvalidArgument, match="only 3 learners"):
        LocalConfig(slow_learners=((3, 1.5),))
    with pytest.raises(InvalidArgument, match="--tokens"):
        LocalConfig(tokens=0)


def test_a_chaos_schedule_parses_and_bad_faults_get_one_line_before_anything_starts(tmp_path):
    assert parse_chaos("cut:20, flap,kill@L1,cut-shard@S0,isolate-coordinator,restart-shard") == (
        FaultSpec("cut", 20.0), FaultSpec("flap", DEFAULT_FAULT_S), FaultSpec("kill", None, "L1"),
        FaultSpec("cut-shard", DEFAULT_FAULT_S, "S0"), FaultSpec("isolate-coordinator", DEFAULT_FAULT_S),
        FaultSpec("restart-shard"))
    for bad, message in (("partition", "unknown fault 'partition'"), ("cut:ten", "must be a number of seconds, got 'ten'"),
                         ("cut:-1", "must be > 0 seconds"), ("kill:5", "kill is instant"),
                         ("cut@S1", "cut takes L<n>, got @S1"), ("cut-shard@L0", "cut-shard takes S<n>"),
                         ("isolate-coordinator@L0", "takes no target")):
        with pytest.raises(InvalidArgument, match=re.escape(message)):
            parse_chaos(bad)
    with pytest.raises(InvalidArgument, match=re.escape("--chaos cut@L3: there are only 3 learners (L0..L2)")):
        LocalConfig(chaos=ChaosConfig(faults=parse_chaos("cut@L3")), link_mbit=10)
    with pytest.raises(InvalidArgument, match=re.escape("--chaos restart-shard@S2: there are only 2 shards (S0..S1)")):
        LocalConfig(chaos=ChaosConfig(faults=parse_chaos("restart-shard@S2")))
    with pytest.raises(InvalidArgument, match=re.escape("--chaos cut, starve: network faults act on emulated sites: "
                                                        "add --link-mbit R")):
        LocalConfig(chaos=ChaosConfig(faults=parse_chaos("starve,kill,cut")))
    with pytest.raises(InvalidArgument, match="--chaos-every must be > 0"):
        ChaosConfig(fault_every_s=0)
    assert ChaosConfig(faults=parse_chaos("kill")).active and not ChaosConfig(faults=parse_chaos("kill")).network
    out = tmp_path / "run"
    for flags, message in ((["--chaos", "cut:x"], "the duration of cut must be a number of seconds"),
                           (["--chaos", "nap"], "unknown fault 'nap'"),
                           (["--chaos", "cut@L7", "--link-mbit", "10"], "there are only 3 learners")):
        proc = subprocess.run([sys.executable, "-m", "diloco", "local", *flags, "--out", str(out)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()


def test_learner_devices_parse_and_a_device_this_machine_lacks_fails_before_anything_starts(tmp_path):
    assert parse_learner_device("L0:xla") == (0, "xla") and parse_learner_device("2:cpu") == (2, "cpu")
    for bad in ("L0", "L0:tpu", "x:xla", "L-1:xla"):
        with pytest.raises(InvalidArgument, match="--learner-device takes ID:DEVICE"):
            parse_learner_device(bad)
    with pytest.raises(InvalidArgument, match="--learner-device L3: there are only 3 learners"):
        LocalConfig(learner_devices=((3, "xla"),))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "diloco", "local", "--learner-device", "L0:xla", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "torch-xla is not installed here" in proc.stderr and "constraints-xla.txt" in proc.stderr, proc.stderr
    assert not out.exists()


def test_learner_pid_comes_from_the_address_it_reported():
    assert learner_pid({"address": "host-1:4242"}) == 4242
    assert learner_pid({"address": "nonsense"}) is None and learner_pid({}) is None


def test_token_budget_sizes_the_learners():
    cfg = LocalConfig(learners=3, tokens=3 * 16 * 128 * 10)
    assert cfg.learner_steps(16 * 128) == 15 and LocalConfig(steps=7).learner_steps(16 * 128) == 7  # 1.5x the share of 10


def test_what_is_left_of_the_budget_is_allotted_by_rate_and_sums_to_it_exactly():
    members = [{"id": "L0", "state": "active", "tokens": 1000}, {"id": "L1", "state": "active", "tokens": 900},
               {"id": "L2", "state": "joining", "tokens": 0}]  # no rate yet: leaves at once
    rates = {"L0": 300.0, "L1": 100.0, "L2": 0.0}
    after = allot(1001, members, rates)
    assert after == {"L0": 1000 + 751, "L1": 900 + 250}  # 3:1, the faster one takes the rounding
    assert sum(after[m["id"]] - m["tokens"] for m in members[:2]) == 1001
    assert allot(0, members, rates) == allot(-5, members, rates) == allot(100, members[2:], rates) == {}
    # Active without a rate (it has just started training): at the others' mean, 200.
    started = [*members[:2], {"id": "L3", "state": "active", "tokens": 0}]
    assert allot(600, started, rates) == {"L0": 1000 + 300, "L1": 900 + 100, "L3": 200}


def test_the_budget_reads_each_count_at_its_heartbeat_so_stale_counts_neither_slow_nor_shrink_the_run(monkeypatch, tmp_path):
    """A loaded host delays heartbeats: the look sees the same counts again and again. The
    rates are each learner's own, and what it trained since its last heartbeat counts as
    spent, so the drain comes in time and every allotment is ahead of the learner's count
    (a chaos run on a loaded machine once ran 213,760 tokens over a 768,000 budget: the
    look's own clock had read the repeated counts as a slowdown)."""
    import time

    from diloco.cli.local.run import DRAIN_LEAD_S, Budget

    clock = [1000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])

    class Admin:
        calls = []

        def remove_learners(self, ids, drain, after_tokens):
            self.calls.append((ids, drain, after_tokens))

    def look(beat):  # two learners at 1,000 and 3,000 tokens/s since 1000.0, heartbeats at `beat`
        members = [{"id": f"L{i}", "state": "active", "tokens": int(rate * (beat - 1000)),
                    "tokens_per_s": rate if beat > 1001 else 0.0, "last_heartbeat_unix_ms": int(beat * 1000),
                    "counted_unix_ms": int(beat * 1000)} for i, rate in enumerate((1000.0, 3000.0))]
        members.append({"id": "L9", "state": "left", "tokens": 5000, "tokens_per_s": 0.0, "last_heartbeat_unix_ms": 0,
                        "counted_unix_ms": 0})
        budget.spend(sum(m["tokens"] for m in members), members, admin, None)

    admin, budget = Admin(), Budget(5000 + 4000 * 20, tmp_path / "drain.json")
    for beat in range(1001, 1020 - int(DRAIN_LEAD_S) - 2):
        for lag in (0.2, 0.9, 1.6, 2.3):  # four looks see each heartbeat's counts, the last ones 2.3 s old
            clock[0] = beat + lag
            look(beat)
            assert budget.rate == (0.0 if beat == 1001 else 4000.0) and not admin.calls
            assert abs(budget.spent - (5000 + 4000 * (beat - 1000 + (0 if beat == 1001 else lag)))) <= 2
    clock[0] = 1010.5
    look(1010)  # 10.5 s of 20: within the lead
    assert 20 - 10.5 <= DRAIN_LEAD_S and admin.calls
    [(ids, drain, after)] = admin.calls
    assert ids == ["L0", "L1"] and drain and after == {"L0": 1000 * 20, "L1": 3000 * 20}
    # The decision, as the run's drain.json keeps it: what each count was estimated from.
    decided = json.loads((tmp_path / "drain.json").read_text())
    assert decided["budget"] == 85_000 and decided["unix_s"] == 1010.5 and decided["rate"] == 4000.0
    assert decided["learners"]["L1"] == {"reported": 30_000, "rate": 3000.0, "count_age_s": 0.5,
                                         "estimated": 31_500, "allotment": 60_000}


def test_counts_a_stalled_coordinator_held_are_read_at_the_time_they_were_taken(monkeypatch):
    """A coordinator stopped for a while answers, as it resumes, the heartbeats it held: their
    counts are seconds older than their arrival. Each count is read at the time its learner
    took it, so the estimates, and with them the allotments, are where the learners stand
    (timed by arrival, L0 here would be allotted 4,000 tokens too few, L1 4,000 too many)."""
    import time

    from diloco.cli.local.run import Budget

    monkeypatch.setattr(time, "time", lambda: 2000.0)
    calls = []

    class Admin:
        def remove_learners(self, ids, drain, after_tokens):
            calls.append(after_tokens)

    now = {"L0": 50_000, "L1": 90_000}  # at 4,000 and 1,000 tokens/s; counted 6 and 1 s ago, both just arrived
    members = [{"id": i, "state": "active", "tokens": now[i] - age * rate, "tokens_per_s": float(rate),
                "last_heartbeat_unix_ms": 2_000_000, "counted_unix_ms": (2000 - age) * 1000}
               for i, rate, age in (("L0", 4000, 6), ("L1", 1000, 1))]
    budget = Budget(sum(now.values()) + 5 * 5000)  # 5 s of training left
    budget.spend(sum(m["tokens"] for m in members), members, Admin(), None)
    assert calls == [{"L0": now["L0"] + 5 * 4000, "L1": now["L1"] + 5 * 1000}]


def _budget_after_a_drain(monkeypatch, tmp_path):
    """A budget of 60,000 whose drain allotted 20,000 each to three learners at 10,000
    (100 tokens a step, 1,000 tokens/s): the clock, the budget, the admin's calls and a
    member maker."""
    import time

    from diloco.cli.local.run import Budget

    clock = [3000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])

    class Admin:
        calls = []

        def remove_learners(self, ids, drain, after_tokens):
            assert drain and sorted(ids) == sorted(after_tokens)
            self.calls.append(dict(after_tokens))

    def member(i, tokens, state="draining", rate=1000.0):
        return {"id": i, "state": state, "tokens": tokens, "inner_steps": tokens // 100, "tokens_per_s": rate,
                "last_heartbeat_unix_ms": int(clock[0] * 1000), "counted_unix_ms": int(clock[0] * 1000)}

    budget, admin = Budget(60_000, tmp_path / "drain.json"), Admin()
    budget.spend(30_000, [member(i, 10_000, "active") for i in ("L0", "L1", "L2")], admin, None)
    assert admin.calls == [{"L0": 20_000, "L1": 20_000, "L2": 20_000}] and budget.allotted == 60_000
    clock[0] += 1
    return clock, budget, admin, member


def test_what_a_learner_trains_past_its_allotment_is_taken_from_those_short_of_theirs(monkeypatch, tmp_path):
    """A learner whose directive came late trains over; the others' allotments are lowered
    by that, in proportion to what each has left, so the run still meets its budget; each
    move is kept in drain.json."""
    clock, budget, admin, member = _budget_after_a_drain(monkeypatch, tmp_path)
    # L0 heard of it late: at 26,000, 6,000 over; L1 has 7,000 left less 2 s at its rate, L2 3,000 less 2 s.
    budget.spend(0, [member("L0", 26_000), member("L1", 13_000), member("L2", 15_000)], admin, None)
    assert admin.calls[1] == {"L1": 20_000 - 3_750, "L2": 20_000 - 2_250}  # 6,000 taken of 5,000 and 3,000 left: 5:3
    assert budget.allotments == {"L0": 20_000, "L1": 16_250, "L2": 17_750}
    clock[0] += 1
    budget.spend(0, [member("L0", 26_000, "left"), member("L1", 14_000), member("L2", 16_100)], admin, None)
    assert len(admin.calls) == 2  # on its allotments again (L2 within a step of its): nothing moved
    decided = json.loads((tmp_path / "drain.json").read_text())
    assert decided["moved"] == [{"unix_s": 3001.0, "off": 6_000, "allotments": {"L1": 16_250, "L2": 17_750}}]


def test_what_a_learner_leaves_of_its_allotment_is_given_to_those_still_training(monkeypatch, tmp_path):
    """A learner that runs out of its steps (or dies) before its allotment leaves the run
    short by the rest: the learners still training are given it, by their rates."""
    clock, budget, admin, member = _budget_after_a_drain(monkeypatch, tmp_path)
    budget.spend(0, [member("L0", 17_000, "left"), member("L1", 15_000, rate=3000.0), member("L2", 15_000)], admin, None)
    assert admin.calls[1] == {"L1": 20_000 + 2_250, "L2": 20_000 + 750}
    clock[0] += 1
    budget.spend(0, [member("L0", 17_000, "left"), member("L1", 18_000, rate=3000.0), member("L2", 16_000)], admin, None)
    assert len(admin.calls) == 2
    # Over by less than a step per learner (each crosses its allotment by part of a step): as is.
    budget.spend(0, [member("L0", 17_000, "left"), member("L1", 22_300, "left"), member("L2", 20_800, "left")], admin, None)
    assert len(admin.calls) == 2


def test_slot_seconds_count_each_slot_from_its_first_step_and_scavenged_from_the_request():
    assert slot_seconds([0.0, 2.0], 10.0, []) == 18.0
    assert slot_seconds([0.0], 10.0, [(4.0, 2), (12.0, 1)]) == 10.0 + 12.0


def test_start_is_launch_to_the_last_first_step():
    assert start_s(100.0, [103.5, 106.25, 104.0]) == 6.25
    assert start_s(100.0, []) is None  # no worker stepped: no start to report


def test_tape_stats_count_the_steps_of_merged_pushes_only(tmp_path):
    """A hand-made run: P = 2, shard 0 owns fragment 0, shard 1 fragment 1 and restarts
    once (a second life whose versions repeat the first's)."""
    def push(tape, t, learner, fragment, target, step_time_s, outcome="accepted"):
        tape.append("push", t, learner=learner, fragment=fragment, target_version=target, steps=8,
                    step_time_s=step_time_s, outcome=outcome)

    def round_(tape, t, fragment, version, participants, weights, grace_s):
        tape.append("round", t, fragment=fragment, version=version, participants=participants, weights=weights,
                    grace_s=grace_s)

    s0, s1 = TapeWriter(tmp_path / "shard0" / "tape-S0.jsonl"), TapeWriter(tmp_path / "shard1" / "tape-S1.jsonl")
    s0.append("start", 0.0)
    push(s0, 1.0, "L0", 0, 1, 0.1)
    push(s0, 1.1, "L0", 0, 1, 0.1, outcome="duplicate")  # a retry: counted once
    push(s0, 1.2, "L1", 0, 1, 0.2)
    round_(s0, 2.0, 0, 1, ["L0", "L1"], [1.0, 0.0], 0.5)  # L1's weight 0 (it had failed): not merged
    s1.append("start", 0.0)
    push(s1, 1.0, "L0", 1, 1, 0.1)
    round_(s1, 1.5, 1, 1, ["L0"], [1.0], 0.0)
    push(s1, 2.5, "L0", 1, 2, 0.1)
    round_(s1, 3.0, 1, 2, ["L0"], [1.0], 0.1)
    s1.append("start", 4.0)  # restored at version 0: versions 1 and 2 come again
    push(s1, 5.0, "L1", 1, 1, 0.2)
    round_(s1, 5.5, 1, 1, ["L1"], [1.0], 0.2)
    push(s1, 6.0, "L0", 1, 2, 0.1)  # never merged in this life, although version 2 of the first life was L0's
    for tape in (s0, s1):
        tape.close()

    stats = tape_stats(tmp_path, fragments=2, steps={"L0": 16, "L1": 16, "L2": 10})
    # Merged fragment-steps: L0 8 + 8 + 8 = 24 of 32 at 0.1 s; L1 8 of 32 at 0.2 s; L2 never
    # pushed: its 20 fragment-steps at the median step time (0.2 s) are all lost.
    assert stats["step_goodput"] == round((24 * 0.1 + 8 * 0.2) / (32 * 0.1 + 32 * 0.2 + 20 * 0.2), 4)
    assert stats["useful_s"] == pytest.approx((24 * 0.1 + 8 * 0.2) / 2)
    assert stats["rounds"] == 4 and stats["mean_participants"] == 1.25 and stats["mean_grace_s"] == 0.2
    assert stats["round_closes"] == [1.5, 2.0, 3.0, 5.5] and stats["step_s"] == 0.2


def test_uptime_counts_only_time_beyond_the_expected_period():
    assert uptime([1, 2, 3, 4], 0, 5, 1.5) == (1.0, 0.0)
    up, stall = uptime([1, 6], 0, 7, 1.0)  # a 5 s gap: 4 s beyond the period
    assert stall == 4.0 and up == pytest.approx(1 - 4 / 7, abs=1e-4)


def test_timeline_spans_from_state_changes_and_death():
    events = [{"kind": "state", "t": 0, "state": "starting"}, {"kind": "state", "t": 1, "state": "bootstrapping"},
              {"kind": "eval", "t": 1.5}, {"kind": "state", "t": 2, "state": "computing"}]
    assert learner_intervals(events, end=10, death=6) == [
        (0, 1, "starting"), (1, 2, "bootstrapping"), (2, 6, "computing"), (6, 10, "dead")]
    left = events + [{"kind": "state", "t": 8, "state": "draining"}, {"kind": "state", "t": 9, "state": "left"}]
    assert learner_intervals(left, end=10, death=None)[-1] == (8, 9, "draining")


def test_the_progress_line_for_logs_carries_the_table_s_essentials():
    from types import SimpleNamespace

    from diloco.cli.local.progress import progress_line

    shard = SimpleNamespace(fragments=[SimpleNamespace(version=3), SimpleNamespace(version=5)], rounds_closed=7)
    members = [{"id": "L0", "state": "active", "tokens": 1000}, {"id": "L1", "state": "left", "tokens": 500}]
    events = {"L0": [{"kind": "eval", "loss": 4.25}]}
    line = progress_line(members, [shard, RuntimeError("down")], events, time.monotonic() - 12, "bits/byte")
    assert line.startswith("[   12 s] tokens 1,500 · learners 1 active, 1 left · outer versions 3–5 · rounds 7")
    assert "latest eval 4.250 bits/byte" in line and line.endswith("1/2 shards up")
    assert "learners none joined yet" in progress_line([], [], {}, time.monotonic(), "bits/byte")


def test_stopping_says_which_processes_it_waits_for(tmp_path):
    """SIGTERM to every process of the run; one that takes its time is named every 5 s
    (issue: Ctrl-C took about 30 s with no feedback)."""
    import subprocess
    import sys

    from diloco.cli.local.supervisor import Cluster

    cluster = Cluster(LocalConfig(tls=False), tmp_path, 1)
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    slow = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                                   "print('ready', flush=True); time.sleep(7)"],
                            stdout=subprocess.PIPE, text=True)
    assert slow.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    cluster.procs = [("coordinator", quick), ("shard0", slow)]
    said = []
    started = time.monotonic()
    cluster.stop(say=said.append)
    assert quick.returncode is not None and slow.returncode == 0  # the slow one finished by itself, no SIGKILL
    assert 6 < time.monotonic() - started < 20
    assert said and all(line.startswith("stopping: waiting") and f"shard0 (pid {slow.pid})" in line for line in said)
    assert not any("coordinator" in line for line in said)  # it had stopped at once


def test_wire_bytes_count_what_every_life_of_every_shard_received_and_sent(tmp_path):
    """Traffic from the shards' tapes: every push received (a duplicate crossed the wire
    too), every reply and bootstrap sent to a learner, across a restart; the coordinator's
    export relay is not training traffic."""
    s0, s1 = TapeWriter(tmp_path / "shard0" / "tape-S0.jsonl"), TapeWriter(tmp_path / "shard1" / "tape-S1.jsonl")
    s0.append("start", 0.0)
    s0.append("push", 1.0, learner="L0", bytes=100, outcome="accepted")
    s0.append("push", 1.1, learner="L0", bytes=100, outcome="duplicate")
    s0.append("sent", 1.5, learner="L0", what="reply", fragment=0, bytes=40)
    s0.append("sent", 1.6, learner="C", what="bootstrap", fragment=0, bytes=999)
    s1.append("start", 0.0)
    s1.append("sent", 0.5, learner="L1", what="bootstrap", fragment=1, bytes=7)
    s1.append("push", 1.0, learner="L1", bytes=30, outcome="accepted")  # L1 was killed: no summary of its own
    s1.append("start", 2.0)  # restarted: the first life's records still count
    s1.append("push", 3.0, learner="L0", bytes=5, outcome="stale")
    s1.append("sent", 3.5, learner="L0", what="reply", fragment=1, bytes=3)
    for tape in (s0, s1):
        tape.close()
    assert wire_bytes(tmp_path) == {"bytes_up": 235, "bytes_down": 50}
    assert wire_bytes(tmp_path / "nowhere") == {"bytes_up": 0, "bytes_down": 0}


def test_the_shared_definitions():
    """One definition for every system: the expected period has the same slack and the
    same floor whoever advances (DP's steps, Decoupled's rounds, torchft's syncs)."""
    assert (PERIOD_SLACK, MIN_PERIOD_S) == (4.0, 1.0)
    assert expected_period(0.5) == 2.0 and expected_period(0.1) == 1.0  # 0.4 s would be jitter's to decide
    assert goodput(9.0, 12.0) == 0.75 and goodput(1.0, 3.0) == 0.3333 and goodput(5.0, 0.0) == 0.0
    assert bytes_per_1k_tokens(300, 1200) == 250.0 and bytes_per_1k_tokens(5, 0) is None


def test_the_pace_is_tokens_per_second_over_the_last_three_seconds():
    from diloco.learner.summary import Pace

    pace = Pace()
    assert pace.add(0.0, 0) == 0.0  # one count: no rate yet
    assert [pace.add(t, 100 * t) for t in (1.0, 2.0, 3.0, 4.0)] == [100.0] * 4
    assert pace.add(5.0, 600) == 400 / 3  # 200 -> 600 over 2.0 .. 5.0: the old counts drop out
    assert pace.add(5.0, 600) == pace.add(4.5, 550) == 400 / 3  # a count seen again, or older: no new point
    assert pace.rate == 400 / 3


def test_a_summary_is_strict_json_with_a_reason_for_every_missing_figure():
    import json

    from diloco.cli.local.summary import strict

    summary = {"eval_loss_final": None, "goodput": float("nan"), "tokens": 10,
               "learners": [{"id": "L0", "tokens_per_s": float("inf")}]}
    cleaned = strict(summary, {"eval_loss_final": "the final model could not be exported: gone"})
    json.dumps(cleaned, allow_nan=False)  # would raise on NaN or Infinity
    assert cleaned["goodput"] is None and cleaned["learners"][0]["tokens_per_s"] is None and cleaned["tokens"] == 10
    assert cleaned["missing"] == {"eval_loss_final": "the final model could not be exported: gone",
                                  "goodput": "not measured (nan)", "learners[0].tokens_per_s": "not measured (inf)"}


def test_what_fails_a_run_and_what_does_not():
    from diloco.cli.local.summary import run_failures

    learners = [{"id": "L0", "state": "left", "inner_steps": 10, "reason": "finished"},
                {"id": "L1", "state": "failed", "inner_steps": 0, "reason": "failed to start: boom"},
                {"id": "L2", "state": "failed", "inner_steps": 0, "reason": "process ended: killed by SIGKILL"},
                {"id": "L3", "state": "failed", "inner_steps": 4, "reason": "the loss is nan"},
                {"id": "L4", "state": "interrupted", "inner_steps": 0, "reason": ""}]
    summary = {"learners": learners, "launches_failed": [{"launch_id": "ab12", "detail": "exit code 2: bad flag"}],
               "tokens": 100}
    # L2 was killed by chaos (no failure of the run), L3 failed while training (shown, not fatal).
    assert run_failures(summary, killed={"L2"}) == [
        "learner L1 failed before training: failed to start: boom", "launch ab12 ended before joining: exit code 2: bad flag"]
    assert run_failures({**summary, "learners": learners[:1], "launches_failed": [], "tokens": 0}, set()) == [
        "no token was trained"]


def test_failures_are_reported_once_each_with_their_reason_cut():
    from diloco.cli.local.progress import REASON_CHARS, Failures, shown_state

    failures = Failures(Path("runs/a"))
    members = [{"id": "L0", "state": "active", "reason": ""}, {"id": "L1", "state": "failed", "reason": "x" * 500},
               {"id": "L2", "state": "failed", "reason": "ValueError at inner step 3: no", "launch_id": "ef"}]
    launches = [{"launch_id": "ab12", "state": "failed", "detail": "exit code 2"}, {"launch_id": "cd", "state": "launching"}]
    lines = failures.new(members, launches)
    assert lines == [f"learner L1 failed: {'x' * (REASON_CHARS - 1)}…",  # (joined by itself: no log of the run's)
                     "learner L2 failed: ValueError at inner step 3: no (log: runs/a/logs/L2.log)",
                     "launch ab12 failed: exit code 2"]
    assert failures.new(members, launches) == []  # each once
    assert shown_state(members[1]).startswith("failed: xxx") and shown_state(members[0]) == "active"


def test_curve_marks_split_the_budget_into_equal_shares():
    assert curve_marks(800, 8) == [100, 200, 300, 400, 500, 600, 700]
    assert curve_marks(16, 8) == [2, 4, 6, 8, 10, 12, 14]
    assert curve_marks(3, 8) == [1, 2]  # fewer units than shares: each mark once, none at 0
    assert curve_marks(800, 1) == curve_marks(800, 0) == []


def test_the_eval_curve_evaluates_every_saved_model_in_token_order_with_one_task(tmp_path):
    import torch
    from safetensors.torch import save_file

    from diloco.config import RunConfig
    from diloco.task import evaluate
    from diloco.cli.metrics import eval_curve, supervisor_task

    run = RunConfig(task_options={"width": "16", "depth": "1", "heads": "2", "context": "16", "eval_batches": "2"})
    task = supervisor_task(run, 1)
    initial = {k: v.clone() for k, v in task.model.state_dict().items()}
    shrunk = {k: v * 0.5 for k, v in initial.items()}
    # Saved out of order and in both formats (Decoupled exports safetensors, the baselines torch.save).
    (tmp_path / "curve").mkdir()
    save_file(shrunk, str(curve_path(tmp_path, 2000)))
    torch.save(initial, curve_path(tmp_path, 1000, ".pt"))
    (tmp_path / "curve" / ".tokens-000000000003000.safetensors.tmp").write_bytes(b"half-written")
    curve = eval_curve(run, task, tmp_path, 8.5, (3000, 1.25))
    task.model.load_state_dict(shrunk)
    assert curve == [[0, 8.5], [1000, pytest.approx(evaluate(run.task, supervisor_task(run, 1)), abs=1e-4)],
                     [2000, pytest.approx(evaluate(run.task, task), abs=1e-4)], [3000, 1.25]]
    assert curve[1][1] != curve[2][1]



def test_the_prometheus_targets_file_lists_the_live_processes_as_they_listed_themselves(tmp_path):
    with pytest.raises(InvalidArgument, match="--prometheus with emulated sites"):
        LocalConfig(prometheus=True, link_mbit=10)
    ended = subprocess.Popen(["true"])
    ended.wait()
    cluster = Cluster(LocalConfig(prometheus=True), tmp_path, learner_steps=1)
    members = [{"id": "L0", "address": f"127.0.0.1:{os.getpid()}"},  # serving
               {"id": "L1", "address": f"127.0.0.1:{ended.pid}"},  # listed itself, then ended (killed)
               {"id": "L2", "address": f"127.0.0.1:{os.getpid()}"}]  # alive, not serving yet

    def serve(learner_id: str, port: int) -> list[dict]:
        name, groups = prometheus_target("learner", "127.0.0.1", port, learner_id=learner_id)
        atomic_write(tmp_path / "prometheus" / name, json.dumps(groups))
        return groups

    l0, _ = serve("L0", 9100), serve("L1", 9101)
    cluster.note_learners(members)
    assert json.loads((tmp_path / PROMETHEUS_TARGETS).read_text()) == l0
    l2 = serve("L2", 9102)
    cluster.note_learners(members)
    assert json.loads((tmp_path / PROMETHEUS_TARGETS).read_text()) == l0 + l2


def test_a_directory_flag_that_cannot_be_made_is_one_line_naming_it_and_why_before_anything_starts(tmp_path):
    """--out (or --snapshot-dir, --tensorboard) under a file, or where the OS refuses to
    make a directory: the flag, the path and the OS's reason, exit 2, nothing made."""
    (tmp_path / "file").write_text("")
    under_file, in_proc = tmp_path / "file" / "run", Path("/proc/diloco-none/run")
    for flags, flag, path, reason in (
            (["--out", str(under_file)], "--out", under_file, "Not a directory"),
            (["--out", str(in_proc)], "--out", in_proc, "/proc/diloco-none: No such file or directory"),
            (["--out", str(tmp_path / "run"), "--snapshot-dir", str(under_file)], "--snapshot-dir", under_file,
             "Not a directory"),
            (["--out", str(tmp_path / "run"), "--tensorboard", str(under_file)], "--tensorboard", under_file,
             "Not a directory")):
        proc = subprocess.run([sys.executable, "-m", "diloco", "local", *flags], capture_output=True, text=True,
                              timeout=120)
        assert (proc.returncode, proc.stderr) == (2, f"diloco: error: {flag} {path} cannot be used: {reason}\n"), flags
        assert not (tmp_path / "run").exists() and not in_proc.parent.exists()


def _failing_run(out: Path, monkeypatch):
    """A diloco local run of a small task whose cluster cannot be made (as when the
    emulated sites' hub is refused): it fails after its directory was written, before any
    process started."""
    from diloco.cli.local import run as local_run
    from diloco.config import RunConfig
    from diloco.errors import FailedPrecondition

    def refused(*args, **kwargs):
        raise FailedPrecondition("ip link add dl1br type bridge: RTNETLINK answers: Operation not permitted")

    monkeypatch.setattr(local_run, "Cluster", refused)
    task = f"{Path(__file__).resolve().parents[1] / 'tasks' / 'faulty.py'}:build"
    cfg = LocalConfig(run=RunConfig(task=task), learners=1, shards=1, steps=2, out=out, curve_points=0)
    with pytest.raises(FailedPrecondition, match="Operation not permitted"):
        local_run.run_local(cfg)


def test_a_run_that_fails_before_any_process_started_leaves_nothing_behind(tmp_path, monkeypatch):
    """So the same --out works once the cause is fixed: the directories the run made are
    gone, and an empty directory the user gave stays, empty, with its mode."""
    _failing_run(tmp_path / "new" / "run", monkeypatch)
    assert list(tmp_path.iterdir()) == []
    given = tmp_path / "given"
    given.mkdir(mode=0o755)
    os.chmod(given, 0o755)
    _failing_run(given, monkeypatch)
    assert list(given.iterdir()) == [] and oct(given.stat().st_mode & 0o777) == oct(0o755)


def test_a_model_too_small_for_its_fragments_and_shards_is_told_everything_at_once(tmp_path):
    """The small task has 4 tensors of 34 rows in all (a fragment holds whole rows): 40
    fragments over 50 shards failed first for the shards, then, fixed, for the fragments,
    neither error naming the flags. Now one line says both and values that work; they do."""
    import torch

    from diloco.config import RunConfig
    from diloco.manifest import manifest_of

    task = f"{Path(__file__).resolve().parents[1] / 'tasks' / 'faulty.py'}:build"
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "diloco", "local", "--task", task, "--fragments", "40", "--shards", "50",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, (
        "diloco: error: the model cannot be cut into 40 fragments: a fragment holds whole rows (dim 0) of tensors and the "
        "model's 4 tensors have 34 rows in all; 50 shards for at most 34 fragments: some shard would own none: give "
        "--fragments 34 or fewer and --shards 34 or fewer (a shard owns one fragment or more)\n")), proc.stderr
    assert not out.exists()
    with pytest.raises(InvalidArgument, match=re.escape("3 shards for 2 fragments: some shard would own none: give "
                                                        "--shards 2 or fewer")):
        LocalConfig(run=RunConfig(fragments=2), shards=3).check_cut(4, 34)
    with pytest.raises(InvalidArgument, match=re.escape("34 rows in all: give --fragments 34 or fewer (a shard")):
        LocalConfig(run=RunConfig(fragments=35), shards=2).check_cut(4, 34)
    manifest = manifest_of(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
    assert (len(manifest.synced), manifest.max_fragments()) == (4, 34)
    LocalConfig(run=RunConfig(fragments=34), shards=34).check_cut(4, 34)  # what the error offered works
    assert manifest.plan(34).num_fragments == 34


def test_endpoints_json_gets_a_process_whose_first_write_was_interrupted(tmp_path, monkeypatch):
    """A Ctrl-C can land while endpoints.json is being written (the watch notes a learner as
    it joins): the process must still reach the file when the stop notes it again. Before,
    it was kept in memory as written and the stop skipped it: a CI run's endpoints.json
    missed a learner of the run."""
    from diloco.cli.local import supervisor
    from diloco.cli.local.config import LocalConfig

    cluster = supervisor.Cluster(LocalConfig(), tmp_path, 10)
    real = supervisor.atomic_write
    interrupted = []

    def write_once_interrupted(path, data):
        if not interrupted:
            interrupted.append(path)
            raise KeyboardInterrupt
        real(path, data)

    monkeypatch.setattr(supervisor, "atomic_write", write_once_interrupted)
    member = {"id": "L1", "address": "host:4242", "state": "active", "launch_id": "x"}
    with pytest.raises(KeyboardInterrupt):
        cluster.note_learners([member])
    cluster.note_learners([member])  # the stop's listing
    assert [(e["role"], e.get("id"), e["pid"]) for e in json.loads((tmp_path / "endpoints.json").read_text())] == \
        [("learner", "L1", 4242)]


def test_a_move_skips_a_learner_that_left_since_the_listing(monkeypatch, tmp_path):
    """The allotments are moved from a listing a moment old: a learner that left since is
    refused by the coordinator ("already gone") and the move goes to the others."""
    from diloco.errors import FailedPrecondition

    clock, budget, admin, member = _budget_after_a_drain(monkeypatch, tmp_path)

    def remove_learners(ids, drain, after_tokens):
        if "L1" in ids:
            raise FailedPrecondition("already gone: L1")
        admin.calls.append(dict(after_tokens))

    admin.remove_learners = remove_learners
    admin.members = lambda: [member("L0", 17_000, "left"), member("L1", 20_000, "left"), member("L2", 15_000)]
    budget.spend(0, [member("L0", 17_000, "left"), member("L1", 15_000), member("L2", 15_000)], admin, None)
    assert admin.calls[1] == {"L2": 20_000 + 1_500}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_python_dropped_in_a_finalizer_is_raised_again():
    """A SIGTERM whose handler runs inside a finalizer: Python prints and drops the
    KeyboardInterrupt ("Exception ignored in ..."), and the watch loop raises it again
    (``Arrivals.raise_if_lost``) instead of training on to the time limit."""
    import signal
    import threading

    from diloco.cli.local.run import _interrupts

    assert threading.current_thread() is threading.main_thread(), "signal handlers run in the main thread only"

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100_000):  # Python code: the handler runs in here, and its raise is dropped
                pass

    with _interrupts() as arrived:
        arrived.raise_if_lost()  # nothing raised yet: nothing to raise again
        Finalized()
        assert arrived.raised == 1 and arrived.first is not None
        with pytest.raises(KeyboardInterrupt):
            arrived.raise_if_lost()
