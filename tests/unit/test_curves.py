"""The loss curves of diloco local: the run's tokens at a moment, curves.jsonl from a run
directory (a resumed one too), loss.png, the TensorBoard files and --tensorboard's checks."""

import json
import math
import re
import subprocess
import sys

import pytest

from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.tape import TapeWriter
from diloco.cli.local.curves import check_tensorboard, record_global_evals, write_curves, write_tensorboard
from diloco.cli.local.plots import plot_loss
from diloco.cli.metrics import learner_events, run_tokens

T0 = 1_800_000_000.0
SCALE = 1 / math.log(2)  # the byte GPT's: nats per byte to bits per byte


def learner(t0: float, steps: int, tokens_per_step: int = 100, step_s: float = 1.0, every: int = 10) -> list[dict]:
    """A learner's event tape: it computes from ``t0``, a train event every ``every`` steps
    (loss falling), an eval every 20 and at its last step, then leaves."""
    tape = [{"kind": "state", "t": t0 - 2, "state": "starting"}, {"kind": "state", "t": t0, "state": "computing", "step": 0}]
    for step in range(every, steps + 1, every):
        t, tokens = t0 + step * step_s, step * tokens_per_step
        tape.append({"kind": "train", "t": t, "step": step, "tokens": tokens, "loss": round(5.0 / (1 + step / 50) * SCALE, 5),
                     "unit": "bits/byte", "tokens_per_s": tokens_per_step / step_s})
        if step % 20 == 0 or step == steps:
            tape.append({"kind": "eval", "t": t + 0.1, "step": step, "tokens": tokens, "loss": 7.0 / (1 + step / 50),
                         "unit": "bits/byte"})
    tape.append({"kind": "state", "t": t0 + steps * step_s + 0.5, "state": "left", "step": steps})
    return tape


def test_run_tokens_sum_every_learner_s_own_count_linear_between_its_events():
    events = {"L0": learner(T0, 40), "L1": learner(T0 + 5, 40, tokens_per_step=50)}
    at = run_tokens(events)
    assert at(T0 - 10) == 0  # before anyone computes
    assert at(T0) == 0  # L0 starts computing: 0 tokens then, not its first event's count
    assert at(T0 + 5) == 500  # L0 halfway to its first train event (1000 at 10 s); L1 starting
    assert at(T0 + 10) == 1000 + 250  # L0's event; L1 halfway to 500 at 15 s
    assert run_tokens({"L0": events["L0"]})(T0 + 20.05) == 2000  # its eval at 20.1 s carries 2000 too: flat between
    assert at(T0 + 40) == 4000 + 1750
    assert at(T0 + 1000) == 4000 + 2000  # both gone: their last counts stay
    # A resumed run's learners add to the earlier ones' final counts: the axis continues.
    resumed = {**events, "L2": learner(T0 + 100, 20)}
    assert run_tokens(resumed)(T0 + 100) == 6000 and run_tokens(resumed)(T0 + 110) == 7000
    # A learner that never reported a count (killed while starting) counts 0; so does a run without learners.
    assert run_tokens({"L0": [{"kind": "state", "t": T0, "state": "starting"}]})(T0 + 5) == 0
    assert run_tokens({})(T0) == 0


def resumed_run(tmp_path, learners: int = 2):
    """A run directory as two parts of a run leave it: ``learners`` learners for 40 steps,
    a resume, then as many new ones for 20; the seed, one curve point and a final model
    per part evaluated."""
    run_dir = tmp_path / "run"
    first = {f"L{i}": learner(T0 + i, 40) for i in range(learners)}
    second = {f"L{learners + i}": learner(T0 + 100 + i, 20) for i in range(learners)}
    for name, tape in {**first, **second}.items():
        writer = TapeWriter(run_dir / "learners" / f"{name}.events.jsonl")
        for e in tape:
            writer.append(e["kind"], e["t"], **{k: v for k, v in e.items() if k not in ("kind", "t")})
        writer.close()
    record_global_evals(run_dir, [("seed", T0 - 5, {0: 0, 1: 0}, 8.0), ("curve", T0 + 20, {0: 5, 1: 4}, 6.0),
                                  ("final", T0 + 60, {0: 9, 1: 9}, 4.5)], "bits/byte")
    (run_dir / "resumes.jsonl").write_text(json.dumps({"t": T0 + 90, "snapshot": 3, "learners": learners}) + "\n")
    record_global_evals(run_dir, [("curve", T0 + 111, {0: 12, 1: 11}, 4.0), ("final", T0 + 130, {0: 14, 1: 14}, 3.5)],
                        "bits/byte")
    return run_dir


def test_curves_jsonl_puts_every_series_of_every_part_on_the_run_s_tokens(tmp_path):
    run_dir = resumed_run(tmp_path)
    records = write_curves(run_dir, learner_events(run_dir))
    assert [json.loads(line) for line in (run_dir / "curves.jsonl").read_text().splitlines()] == records
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    train = [r for r in records if r["series"] == "train"]
    assert {r["learner"] for r in train} == {"L0", "L1", "L2", "L3"}
    l0 = [r for r in train if r["learner"] == "L0"]
    assert [r["learner_tokens"] for r in l0] == [1000, 2000, 3000, 4000] and [r["step"] for r in l0] == [10, 20, 30, 40]
    # The run's tokens: L0's own 1000 at T0 + 10, L1 (one second behind) at 900 then.
    assert l0[0]["tokens"] == 1900 and l0[0]["loss"] == round(5.0 / (1 + 10 / 50) * SCALE, 5) and l0[0]["unit"] == "bits/byte"
    assert l0[0]["tokens_per_s"] == 100
    l2 = [r for r in train if r["learner"] == "L2"]  # the resumed part continues from the first part's 8000
    assert [r["tokens"] for r in l2] == [8000 + 1000 + 900, 8000 + 2000 + 1900]
    evals = [r for r in records if r["series"] == "eval" and r["learner"] == "L1"]
    assert [(r["step"], r["learner_tokens"], r["loss"]) for r in evals] == [(20, 2000, 7.0 / (1 + 20 / 50)),
                                                                       (40, 4000, 7.0 / (1 + 40 / 50))]
    glob = [r for r in records if r["series"] == "global_eval"]
    assert [(r["model"], r["tokens"], r["loss"]) for r in glob] == [
        ("seed", 0, 8.0), ("curve", 2000 + 1900, 6.0), ("final", 8000, 4.5), ("curve", 8000 + 1100 + 1000, 4.0),
        ("final", 12000, 3.5)]
    assert glob[1]["versions"] == {"0": 5, "1": 4}
    assert [(r["tokens"], r["snapshot"]) for r in records if r["series"] == "resume"] == [(8000, 3)]


def test_loss_png_is_drawn_for_one_learner_and_for_sixteen_and_a_resumed_run(tmp_path):
    for learners in (1, 16):
        run_dir = resumed_run(tmp_path / str(learners), learners)
        path = plot_loss(run_dir, write_curves(run_dir, learner_events(run_dir)), "bits/byte")
        assert path == run_dir / "loss.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 20_000  # lines, markers and text, not an empty frame
    # A run whose task has no eval batches: the training loss alone.
    run_dir = resumed_run(tmp_path / "train-only")
    (run_dir / "curve" / "evals.jsonl").unlink()
    records = [r for r in write_curves(run_dir, learner_events(run_dir)) if r["series"] != "eval"]
    assert plot_loss(run_dir, records, "loss").stat().st_size > 20_000


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def test_tensorboard_holds_the_curves_and_a_resumed_part_adds_only_its_own(tmp_path):
    run_dir = resumed_run(tmp_path)
    records = write_curves(run_dir, learner_events(run_dir))
    board = tmp_path / "board"
    write_tensorboard(records, board, since=0)  # the first part ...
    first = scalars(board)
    assert sorted(first) == ["eval/loss/L0", "eval/loss/L1", "eval/loss/L2", "eval/loss/L3", "global/eval_loss",
                             "train/loss/L0", "train/loss/L1", "train/loss/L2", "train/loss/L3",
                             "train/tokens_per_s/L0", "train/tokens_per_s/L1", "train/tokens_per_s/L2",
                             "train/tokens_per_s/L3"]

    def points(series, key, learner=None):  # TensorBoard keeps float32
        return [(r["tokens"], pytest.approx(r[key], rel=1e-6)) for r in records
                if r["series"] == series and r.get("learner") == learner]

    assert first["train/loss/L2"] == points("train", "loss", "L2") and len(first["train/loss/L2"]) == 2
    assert first["train/tokens_per_s/L0"] == points("train", "tokens_per_s", "L0")
    assert first["eval/loss/L1"] == points("eval", "loss", "L1")
    assert first["global/eval_loss"] == points("global_eval", "loss") and len(first["global/eval_loss"]) == 5
    board = tmp_path / "parts"
    write_tensorboard([r for r in records if r["t"] < T0 + 90], board, since=0)  # what the first part had recorded
    write_tensorboard(records, board, since=T0 + 90)  # the resumed part, into the same directory
    assert scalars(board) == first  # every point once


def test_tensorboard_dir_is_checked_before_anything_starts(tmp_path, monkeypatch):
    check_tensorboard(tmp_path / "new" / "board")
    assert not (tmp_path / "new").exists()  # made when the run writes it: a run refused later leaves nothing
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgument, match=re.escape(f"--tensorboard {tmp_path / 'file'} is a file, not a directory")):
        check_tensorboard(tmp_path / "file")
    with pytest.raises(InvalidArgument, match=re.escape(f"--tensorboard {tmp_path / 'file' / 'board'} cannot be used: "
                                                        "Not a directory")):
        check_tensorboard(tmp_path / "file" / "board")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FailedPrecondition, match=re.escape("not installed here: pip install -c constraints.txt -e "
                                                           "'.[tensorboard]'")):
        check_tensorboard(tmp_path / "board")


def test_local_with_tensorboard_at_a_file_says_so_in_one_line_before_anything_starts(tmp_path):
    (tmp_path / "file").write_text("")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "diloco", "local", "--tensorboard", str(tmp_path / "file"),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"diloco: error: --tensorboard {tmp_path / 'file'} is a file, " \
                                                   "not a directory\n", proc.stderr
    assert not out.exists()
