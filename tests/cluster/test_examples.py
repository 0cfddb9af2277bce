"""The examples trained end to end by ``diloco local --task``: models the project does not
know (tied weights, buffers, their own loss, data and optimizer) reach a lower eval loss,
and the exported ``model.safetensors`` loads into a fresh instance with
``load_state_dict`` and reproduces the run's final eval loss. A task that fails on one
learner ends that learner with one line; the run finishes with the others."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diloco.task import TaskContext, build_task, evaluate

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--learners", "2", "--shards", "2", "--fragments", "4", "--sync-every", "8"]
GPT = ["--task-option", "width=32", "--task-option", "depth=1", "--task-option", "heads=2",
       "--task-option", "context=32", "--task-option", "batch_size=8"]


def local(out: Path, task: str, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "local", "--task", task, *RUN, "--out", str(out), *extra],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("example, steps, options, unit", [
    ("tied_lm", 60, [], "loss"),
    # 120: at 60 steps its eval fell by 0.58-0.69 alone here, but by 0.21 and 0.25 in two
    # CI runs (c470802): a 6 s asynchronous run under the other worker's load. At 120 it
    # falls by about 1.0.
    ("cnn_bn", 120, [], "loss"),
    ("byte_gpt", 48, GPT, "bits/byte"),
])
def test_an_example_trains_and_its_export_reproduces_the_eval_loss(tmp_path, example, steps, options, unit):
    task = f"examples/{example}.py:build"
    summary = local(tmp_path / "run", task, "--steps", str(steps), *options)
    assert summary["task"] == f"{ROOT / 'examples' / example}.py:build" and summary["eval_unit"] == unit
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 0.3, summary
    assert summary["learners_failed"] == 0 and summary["rounds"] > 0
    state = load_file(str(tmp_path / "run" / "model.safetensors"))
    opts = dict(o.split("=", 1) for o in options[1::2])
    fresh = build_task(str(ROOT / task), TaskContext(0, 2, 0, torch.device("cpu"), opts))
    assert set(state) == set(fresh.model.state_dict())
    fresh.model.load_state_dict(state)  # strict: every key, every shape
    assert evaluate(task, fresh) == pytest.approx(summary["eval_loss_final"], abs=1e-4)
    if example == "tied_lm":
        assert torch.equal(state["head.weight"], state["embed.weight"])
        assert state["hidden_rms"] != 1.0  # a synced float buffer: the learners' mean
        assert state["batches_seen"].dtype == torch.int64
    if example == "cnn_bn":
        assert not torch.allclose(state["features.1.running_var"], torch.ones(8))
    replay = subprocess.run([sys.executable, "-m", "diloco", "replay", str(tmp_path / "run"), "--check"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert replay.returncode == 0 and "difference from the run's final global parameters: 0" in replay.stdout, replay.stdout


def test_a_task_failing_on_one_learner_ends_it_with_one_line_and_the_run_goes_on(tmp_path):
    out = tmp_path / "run"
    summary = local(out, "tests/tasks/faulty.py:build", "--steps", "40", "--task-option", "fail=nan")
    by_id = {m["id"]: m for m in summary["learners"]}
    assert by_id["L0"]["inner_steps"] == 40 and by_id["L1"]["inner_steps"] < 40
    # Failed while training (not before): counted and shown with why; the run's exit stays 0.
    assert by_id["L1"]["state"] == "failed" and "the loss is nan at inner step 3" in by_id["L1"]["reason"]
    assert summary["learners_failed"] == 1 and summary["failures"] == []
    assert summary["eval_unit"] == "mse" and summary["eval_loss_final"] < summary["eval_loss_start"]
    logs = {p.read_text() for p in (out / "coordinator" / "learners").glob("*.log")}
    failed = [text for text in logs if "diloco: error:" in text]
    assert len(failed) == 1, logs
    (line,) = [l for l in failed[0].splitlines() if "diloco: error:" in l]
    assert "tests/tasks/faulty.py:build" in line and "the loss is nan at inner step 3" in line
    assert "Traceback" not in failed[0]


def test_a_run_starts_from_an_export_with_init(tmp_path):
    first = local(tmp_path / "first", "examples/tied_lm.py:build", "--steps", "30")
    export = tmp_path / "first" / "model.safetensors"
    second = local(tmp_path / "second", "examples/tied_lm.py:build", "--steps", "10", "--init", str(export))
    # The second run's initial global model is the first run's final one.
    assert second["eval_loss_start"] == pytest.approx(first["eval_loss_final"], abs=1e-4)
    assert json.loads((tmp_path / "second" / "run.json").read_text())["init"] == str(export.resolve())
