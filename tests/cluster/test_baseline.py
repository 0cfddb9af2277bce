"""The baselines end to end, as a user runs them: real worker processes, a run directory,
a summary, and nothing left running afterwards."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from diloco.lab.baseline.common import SUMMARY_KEYS
from diloco.tasks.byte_gpt import GPT, ModelConfig

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32"]
WORKERS, STEPS, BATCH, CONTEXT = 2, 24, 16, 32


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco", "baseline", *args, "--json"],
                          capture_output=True, text=True, timeout=timeout)


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args and "pytest" not in args:
            found.append(args)
    return found


def _dp(out: Path, *extra: str) -> dict:
    proc = _run("dp", "--workers", str(WORKERS), "--steps", str(STEPS), "--batch-size", str(BATCH),
                "--checkpoint-every", "5", "--out", str(out), *TINY, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary == json.loads((out / "summary.json").read_text())
    assert not _processes_mentioning(str(out))
    return summary


@pytest.fixture(scope="module")
def dp_clean(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("dp") / "clean"
    return out, _dp(out)


def test_dp_trains_and_counts_tokens_and_bytes(dp_clean):
    out, summary = dp_clean
    assert list(summary) == list(SUMMARY_KEYS)
    assert summary["eval_unit"] == "bits/byte"
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 1.0
    assert summary["tokens"] == WORKERS * STEPS * BATCH * CONTEXT
    assert (summary["restarts"], summary["steps"]) == (0, STEPS)
    assert 0 < summary["goodput"] <= 1 and 0 < summary["uptime"] <= 1
    # A ring all-reduce of every fp32 gradient (and the loss) per step: 2(M-1) buffers.
    params = sum(p.numel() for p in GPT(ModelConfig(width=32, depth=1, heads=2, context=32)).parameters())
    per_step = 2 * (WORKERS - 1) * (params + 1) * 4
    assert summary["bytes_per_1k_tokens"] == pytest.approx(1000 * per_step / (WORKERS * BATCH * CONTEXT), abs=0.1)
    assert (out / "model.pt").exists() and (out / "checkpoint.pt").exists()
    assert {p.name for p in (out / "logs").iterdir()} == {f"worker{i}.log" for i in range(WORKERS)}


def test_dp_kill_stalls_everyone_and_restarts_all_from_the_checkpoint(dp_clean, tmp_path):
    out = tmp_path / "killed"
    summary = _dp(out, "--kill-at-step", "12")
    assert summary["restarts"] == 1
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["kind"] for e in events] == ["launch", "kill", "failure", "launch", "done"]
    assert len(events[3]["pids"]) == WORKERS  # every worker was restarted, not just the dead one
    stats = json.loads((out / "stats.json").read_text())
    (restart,) = stats["restarts_detail"]
    resumed = restart["resumed_from_step"]  # the newest checkpoint (every 5 steps) before the kill
    assert resumed % 5 == 0 and 10 <= resumed <= restart["failed_at_step"] and restart["restart_s"] > 0
    assert stats["steps_lost"] == restart["failed_at_step"] - resumed
    last = (out / "timeline" / "attempt-1.jsonl").read_text().splitlines()
    assert json.loads(last[-2])["step"] == STEPS  # the last step, then "done"
    assert summary["uptime"] < 1 and summary["global_stall_s"] > 0 and summary["goodput"] < 1
    assert summary["tokens"] == WORKERS * STEPS * BATCH * CONTEXT
    # Restarting from a checkpoint replays the same steps on the same data: the final
    # model is bit-for-bit the one the run without faults produced.
    clean, killed = (torch.load(d / "model.pt", weights_only=True) for d in (dp_clean[0], out))
    assert clean and clean.keys() == killed.keys()
    assert all(torch.equal(clean[k], killed[k]) for k in clean)


def test_torchft_peer_survives_a_killed_replica(tmp_path):
    pytest.importorskip("torchft", reason="torchft is an optional extra: pip install 'diloco[peers]'")
    out = tmp_path / "ft"
    steps = 32
    proc = _run("torchft", "--workers", "2", "--steps", str(steps), "--batch-size", str(BATCH), "--out", str(out),
                "--fragments", "4", "--sync-every", "8", "--kill-at-step", "10", *TINY, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert set(summary) == set(SUMMARY_KEYS)
    assert summary["restarts"] == 1 and summary["tokens"] == 2 * steps * BATCH * CONTEXT
    assert summary["eval_unit"] == "bits/byte"
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 1.0
    stats = json.loads((out / "stats.json").read_text())
    # The replacement either healed from the survivor or, if that one had already finished,
    # trained alone from the seeded model, work the metrics count as lost.
    assert stats["commits"] > 0 and stats["heals"] + stats["off_model_commits"] >= 1
    assert any((out / "timeline" / f"replica{i}-attempt1.jsonl").exists() for i in range(2))
    assert 0 < summary["bytes_per_1k_tokens"] and 0 < summary["goodput"] < 1
    assert not _processes_mentioning(str(out))


REGRESSION_TASK = textwrap.dedent("""
    import torch

    from diloco.task import Task

    def build(ctx):
        hidden = ctx.option("hidden", 8, int)
        torch.manual_seed(ctx.seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
        truth = torch.randn(4, 1, generator=torch.Generator().manual_seed(1234))

        def batches():
            g = torch.Generator().manual_seed(1000 * ctx.seed + ctx.learner_index)
            while True:
                x = torch.randn(32, 4, generator=g)
                yield x, torch.tanh(x @ truth)

        def loss(model, batch):
            x, y = batch
            return ((model(x) - y) ** 2).mean()

        held_out = torch.Generator().manual_seed(99)
        eval_x = [torch.randn(64, 4, generator=held_out) for _ in range(2)]
        return Task(model=model, batches=batches(), loss=loss, tokens=lambda batch: len(batch[0]),
                    eval_batches=[(x, torch.tanh(x @ truth)) for x in eval_x],
                    optimizer=lambda params: torch.optim.Adam(params, lr=0.03), eval_unit="mse")
""")


def test_dp_trains_a_custom_task_with_its_own_loss_and_unit(tmp_path):
    task = tmp_path / "regression.py"
    task.write_text(REGRESSION_TASK)
    out, steps = tmp_path / "dp-mlp", 30
    proc = _run("dp", "--workers", "2", "--steps", str(steps), "--checkpoint-every", "10", "--out", str(out),
                "--task", f"{task}:build", "--task-option", "hidden=16", "--seed", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert list(summary) == list(SUMMARY_KEYS)
    assert summary["eval_unit"] == "mse"
    assert summary["eval_loss_final"] < summary["eval_loss_start"] / 2
    assert summary["tokens"] == 2 * steps * 32 and summary["steps"] == steps and summary["restarts"] == 0
    # The buffer is the MLP's gradients (4x16 + 16 + 16x1 + 1) plus the loss, all-reduced once a step.
    params = 4 * 16 + 16 + 16 + 1
    assert summary["bytes_per_1k_tokens"] == pytest.approx(1000 * 2 * (params + 1) * 4 / (2 * 32), abs=0.1)
    assert set(torch.load(out / "model.pt", weights_only=True)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert not _processes_mentioning(str(out))
