"""A stopped `diloco local` run continues with --resume: SIGTERM mid-run takes a snapshot,
--resume restarts the coordinator and shards from it and gives every learner the stop
interrupted, a learner added with `diloco admin add-learners` included, a successor that
trains the steps it had left, with the stored config: each trains its plan exactly. The
whole run replays bit for bit, and its curves (and TensorBoard's) go on on one axis. A
live run directory, a changed config and a finished run are refused, each with its
reason."""

import json
import signal
import subprocess
import sys

import pytest

from tests.cluster.tables import assert_final_table_agrees
from tests.polling import poll
from tests.unit.test_curves import scalars

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--batch-size", "4", "--fragments", "4",
        "--sync-every", "8"]
STEPS = 3000
ADDED_STEPS = 1000
"""The planned steps of the learner added mid-run (``add-learners --set steps=...``)."""


def diloco(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=timeout)



def trained(out, learner: str | None = None) -> int:
    """Tokens the run's learners (or ``learner``) reported (0 while its coordinator is not
    up): asked in process, so the stop comes early in a run this tiny."""
    from diloco.clients.coordinator import AdminClient
    from diloco.errors import DilocoError

    try:
        endpoints = json.loads((out / "endpoints.json").read_text())
        token = (out / "admin-token").read_text().strip()
    except (OSError, ValueError):
        return 0
    address = next((e["address"] for e in endpoints if e["role"] == "coordinator"), None)
    if address is None:
        return 0
    client = AdminClient(address, token, timeout_s=5)
    try:
        return sum(m["tokens"] for m in client.members() if learner in (None, m["id"]))
    except DilocoError:
        return 0
    finally:
        client.close()


def test_a_stopped_run_resumes_from_its_snapshot_and_replays_whole(tmp_path, capsys):
    from diloco import command as cli

    out, board = tmp_path / "run", tmp_path / "board"
    first = subprocess.Popen(
        [sys.executable, "-m", "diloco", "local", "--insecure", "--learners", "2", "--shards", "2",
         "--steps", str(STEPS), "--out", str(out), "--tensorboard", str(board), "--json", *TINY],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        poll(lambda: trained(out) >= 2 * 200 * 128, "200 steps each", 180)
        assert cli.main(["local", "--resume", str(out)]) == 2  # a second supervisor on the live run
        assert f"{out} is in use by a live diloco local (pid {first.pid})" in capsys.readouterr().err
        assert cli.main(["admin", "--run-dir", str(out), "add-learners", "1", "--set", f"steps={ADDED_STEPS}",
                         "--wait-s", "120"]) == 0
        poll(lambda: trained(out, "L2") >= 20 * 128, "the added learner's 20 steps", 180)
        first.send_signal(signal.SIGTERM)
        stdout, stderr = first.communicate(timeout=180)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, stderr[-3000:]
    stopped = json.loads(stdout)
    assert_final_table_agrees(stderr, stopped)
    assert stopped["interrupted"] and stopped["snapshot_at_stop"] is not None, stopped
    assert sorted(l["id"] for l in stopped["learners"]) == ["L0", "L1", "L2"]
    # Stopped first, while the shards served: each wrote its summary, none was killed.
    assert {l["state"] for l in stopped["learners"]} == {"interrupted"}
    assert sorted(p.name for p in (out / "learners").glob("*.json")) == ["L0.json", "L1.json", "L2.json"]
    plan = {"L0": STEPS, "L1": STEPS, "L2": ADDED_STEPS}
    done = {l["id"]: l["inner_steps"] for l in stopped["learners"]}
    assert all(0 < done[i] < plan[i] for i in plan), done
    left = sorted(plan[i] - done[i] for i in plan)
    assert f"--resume {out}` continues the run" in stderr

    changed = diloco("local", "--resume", str(out), "--shards", "1", "--width", "64")
    assert changed.returncode == 2 and "shards 1 (the run has 2)" in changed.stderr and "width" in changed.stderr
    assert not (out / "resumes.jsonl").exists()  # refused before anything was touched

    resumed = diloco("local", "--resume", str(out), "--tensorboard", str(board), "--json", timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert_final_table_agrees(resumed.stderr, summary)
    assert summary["resumed_from_snapshot"] == stopped["snapshot_at_stop"] and not summary["interrupted"]
    [resume] = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert resume["learners"] == 3 and sorted(resume["launches"]) == left  # each stopped learner's steps left
    steps = {l["id"]: l["inner_steps"] for l in summary["learners"]}
    assert sorted(steps) == ["L0", "L1", "L2", "L3", "L4", "L5"], steps
    assert sorted(steps[i] for i in ("L3", "L4", "L5")) == left, (steps, done)
    # Every learner's plan, the added one's included, trained exactly: the whole run's steps and tokens.
    assert sum(steps.values()) == sum(plan.values())
    assert summary["tokens"] == sum(plan.values()) * 4 * 32
    # The resumed learners started from the snapshot's model, not the initial one: they
    # bootstrapped every fragment at a version the stopped run had reached (so they skip
    # the evaluation at step 0), their first evaluation is already far below the start, and
    # the versions went on.
    for learner in ("L3", "L4", "L5"):
        records = [json.loads(line) for line in (out / "learners" / f"{learner}.events.jsonl").read_text().splitlines()]
        [bootstrapped] = [r["versions"] for r in records if r["kind"] == "bootstrapped"]
        assert bootstrapped.keys() == stopped["final_versions"].keys() and all(v > 0 for v in bootstrapped.values())
        first_eval = next(r for r in records if r["kind"] == "eval")
        assert first_eval["step"] > 0, first_eval
        assert first_eval["loss"] < (stopped["eval_loss_start"] + stopped["eval_loss_final"]) / 2, (learner, first_eval, stopped)
    assert stopped["final_versions"] and summary["final_versions"].keys() == stopped["final_versions"].keys()
    assert all(summary["final_versions"][f] > v for f, v in stopped["final_versions"].items())
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 2
    assert 0 < summary["goodput"] <= 1
    # The curves of both parts on one axis of the run's tokens: the resume where the stopped
    # run ended, the resumed learners' points past it, a final model for each part.
    records = [json.loads(line) for line in (out / "curves.jsonl").read_text().splitlines()]
    [mark] = [r for r in records if r["series"] == "resume"]
    assert mark["tokens"] == stopped["tokens"] and mark["snapshot"] == stopped["snapshot_at_stop"]
    train = [r for r in records if r["series"] == "train"]
    assert {r["learner"] for r in train} == {"L0", "L1", "L2", "L3", "L4", "L5"}
    assert all(r["tokens"] > stopped["tokens"] for r in train if r["learner"] in ("L3", "L4", "L5"))
    glob = [r for r in records if r["series"] == "global_eval"]
    assert [r["tokens"] for r in glob if r["model"] == "final"] == [stopped["tokens"], summary["tokens"]]
    assert glob[0]["model"] == "seed" and summary["curve"] == [[r["tokens"], round(r["loss"], 4)] for r in glob]
    # Each part wrote its own points to the same TensorBoard directory: every point once.
    tensorboard = scalars(board)
    assert tensorboard["global/eval_loss"] == [(r["tokens"], pytest.approx(r["loss"], rel=1e-6)) for r in glob]
    assert [step for step, _ in tensorboard["train/loss/L3"]] == [r["tokens"] for r in train if r["learner"] == "L3"]

    replay = diloco("replay", str(out), "--check")
    assert replay.returncode == 0 and "max absolute difference from the run's final global parameters: 0" in replay.stdout, \
        replay.stdout + replay.stderr
    again = diloco("local", "--resume", str(out))
    assert again.returncode == 2 and "that run finished" in again.stderr
