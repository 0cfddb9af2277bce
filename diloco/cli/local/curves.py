"""The loss curves of a local run: ``RUN_DIR/curves.jsonl`` (every series on one x-axis,
the run's tokens), the figure drawn from it (``plots``) and, with ``--tensorboard DIR``,
the same series as TensorBoard event files.

Series: ``train`` (each learner's mean training loss over each ``--train-loss-every``
inner steps, from its ``train`` events), ``eval`` (each learner's own evaluations of its
model), ``global_eval`` (the global model: the seed, each curve point, each part's final
model) and ``resume`` (where a resumed run continued). ``tokens`` is the whole run's at
the record's time (``diloco.cli.metrics.run_tokens``); ``loss`` is in the task's eval unit
(the learners record their training loss times the task's ``eval_scale``, as its
evals), so the series compare on one axis.

Where the global model is evaluated: by the supervisor. At each curve mark it exports
the model through the coordinator's ExportModel (the shards answer as they answer a
bootstrap, between rounds: no learner waits), and it evaluates the exports after the run.
Not the learners: an evaluation stalls the inner loop of the learner running it, and a
learner holds its own model (the last reply plus its steps since), not the global one.
Not the coordinator: it holds no task, model code or data, and stays small. Not the
shards: each holds only its fragments. After the run rather than as each export arrives,
so the evaluations take no core from the learners while they train; they cost the end of
the run a fraction of a second each on the default model. A mark the supervisor saw pass
only once training was over adds no point: the final model is that point. The
evaluations land in ``RUN_DIR/curve/evals.jsonl`` (a tape: a resumed run keeps its
earlier parts')."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path

from diloco.errors import FailedPrecondition, InvalidArgument
from diloco.files import atomic_write
from diloco.cli.local.rundir import check_dir_flag
from diloco.tape import TapeWriter, read_tape
from diloco.cli.metrics import CURVE_DIR, run_tokens

CURVES_FILE = "curves.jsonl"
GLOBAL_EVALS = "evals.jsonl"
"""The supervisor's evaluations of the global model, under ``RUN_DIR/curve/``."""
RESUMES_FILE = "resumes.jsonl"


def record_global_evals(run_dir: Path, evals: list[tuple[str, float, Mapping[int, int], float]], unit: str) -> None:
    """Append evaluations of the global model: (which model: seed, curve or final; when
    it was exported, unix time; each fragment's version in it; eval loss)."""
    tape = TapeWriter(run_dir / CURVE_DIR / GLOBAL_EVALS)
    try:
        for model, t, versions, loss in evals:
            tape.append("global_eval", t, model=model, loss=loss, unit=unit,
                        versions={str(f): v for f, v in sorted(versions.items())})
    finally:
        tape.close()


def curve_records(events: Mapping[str, list[dict]], global_evals: list[dict], resumes: list[dict]) -> list[dict]:
    """Every point of every series (module docstring), in time order. ``events``: the
    learners' event tapes; ``global_evals``: ``record_global_evals``' tape; ``resumes``:
    RUN_DIR/resumes.jsonl's lines."""
    tokens_at = run_tokens(events)
    records = []
    for learner, tape in events.items():
        for e in tape:
            if e["kind"] == "train":
                records.append({"series": "train", "learner": learner, "tokens": tokens_at(e["t"]),
                                "learner_tokens": e["tokens"], "step": e["step"], "loss": e["loss"],
                                "unit": e["unit"], "tokens_per_s": e["tokens_per_s"], "t": e["t"]})
            elif e["kind"] == "eval":
                records.append({"series": "eval", "learner": learner, "tokens": tokens_at(e["t"]),
                                "learner_tokens": e["tokens"], "step": e["step"], "loss": e["loss"], "unit": e["unit"],
                                "t": e["t"]})
    for g in global_evals:
        records.append({"series": "global_eval", "model": g["model"], "tokens": tokens_at(g["t"]), "loss": g["loss"],
                        "unit": g["unit"], "versions": g["versions"], "t": g["t"]})
    for r in resumes:
        records.append({"series": "resume", "tokens": tokens_at(r["t"]), "snapshot": r["snapshot"], "t": r["t"]})
    return sorted(records, key=lambda r: r["t"])


def write_curves(run_dir: Path, events: Mapping[str, list[dict]]) -> list[dict]:
    """RUN_DIR/curves.jsonl from what the run recorded, all its parts (``events``: the
    learners' tapes, ``learner_events``); returns its records."""
    evals = run_dir / CURVE_DIR / GLOBAL_EVALS
    resumes = run_dir / RESUMES_FILE
    records = curve_records(events, list(read_tape(evals)) if evals.exists() else [],
                            [json.loads(line) for line in resumes.read_text().splitlines()] if resumes.exists() else [])
    atomic_write(run_dir / CURVES_FILE, "".join(json.dumps(r) + "\n" for r in records))
    return records


def scalars(record: dict) -> list[tuple[str, float]]:
    """A curves record as TensorBoard scalars: (tag, value)."""
    if record["series"] == "train":
        return [(f"train/loss/{record['learner']}", record["loss"]),
                (f"train/tokens_per_s/{record['learner']}", record["tokens_per_s"])]
    if record["series"] == "eval":
        return [(f"eval/loss/{record['learner']}", record["loss"])]
    if record["series"] == "global_eval":
        return [("global/eval_loss", record["loss"])]
    return []


TENSORBOARD_FIX = "pip install -c constraints.txt -e '.[tensorboard]'"


def check_tensorboard(directory: Path) -> None:
    """``--tensorboard DIR`` can be written, before anything starts: the package is
    installed and DIR is a directory, or can be made (nothing is made here)."""
    if importlib.util.find_spec("tensorboard") is None:
        raise FailedPrecondition(f"--tensorboard: the tensorboard package is not installed here: {TENSORBOARD_FIX}")
    if directory.exists() and not directory.is_dir():
        raise InvalidArgument(f"--tensorboard {directory} is a file, not a directory")
    check_dir_flag("--tensorboard", directory)  # made when the run writes it


def write_tensorboard(records: list[dict], directory: Path, since: float) -> None:
    """The records from unix time ``since`` on (this part of the run: a resumed run given
    the same DIR adds its part to the earlier ones', on the same axis) as TensorBoard
    scalars in a new event file in ``directory``, at step = the run's tokens."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(directory))
    try:
        for record in records:
            if record["t"] >= since:
                for tag, value in scalars(record):
                    writer.add_scalar(tag, value, record["tokens"], walltime=record["t"])
    finally:
        writer.close()
