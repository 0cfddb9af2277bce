"""What a local run measured, as ``summary.json`` holds it: built once the run's processes
stopped, from what the supervisor saw (``RunRecord``) and what the run wrote (the shards'
tapes, the learners' events and summaries, the chaos log), with every measure from
``diloco.cli.metrics``, the code every system of a comparison shares."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from diloco.coordinator.launcher import SITES_FILE
from diloco.cli.chaos import SCAVENGED_POOL
from diloco.cli.local.config import LocalConfig
from diloco.cli.local.progress import failure_reason
from diloco.cli.metrics import (expected_period, goodput, link_bytes, slot_seconds, start_s, tape_stats, uptime,
                                wire_bytes)


@dataclass
class RunRecord:
    """What the supervisor saw of one part of a run (a resumed run has several)."""

    run_dir: Path
    started_wall: float
    """Unix time the cluster was started."""
    wall_s: float = 0.0
    """Seconds from the cluster's start to the processes' stop."""
    before: set[str] = field(default_factory=set)
    """Learners of a resumed run's earlier parts."""
    members: list[dict] = field(default_factory=list)
    """Every learner the coordinator knew at the end (ListLearners, the gone ones too)."""
    launches: list[dict] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    """The learners the stop drained."""
    interrupted: bool = False
    time_limited: bool = False
    drained_at: float | None = None
    """Unix time the token budget drained the learners."""
    resumed_from: int | None = None
    stop_snapshot: int | None = None
    state: dict | None = None
    """The final global model (None: it could not be exported)."""
    versions: dict[int, int] = field(default_factory=dict)
    export_error: str | None = None
    exported_at: float = 0.0


def figure(value: float, digits: int) -> float | None:
    """A measured figure for summary.json: None where it does not exist (NaN)."""
    return round(value, digits) if math.isfinite(value) else None


def strict(summary: dict, missing: dict[str, str]) -> dict:
    """``summary`` as strict JSON can hold it: every non-finite number becomes null, and
    ``missing`` says why for each such figure (its own reason, or "not measured")."""
    reasons = dict(missing)

    def clean(value, key: str):
        if isinstance(value, float) and not math.isfinite(value):
            reasons.setdefault(key, f"not measured ({value})")
            return None
        if isinstance(value, dict):
            return {k: clean(v, f"{key}.{k}" if key else k) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v, f"{key}[{i}]") for i, v in enumerate(value)]
        return value

    cleaned = clean(summary, "")
    cleaned["missing"] = reasons
    return cleaned


def run_failures(summary: dict, killed: set[str]) -> list[str]:
    """What makes ``diloco local`` exit non-zero, one line each: a learner that failed before
    training (a chaos kill is no failure), a launch that ended before joining, no token trained."""
    lines = [f"learner {l['id']} failed before training: {l['reason']}" for l in summary["learners"]
             if l["state"] == "failed" and not l["inner_steps"] and l["id"] not in killed]
    lines += [f"launch {x['launch_id']} ended before joining: {x['detail']}" for x in summary["launches_failed"]]
    if not summary["tokens"]:
        lines.append("no token was trained")
    return lines


def learner_summaries(run_dir: Path) -> dict[str, dict]:
    """Each learner's own final summary (``learners/<id>.json``; a killed one has none)."""
    return {s["learner_id"]: s for s in (json.loads(p.read_text()) for p in sorted((run_dir / "learners").glob("*.json")))}


def missing_figures(task, record: RunRecord) -> dict[str, str]:
    """The eval figures that do not exist, and why."""
    if not task.eval_batches:
        return {"eval_loss_start": "the task has no eval batches", "eval_loss_final": "the task has no eval batches"}
    if record.state is None:
        return {"eval_loss_final": (f"the final model could not be exported: {record.export_error}"
                                    if record.export_error else "no final model: the cluster did not start")}
    return {}


def _training_window(cfg: LocalConfig, record: RunRecord, part: dict[str, list[dict]]) -> tuple[float, float, float]:
    """(first learner computing, end of training, end for slots): training ends with the
    last learner's last step, or when the budget drained them all (a learner still
    starting then leaves later without having trained: no stall)."""
    computing = [e["t"] for r in part.values() for e in r if e["kind"] == "state" and e["state"] == "computing"]
    # When each learner stopped training: drained, or gone.
    done = [min(stops) for r in part.values()
            if (stops := [e["t"] for e in r if e["kind"] == "state" and e["state"] in ("draining", "left")])]
    end = max(done, default=record.started_wall + record.wall_s)
    start = min(computing, default=record.started_wall)
    return start, min(end, record.drained_at) if record.drained_at else end, end


def _learner_rows(record: RunRecord, steps: dict[str, int], summaries: dict[str, dict],
                  events: dict[str, list[dict]]) -> list[dict]:
    """summary.json's ``learners``: each learner's state, steps, tokens and where it trained."""
    interrupted = set(record.stopped) if record.interrupted else set()
    devices = {i: {k: v for k, v in e.items() if k not in ("kind", "t")}
               for i, r in events.items() for e in r if e["kind"] == "device"}
    return [{"id": m["id"], "pool": m["pool"], "state": "interrupted" if m["id"] in interrupted else m["state"],
             "reason": failure_reason(m, record.run_dir) if m["state"] == "failed" else m["reason"],
             "inner_steps": steps.get(m["id"], 0),
             "tokens": summaries[m["id"]]["tokens"] if m["id"] in summaries else m["tokens"],
             "tokens_per_s": round(summaries.get(m["id"], m).get("tokens_per_s", 0.0), 1),
             **devices.get(m["id"], {})} for m in record.members]


def build_summary(cfg: LocalConfig, record: RunRecord, events: dict[str, list[dict]], unit: str,
                  evals: tuple[float, float], curve: list) -> dict:
    """summary.json's figures (before ``strict``): the whole run's tokens, rounds and bytes;
    this part's goodput and uptime (a resumed run's earlier parts had theirs)."""
    run_dir, members = record.run_dir, record.members
    summaries = learner_summaries(run_dir)
    # Inner steps per learner: its summary, or for a killed one its last heartbeat.
    steps = {m["id"]: m["inner_steps"] for m in members}
    steps.update({i: s["inner_steps"] for i, s in summaries.items()})
    tokens = sum(s["tokens"] for s in summaries.values()) + sum(m["tokens"] for m in members if m["id"] not in summaries)
    part = {i: r for i, r in events.items() if i not in record.before}
    # Goodput counts the learners whose slots it counts, the ones the run launched: a learner
    # that joined by itself (an own-loop script, a hostile one) holds no slot, and its own
    # claims of steps and step times are not the run's work.
    own = {m["id"] for m in members if m["launch_id"]} if members else set(summaries)
    stats = tape_stats(run_dir, cfg.run.fragments, {i: n for i, n in steps.items() if i not in record.before and i in own})
    period = expected_period(cfg.run.sync_every_steps / cfg.run.fragments * stats["step_s"])  # a round every H/P steps
    start, stop, end = _training_window(cfg, record, part)
    up, stall = uptime(stats.pop("round_closes"), start, stop, period)
    chaos_log = run_dir / "chaos.jsonl"
    chaos = [json.loads(line) for line in chaos_log.read_text().splitlines()] if chaos_log.exists() else []
    pools = {m["id"]: m["pool"] for m in members}
    first_steps = sorted(min(e["t"] for e in r if e["kind"] == "state" and e["state"] == "computing")
                         for i, r in part.items()
                         if pools.get(i) != SCAVENGED_POOL and any(e.get("state") == "computing" for e in r))
    # Slots are held until the last learner stopped training (its last step), as DP's and
    # torchft's until their last step: steps a drain lets finish count, so goodput <= 1.
    slots = slot_seconds(first_steps[: cfg.learners], end,
                         [(c["t"], len(c["launched"])) for c in chaos if c["kind"] == "scavenge"])
    failed_launches = [{"launch_id": x["launch_id"], "detail": x["detail"]}
                       for x in record.launches if x["state"] == "failed"]
    summary = {
        "tokens": tokens,
        "wall_s": round(record.wall_s, 2),
        "task": cfg.run.task,
        "eval_unit": unit,
        "eval_loss_start": figure(evals[0], 4),
        "eval_loss_final": figure(evals[1], 4),
        "curve": curve,
        "start_s": start_s(record.started_wall, first_steps[: cfg.learners]),
        "goodput": goodput(stats.pop("useful_s"), slots),
        "step_goodput": stats.pop("step_goodput"),
        "uptime": up,
        "global_stall_s": stall,
        **wire_bytes(run_dir),
        "links": link_bytes(run_dir / "coordinator" / "learners" / SITES_FILE, summaries,
                            {m["launch_id"]: m["id"] for m in members if m["launch_id"]}),
        **{k: v for k, v in stats.items() if k != "step_s"},
        "learners_joined": len(members) if members else len(summaries),
        "learners_failed": sum(1 for m in members if m["state"] == "failed") + len(failed_launches),
        "learners_killed": sum(1 for c in chaos if c["kind"] == "kill"),
        "learners_scavenged": (sum(1 for m in members if m["pool"] == SCAVENGED_POOL) if members
                               else sum(len(c["launched"]) for c in chaos if c["kind"] == "scavenge")),
        "shard_restarts": sum(1 for c in chaos if c["kind"] == "restart_shard"),
        "learners": _learner_rows(record, steps, summaries, events),
        "final_versions": {str(f): v for f, v in sorted(record.versions.items())},
        "started_unix": round(record.started_wall, 3),
        "interrupted": record.interrupted,
        "time_limited": record.time_limited,
        "resumed_from_snapshot": record.resumed_from,
        "snapshot_at_stop": record.stop_snapshot,
        "launches_failed": failed_launches,
        "run_dir": str(run_dir),
    }
    killed = {c["learner"] for c in chaos if c["kind"] in ("kill", "replace")}  # chaos' victims, replaced
    summary["failures"] = run_failures(summary, killed)
    return summary
