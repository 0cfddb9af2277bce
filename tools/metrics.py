"""How runs are measured: the eval loss of a model, tokens per inner step, and goodput,
uptime and global stall from a run's records (the shards' tapes, the learners' event
tapes). ``diloco local`` and the baselines take these definitions from here."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from diloco.auth import COORDINATOR_ID
from diloco.config import RunConfig
from diloco.tape import read_tape
from diloco.task import Task, TaskContext, TaskError, build_task, checked_tokens, evaluate


MIN_UPTIME_PERIOD_S = 1.0
"""Floor of uptime's expected period between two advances of the global model."""


def learner_events(run_dir: Path) -> dict[str, list[dict]]:
    """Each learner's event tape (``learners/<id>.events.jsonl``)."""
    events = {}
    for path in sorted((run_dir / "learners").glob("*.events.jsonl")):
        events[path.name.removesuffix(".events.jsonl")] = list(read_tape(path))
    return events


def supervisor_task(run: RunConfig, learners: int) -> Task:
    """The run's task as the supervisor builds it: for the start and final evaluation
    (with the learners' eval batches) and the tokens of one batch."""
    return build_task(run.task, TaskContext(0, learners, run.seed, torch.device("cpu"), dict(run.task_options)), run.init)


def eval_task(run: RunConfig, task: Task, state: Mapping[str, torch.Tensor] | None = None) -> float:
    """The task's eval loss of ``state`` (None: the task's own initial model)."""
    if state is not None:
        task.model.load_state_dict(state)
    value = evaluate(run.task, task)
    return float("nan") if value is None else value


def tokens_per_step(run: RunConfig, task: Task) -> int:
    """Tokens one inner step trains on: the task's count of its first batch."""
    try:
        batch = next(iter(task.batches))
    except StopIteration:
        raise TaskError(f"task {run.task!r} yields no batches") from None
    return checked_tokens(run.task, task.tokens(batch))


def tape_stats(run_dir: Path, fragments: int, steps: dict[str, int]) -> dict:
    """Rounds, participants and grace from the shards' tapes, and goodput (README): the
    share of the learners' inner-step time whose deltas reached the global model, i.e.
    per learner the fragment-steps of its pushes merged with weight > 0 over its inner
    steps x P, weighted by its step time. ``steps``: inner steps each learner trained."""
    rounds, merged, pushes = [], set(), []
    for tape in sorted(run_dir.glob("shard*/tape-S*.jsonl")):
        life = 0  # a restarted shard starts a new life; versions repeat after a restore
        for r in read_tape(tape):
            if r["kind"] == "start":
                life += 1
            elif r["kind"] == "round":
                rounds.append(r)
                merged |= {(tape, life, p, r["fragment"], r["version"])
                           for p, w in zip(r["participants"], r["weights"]) if w > 0}
            elif r["kind"] == "push" and r["outcome"] != "duplicate":
                pushes.append((tape, life, r))
    merged_steps: dict[str, int] = {}
    step_s: dict[str, float] = {}
    for tape, life, p in pushes:
        step_s[p["learner"]] = p["step_time_s"]
        if (tape, life, p["learner"], p["fragment"], p["target_version"]) in merged:
            merged_steps[p["learner"]] = merged_steps.get(p["learner"], 0) + p["steps"]
    typical = sorted(step_s.values())[len(step_s) // 2] if step_s else 1.0
    useful = total = 0.0
    for learner, n in steps.items():
        t = step_s.get(learner) or typical
        total += n * fragments * t
        useful += min(merged_steps.get(learner, 0), n * fragments) * t
    return {
        "rounds": len(rounds),
        "mean_participants": round(sum(len(r["participants"]) for r in rounds) / len(rounds), 3) if rounds else 0.0,
        "mean_grace_s": round(sum(r["grace_s"] for r in rounds) / len(rounds), 4) if rounds else 0.0,
        "step_goodput": round(useful / total, 4) if total else 0.0,
        "useful_s": useful / fragments,
        "round_closes": sorted(r["t"] for r in rounds),
        "step_s": typical,
    }


def wire_bytes(run_dir: Path) -> dict:
    """The run's traffic as its shards saw it, from their tapes (every life of every
    shard): ``bytes_up``, the pushes received (duplicates too: they crossed the wire), and
    ``bytes_down``, the replies and bootstraps sent whole to learners (not the
    coordinator's exports). Learners' own counts miss the killed ones, which write no
    summary. Payload bytes, as the learners count theirs; the initial values a learner
    uploads once per fragment and run are not in either."""
    up = down = 0
    for tape in sorted(run_dir.glob("shard*/tape-S*.jsonl")):
        for r in read_tape(tape):
            if r["kind"] == "push":
                up += r["bytes"]
            elif r["kind"] == "sent" and r["learner"] != COORDINATOR_ID:
                down += r["bytes"]
    return {"bytes_up": up, "bytes_down": down}


def slot_seconds(slot_starts: list[float], end: float, scavenged: list[tuple[float, int]]) -> float:
    """Learner-slot time of the training window, the denominator of goodput. Each of the
    learners launched at the start holds a slot from its first inner step (the first
    start-up is excluded, as DP's is) to the end of training; a killed learner's slot
    keeps counting through its replacement's start-up; an early finisher's slot idles
    until the end. Each scavenged learner holds a slot from the moment it was asked for."""
    return sum(max(end - t, 0.0) for t in slot_starts) + sum(count * max(end - t, 0.0) for t, count in scavenged)


def uptime(closes: list[float], start: float, end: float, period_s: float) -> tuple[float, float]:
    """(uptime, global stall seconds): the global model is up in every window of length
    ``period_s`` that saw a round close; a stall is time beyond ``period_s`` between two
    closes (or from the start to the first, or the last to the end)."""
    if end <= start or period_s <= 0:
        return 0.0, 0.0
    points = [start, *[c for c in closes if start <= c <= end], end]
    stall = sum(max(b - a - period_s, 0.0) for a, b in zip(points, points[1:]))
    return round(1.0 - stall / (end - start), 4), round(stall, 3)
