"""A real `diloco local` run's loss curves: curves.jsonl has every learner's training
loss and evals and the global model's evals on the run's tokens, loss.png is drawn, and
--tensorboard writes the same values where TensorBoard's own reader finds them."""

import json
import subprocess
import sys

import pytest

from tests.cluster.test_local import TINY
from tests.unit.test_curves import scalars

pytestmark = pytest.mark.cluster

STEPS = 600  # a few seconds of training: the supervisor, which looks every second, passes curve marks


def test_local_writes_its_curves_and_the_same_values_to_tensorboard(tmp_path):
    out, board = tmp_path / "run", tmp_path / "board"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "local", "--insecure", "--learners", "2", "--shards", "2", "--steps",
         str(STEPS), "--batch-size", "8", "--curve-points", "4", "--tensorboard", str(board), "--out", str(out),
         "--json", *TINY],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    records = [json.loads(line) for line in (out / "curves.jsonl").read_text().splitlines()]
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    for learner in ("L0", "L1"):
        train = [r for r in records if r["series"] == "train" and r["learner"] == learner]
        assert [r["step"] for r in train] == list(range(10, STEPS + 1, 10))  # every --train-loss-every steps
        assert [r["learner_tokens"] for r in train] == [step * 8 * 32 for step in range(10, STEPS + 1, 10)]
        run_tokens = [r["tokens"] for r in train]
        assert run_tokens == sorted(run_tokens) and len(set(run_tokens)) == len(run_tokens), run_tokens
        # The run's tokens count the other learner's too: past this one's own, within the whole run's.
        assert all(r["learner_tokens"] <= r["tokens"] <= summary["tokens"] for r in train)
        assert train[-1]["loss"] < train[0]["loss"] - 1, train  # bits/byte, like the evals
        assert train[0]["unit"] == "bits/byte" and all(r["tokens_per_s"] > 0 for r in train)
        evals = [r for r in records if r["series"] == "eval" and r["learner"] == learner]
        assert evals and evals[-1]["learner_tokens"] == STEPS * 8 * 32 and evals[-1]["loss"] < 6
    glob = [r for r in records if r["series"] == "global_eval"]
    models = [r["model"] for r in glob]
    assert models[0] == "seed" and models[-1] == "final" and "curve" in models, models
    assert glob[0]["tokens"] == 0 and glob[0]["versions"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    assert glob[-1]["tokens"] == summary["tokens"] and glob[-1]["versions"] == summary["final_versions"]
    assert round(glob[0]["loss"], 4) == summary["eval_loss_start"] and round(glob[-1]["loss"], 4) == summary["eval_loss_final"]
    for point in glob[1:-1]:  # exported mid-run: between the seed and the final model in tokens and versions
        assert 0 < point["tokens"] < summary["tokens"], point
        assert point["versions"].keys() == summary["final_versions"].keys()
        assert 0 < sum(point["versions"].values()) < sum(summary["final_versions"].values()), point
    assert [r["tokens"] for r in glob] == sorted(r["tokens"] for r in glob)
    assert glob[-1]["loss"] < glob[0]["loss"] - 1
    assert summary["curve"] == [[r["tokens"], round(r["loss"], 4)] for r in glob]
    assert (out / "loss.png").stat().st_size > 20_000

    tensorboard = scalars(board)
    for tag, series, key, learner in (("train/loss/L0", "train", "loss", "L0"), ("train/loss/L1", "train", "loss", "L1"),
                                      ("train/tokens_per_s/L1", "train", "tokens_per_s", "L1"),
                                      ("eval/loss/L0", "eval", "loss", "L0"), ("global/eval_loss", "global_eval", "loss", None)):
        expected = [(r["tokens"], pytest.approx(r[key], rel=1e-6)) for r in records
                    if r["series"] == series and r.get("learner") == learner]
        assert expected and tensorboard[tag] == expected, tag
