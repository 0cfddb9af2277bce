"""``diloco check RUN_DIR``: the checker of a chaos run. It reads only what the run
recorded (each shard's tape over all its lives, ``chaos.jsonl``, ``summary.json``,
``endpoints.json``) and the replay of the shards, and tests the invariants a run must
keep whatever was done to it:

- ``replay``: ``diloco replay --check`` reproduces every shard's final model bit for bit;
- ``versions``: on every shard a fragment's version never goes backwards, across
  restarts. Versions are ordered as (snapshot epoch, version): a shard restored from
  snapshot n goes back to that snapshot's cut, which must be exactly the versions its
  marker recorded, and its later versions belong to epoch n (learners re-sync to it);
- ``merged_once``: every learner in a round brings a push of its own to that fragment
  that no earlier round merged (a push is merged at most once; a round from nothing is
  caught too); after a restore, the pushes the snapshot held in open rounds and those in
  its channels count as brought;
- ``no_merge_after_failure``: once a shard has heard that a learner failed or left, it
  accepts no push of that learner, and no round after its failure gives it weight;
  every learner failed at the coordinator is known as failed by every shard that ran to
  the end (shards learn of failures they missed while cut off);
- ``progress``: the global model advanced: on every shard, no stretch longer than twice
  the expected round period (``metrics.expected_period`` of the learners' push
  interval: 4x it, at least a second) passed without a round while a live learner, syncing with
  that shard and under no fault that cuts it off, was there (the shard's uptime under
  partitions is reported from the same intervals);
- ``learners``: every learner left or failed with a recorded reason; none is still a
  member; every launch joined; every process of the run has exited;
- ``eval``: the final evaluation is below the initial one.

The verdict goes to ``check.json`` in the run directory: each invariant's result, the
first violation, the faults by kind, per-shard uptime and goodput.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from diloco.errors import DilocoError, NotFound
from diloco.tape import read_tape
from diloco.cli.chaos import fault_spans
from diloco.cli.metrics import expected_period, learner_events

logger = logging.getLogger(__name__)

INVARIANTS = ("replay", "versions", "merged_once", "no_merge_after_failure", "progress", "learners", "eval")
CUTTING = {"cut", "flap", "starve"}
"""Faults that cut a learner off every shard (a starved link carries too little to sync)."""
STALL_FACTOR = 2.0
"""A stretch without a round longer than this many expected round periods is a stall."""


class Violation(Exception):
    """An invariant that does not hold: the message says where."""


@dataclass
class Report:
    results: dict[str, str | None] = field(default_factory=dict)
    """Invariant -> None (holds) or the first violation found."""
    stats: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(v is None for v in self.results.values())

    @property
    def first(self) -> str | None:
        return next((f"{name}: {v}" for name, v in self.results.items() if v is not None), None)

    def to_json(self) -> dict:
        return {"ok": self.ok, "violation": self.first,
                "invariants": [{"name": n, "ok": v is None, "detail": v} for n, v in self.results.items()], **self.stats}


# --- reading ---------------------------------------------------------------------------


def _lives(records: list[dict]) -> list[list[dict]]:
    """A tape cut at each ``start``: one list per life of the shard process."""
    lives: list[list[dict]] = []
    for r in records:
        if r["kind"] == "start" or not lives:
            lives.append([])
        lives[-1].append(r)
    return lives


def _tapes(run_dir: Path) -> dict[int, list[dict]]:
    tapes = sorted(run_dir.glob("shard*/tape-S*.jsonl"))
    if not tapes:
        raise NotFound(f"no shard tapes under {run_dir}")
    return {int(t.stem.rsplit("S", 1)[1]): list(read_tape(t)) for t in tapes}


def _push_times(records: list[dict]) -> dict[str, list[float]]:
    """Learner -> when each of its pushes was accepted (duplicates aside), in tape order."""
    times: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["kind"] == "push" and r["outcome"] != "duplicate":
            times[r["learner"]].append(r["t"])
    return times


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# --- invariants --------------------------------------------------------------------------


def check_versions(shard: int, records: list[dict]) -> None:
    markers = {r["snapshot"]: {int(f): v for f, v in r["versions"].items()} for r in records if r["kind"] == "marker"}
    last: dict[int, tuple[int, int]] = {}
    epoch = 0
    for life in _lives(records):
        for r in life:
            if r["kind"] == "restore":
                cut = {int(f): v for f, v in r["versions"].items()}
                if r["snapshot"] in markers and markers[r["snapshot"]] != cut:
                    raise Violation(f"shard {shard} restored snapshot {r['snapshot']} at versions {cut}, not its "
                                    f"marker's {markers[r['snapshot']]}")
                if r["snapshot"] <= epoch:
                    raise Violation(f"shard {shard} restored snapshot {r['snapshot']} after epoch {epoch}")
                epoch = r["snapshot"]
                last.update({f: (epoch, v) for f, v in cut.items()})
            elif r["kind"] == "initialize" and r.get("source", "").startswith("anchor"):
                # Back without this fragment's state (no snapshot), the shard took a learner's
                # anchor: its versions go on from there. That may be behind the last version it
                # issued (the dead life's newer rounds are lost) or ahead of the last its tape
                # holds (a SIGKILL loses the tape's unflushed records).
                last[r["fragment"]] = (epoch, r["version"])
            elif r["kind"] in ("round", "round_failed"):
                now = (epoch, r["version"])
                before = last.get(r["fragment"])
                if before is not None and now <= before:
                    raise Violation(f"shard {shard} fragment {r['fragment']}: version {now[1]} (epoch {now[0]}) "
                                    f"after {before[1]} (epoch {before[0]}) at t={r['t']:.3f}")
                last[r["fragment"]] = now


def check_merged_once(shard: int, records: list[dict]) -> None:
    for life in _lives(records):
        unmerged: Counter = Counter()
        for r in life:
            if r["kind"] == "push" and r["outcome"] != "duplicate":
                unmerged[(r["learner"], r["fragment"])] += 1
            elif r["kind"] == "restore":
                for c in r.get("channel", ()):
                    if c["outcome"] != "duplicate":
                        unmerged[(c["learner"], c["fragment"])] += 1
                for p in r.get("pending", ()):  # held in the recorded state's open rounds
                    unmerged[(p["learner"], p["fragment"])] += 1
            elif r["kind"] in ("round", "round_failed"):
                if len(set(r["participants"])) != len(r["participants"]):
                    raise Violation(f"shard {shard} fragment {r['fragment']} version {r['version']} lists a learner "
                                    f"twice: {r['participants']}")
                for learner in r["participants"]:
                    key = (learner, r["fragment"])
                    if unmerged[key] < 1:
                        raise Violation(f"shard {shard} fragment {r['fragment']} version {r['version']} merged a push "
                                        f"of {learner} that no push record left unmerged (merged twice?)")
                    unmerged[key] -= 1


def _departures(life: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """When this life of a shard heard of each failure and each departure."""
    failed: dict[str, float] = {}
    left: dict[str, float] = {}
    for r in life:
        if r["kind"] != "membership":
            continue
        if r.get("event") == "snapshot":
            for learner in r.get("failed", ()):
                failed.setdefault(learner, r["t"])
            for learner in r.get("left", ()):
                left.setdefault(learner, r["t"])
        elif r.get("event") == "failed":
            failed.setdefault(r["learner"], r["t"])
        elif r.get("event") == "left":
            left.setdefault(r["learner"], r["t"])
    return failed, left


def check_no_merge_after_failure(shard: int, records: list[dict], failed_at_coordinator: set[str]) -> None:
    lives = _lives(records)
    for life in lives:
        failed, left = _departures(life)
        gone = {**left, **failed}
        for r in life:
            if r["kind"] == "push" and r["outcome"] != "duplicate" and r["learner"] in gone \
                    and r["t"] > gone[r["learner"]]:
                raise Violation(f"shard {shard} accepted a push of {r['learner']} (fragment {r['fragment']}) at "
                                f"t={r['t']:.3f}, after hearing at t={gone[r['learner']]:.3f} that it was gone")
            if r["kind"] == "round":  # its weights were decided when it closed
                for learner, weight in zip(r["participants"], r["weights"]):
                    if learner in failed and r.get("closed_t", r["t"]) > failed[learner] and weight != 0:
                        raise Violation(f"shard {shard} fragment {r['fragment']} version {r['version']} gave "
                                        f"{learner} weight {weight} after hearing it failed")
    if lives and any(r["kind"] == "stop" for r in lives[-1]):
        missed = failed_at_coordinator - set(_departures(lives[-1])[0])
        if missed:
            raise Violation(f"shard {shard} never heard that {', '.join(sorted(missed))} failed")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _minus(intervals: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a, b in intervals:
        pieces = [(a, b)]
        for h0, h1 in holes:
            pieces = [p for x, y in pieces for p in ((x, min(y, h0)), (max(x, h1), y)) if p[1] > p[0]]
        out += pieces
    return _union(out)


def reachable(shard: int, records: list[dict], chaos: list[dict], end: float,
              stopped: dict[str, float] | None = None) -> list[tuple[float, float]]:
    """When at least one live learner could sync with ``shard``: from each accepted push of
    a learner on, until it failed, left, was killed or stopped training (``stopped``, by
    its own events: the shard hears of a departure through the coordinator, which may not
    be answering), or a fault cut it off that shard (then from its next accepted push on);
    minus the times the shard was down."""
    cuts: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for fault, learner, start, healed in fault_spans(chaos, end):
        if fault["fault"] in CUTTING or (fault["fault"] == "cut-shard" and fault.get("shard") == shard):
            cuts[learner].append((start, healed))
    ends: dict[str, float] = {}
    for life in _lives(records):
        failed, left = _departures(life)
        for learner, t in {**left, **failed}.items():
            ends[learner] = min(ends.get(learner, t), t)
    for c in chaos:
        if c["kind"] == "kill":
            ends[c["learner"]] = min(ends.get(c["learner"], c["t"]), c["t"])
    for learner, t in (stopped or {}).items():
        ends[learner] = min(ends.get(learner, t), t)
    pushes: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["kind"] == "push" and r["outcome"] != "duplicate":
            pushes[r["learner"]].append(r["t"])
        elif r["kind"] == "membership" and r.get("event") == "snapshot":
            # The full list a shard gets on (re)connecting: a learner that pushed before and
            # is not in it has gone (it left while the shard was down, say).
            members = set(r.get("live", ())) | set(r.get("draining", ()))
            for learner in [l for l in pushes if l not in members]:
                ends[learner] = min(ends.get(learner, r["t"]), r["t"])
    # Down: from a life's last record (a SIGKILLed shard's last records die unflushed with
    # it) until the next life serves a model again: restored from a snapshot (which can
    # take seconds from object storage), or given values by a learner.
    lives = _lives(records)
    down = [(a[-1]["t"], next((r["t"] for r in b if r["kind"] in ("restore", "initialize")), b[0]["t"]))
            for a, b in zip(lives, lives[1:])]
    spans = []
    for learner, times in pushes.items():
        until = ends.get(learner, end)
        # A shard down is a cut too: its learners find it back (probing with backoff) and
        # sync again from their next push; that wait is theirs, not a stall of the shard.
        blocked = _union(cuts.get(learner, []) + down)
        for a, b in blocked:  # after a cut, syncing again only from its next push
            after = [t for t in times if t >= b]
            blocked = blocked + [(b, after[0] if after else until)]
        spans += _minus([(times[0], until)], _union(blocked))
    return _minus(_union(spans), _union(down))


def learner_stops(run_dir: Path) -> dict[str, float]:
    """When each learner stopped training, by its own events (``learner_events``: its first
    state draining or left); a learner killed mid-step has none."""
    return {learner: stop for learner, events in learner_events(run_dir).items()
            if (stop := next((e["t"] for e in events if e["kind"] == "state" and e.get("state") in ("draining", "left")),
                             None)) is not None}


def check_progress(shard: int, records: list[dict], chaos: list[dict], end: float,
                   stopped: dict[str, float] | None = None) -> dict:
    """Returns the shard's expected round period, its uptime under partitions and its
    longest stall; raises on a stall."""
    rounds = sorted(r["t"] for r in records if r["kind"] == "round")
    gaps = [b - a for a, b in zip(rounds, rounds[1:])]
    # Expected period: from the typical time between a learner's pushes to this shard (a
    # round needs the quorum's pushes; with quorum 1 they come at least that often), with
    # metrics' slack and floor (a tiny model pushes every few tens of milliseconds).
    push_gaps = [b - a for times in _push_times(records).values() for a, b in zip(times, times[1:])]
    cadence = statistics.median(push_gaps) if push_gaps else (statistics.median(gaps) if gaps else 0.0)
    period = expected_period(cadence)  # the project's one definition (metrics.uptime's too)
    eligible = reachable(shard, records, chaos, end, stopped)
    total = sum(b - a for a, b in eligible)
    stalled, worst = 0.0, (0.0, None)
    marks = rounds + [end]
    for a, b in eligible:
        inside = [t for t in marks if a < t < b]
        for x, y in zip([a] + inside, inside + [b]):
            stalled += max(0.0, (y - x) - STALL_FACTOR * period)
            if y - x > worst[0]:
                worst = (y - x, x)
    stats = {"push_interval_s": round(cadence, 3), "period_s": round(period, 3), "reachable_s": round(total, 1),
             "uptime": round(1 - stalled / total, 4) if total else None, "longest_gap_s": round(worst[0], 2)}
    if worst[0] > STALL_FACTOR * period:
        raise Violation(f"shard {shard}: no round for {worst[0]:.1f} s from t={worst[1]:.3f} while a learner could "
                        f"reach it (expected period {period:.2f} s)", stats)
    return stats


def check_learners(summary: dict, endpoints: list[dict]) -> None:
    for learner in summary.get("learners", []):
        if learner["state"] not in ("left", "failed"):
            raise Violation(f"{learner['id']} is still {learner['state']} at the end")
        if not learner.get("reason"):
            raise Violation(f"{learner['id']} {learner['state']} with no recorded reason")
    if summary.get("missing"):
        raise Violation(f"launches that never joined: {summary['missing']}")
    for e in endpoints:
        if _alive(e["pid"]):
            who = f"{e['role']} {e['id']}" if e.get("id") else e["role"]
            raise Violation(f"{who} (pid {e['pid']}) is still running after the run")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def check_eval(summary: dict) -> None:
    start, final = summary.get("eval_loss_start"), summary.get("eval_loss_final")
    if start is None or final is None or not final < start:
        raise Violation(f"the final eval {final} is not below the initial {start}")


# --- the checker ---------------------------------------------------------------------------


def _snapshot_dir(run_dir: Path) -> str | None:
    """Where the run put its snapshots (``--snapshot-dir``, a directory or a URL), from its
    ``config.json``; None: the default, in the run directory."""
    path = run_dir / "config.json"
    return json.loads(path.read_text()).get("snapshot_dir") if path.is_file() else None


def check(run_dir: Path, replay_fn=None, snapshot_dir: str | None = None) -> Report:
    """Every invariant over ``run_dir``; ``replay_fn`` (tests) stands in for the replay;
    ``snapshot_dir``: where the snapshots are (default: where the run's config says)."""
    run_dir = Path(run_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise NotFound(f"{run_dir} is not a finished diloco local run directory: no summary.json")
    summary = json.loads(summary_path.read_text())
    tapes = _tapes(run_dir)
    chaos = _read_jsonl(run_dir / "chaos.jsonl")
    endpoints = json.loads((run_dir / "endpoints.json").read_text()) if (run_dir / "endpoints.json").exists() else []
    end = max(r["t"] for records in tapes.values() for r in records)
    failed_at_coordinator = {l["id"] for l in summary.get("learners", []) if l["state"] == "failed"}
    report = Report()

    def run(name: str, fn) -> None:
        try:
            fn()
            report.results[name] = None
        except Violation as v:
            report.results[name] = str(v.args[0])
        except Exception as error:  # noqa: BLE001 -- what cannot be checked (no S3 credentials, a torn file) is a violation too
            report.results[name] = f"cannot check: {type(error).__name__}: {error}" if not isinstance(error, DilocoError) \
                else f"cannot check: {error}"

    def replay_check() -> None:
        from diloco.cli.replay import replay

        results = (replay_fn or replay)(run_dir, snapshot_dir or _snapshot_dir(run_dir))
        bad = [r for r in results if r.max_abs_diff != 0]
        if bad:
            raise Violation("; ".join(f"shard {r.shard_id} differs by {r.max_abs_diff:.3g}" for r in bad))

    run("replay", replay_check)
    run("versions", lambda: [check_versions(s, rec) for s, rec in tapes.items()])
    run("merged_once", lambda: [check_merged_once(s, rec) for s, rec in tapes.items()])
    run("no_merge_after_failure",
        lambda: [check_no_merge_after_failure(s, rec, failed_at_coordinator) for s, rec in tapes.items()])
    shards = {}

    def progress() -> None:
        first, stopped = None, learner_stops(run_dir)
        for s, records in tapes.items():
            try:
                shards[s] = check_progress(s, records, chaos, end, stopped)
            except Violation as v:
                shards[s] = v.args[1]
                first = first or v
        if first is not None:
            raise Violation(first.args[0])

    run("progress", progress)
    run("learners", lambda: check_learners(summary, endpoints))
    run("eval", lambda: check_eval(summary))
    kinds = Counter(c["fault"] for c in chaos if c["kind"] == "fault")
    kinds.update(c["kind"] for c in chaos if c["kind"] in ("kill", "restart_shard"))
    report.stats = {"faults": dict(sorted(kinds.items())), "faults_total": sum(kinds.values()),
                    "replaced": Counter(c.get("cause", "kill") for c in chaos if c["kind"] == "replace"),
                    "shards": {str(s): v for s, v in sorted(shards.items())},
                    "recovery_s": recovery(tapes, chaos),
                    "goodput": summary.get("goodput"), "tokens": summary.get("tokens"),
                    "eval": [summary.get("eval_loss_start"), summary.get("eval_loss_final")]}
    return report


def recovery(tapes: dict[int, list[dict]], chaos: list[dict]) -> dict:
    """Per fault kind that cuts pushes off (``CUTTING`` and ``cut-shard``): seconds from a
    heal to its victim's next accepted push on a shard it had been cut off (median, max,
    count); victims that never pushed again (failed, replaced) are not counted."""
    pushes = {(shard, learner): times for shard, records in tapes.items()
              for learner, times in _push_times(records).items()}
    waits: dict[str, list[float]] = defaultdict(list)
    for fault, learner, _, healed in fault_spans(chaos):
        if healed is None or not (fault["fault"] in CUTTING or fault["fault"] == "cut-shard"):
            continue
        shard = fault.get("shard")
        nexts = [next((t for t in pushes.get((s, learner), ()) if t >= healed), None)
                 for s in (tapes if shard is None else [shard])]
        nexts = [t for t in nexts if t is not None]
        if nexts:
            waits[fault["fault"]].append(min(nexts) - healed)
    return {k: {"median": round(statistics.median(v), 2), "max": round(max(v), 2), "n": len(v)}
            for k, v in sorted(waits.items())}


def write_check(run_dir: Path, snapshot_dir: str | None = None) -> Report:
    report = check(run_dir, snapshot_dir=snapshot_dir)
    (Path(run_dir) / "check.json").write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return report


def describe(report: Report) -> str:
    if report.ok:
        uptime = ", ".join(f"S{s} {v['uptime']:.3f}" for s, v in report.stats["shards"].items() if v.get("uptime") is not None)
        return (f"check: all {len(report.results)} invariants hold after {report.stats['faults_total']} faults "
                f"({', '.join(f'{k} {n}' for k, n in report.stats['faults'].items()) or 'none'}); "
                f"uptime under partitions {uptime or '-'}")
    return f"check: VIOLATION {report.first}"


def totals(reports: list[Report]) -> dict:
    """Several runs (a soak over seeds) in one: faults by kind, violations, the lowest
    per-shard uptime, goodput."""
    kinds: Counter = Counter()
    for r in reports:
        kinds.update(r.stats["faults"])
    uptimes = [v["uptime"] for r in reports for v in r.stats["shards"].values() if v.get("uptime") is not None]
    goodputs = [r.stats["goodput"] for r in reports if r.stats.get("goodput") is not None]
    violations = [r.first for r in reports if not r.ok]
    out = {"runs": len(reports), "faults": dict(sorted(kinds.items())), "faults_total": sum(kinds.values()),
           "violations": violations, "min_uptime": min(uptimes, default=None),
           "goodput": [min(goodputs), max(goodputs)] if goodputs else None}
    out["line"] = (f"{len(reports)} runs, {out['faults_total']} faults "
                   f"({', '.join(f'{k} {n}' for k, n in out['faults'].items())}), {len(violations)} with a violation; "
                   f"lowest per-shard uptime under partitions {out['min_uptime']}; goodput {out['goodput']}")
    return out
