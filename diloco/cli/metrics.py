"""How runs are measured, the same for every system ``diloco compare`` puts side by side
(Decoupled DiLoCo through ``diloco local``, DP and torchft through their baselines): each
system turns its own records into the inputs below, and these functions make the figures.

- **advance**: a moment the global model changed (DP: an optimizer step finished;
  Decoupled and torchft: a fragment's round closed / sync committed).
- **expected period**: the interval between two advances when nothing goes wrong, times
  ``PERIOD_SLACK``, and at least ``MIN_PERIOD_S`` (``expected_period``).
- **global stall**: time beyond the expected period between two advances, or from the
  start of training to the first advance, or from the last advance to the end;
  **uptime** = 1 - stall / (end - start) (``uptime``).
- **goodput**: worker-seconds of computation whose result reached the final model over
  the worker-seconds of the slots the run held (``goodput``): DP counts the steps no
  restart rolled back, torchft the steps whose fragment sync committed, Decoupled the
  steps of pushes merged with weight > 0 (``tape_stats``) over its learner slots
  (``slot_seconds``).
- **bytes per 1k tokens**: bytes on the wire over tokens computed (``bytes_per_1k_tokens``).
- **start**: seconds from the system's launch (its supervisor starting the first process)
  until every worker launched at the start has begun its first inner step (``start_s``).
- **eval curve**: the eval loss against the tokens trained (``eval_curve``): each system
  saves its global model under ``RUN_DIR/curve/`` as training passes each of
  ``curve_points`` equal shares of its budget (DP: rank 0's model after the step; torchft:
  replica 0's global copies; Decoupled: the shards' export, placed at the run's tokens at
  the moment of the export, ``run_tokens``), and ``eval_task`` evaluates them after the run
  (DP and torchft through ``eval_curve``, Decoupled through ``diloco.cli.local.curves``, which
  also keeps each export's time and fragment versions).
- **run tokens**: the tokens every learner of a run had trained at a moment, from their
  own event tapes (``run_tokens``): the one x-axis of a run's loss curves.

Also here: the eval loss of a model, and the tokens of one inner step."""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from diloco.auth import COORDINATOR_ID
from diloco.config import RunConfig
from diloco.coordinator.sites import ETHERNET_HEADER_BYTES, SEGMENT_HEADER_BYTES
from diloco.errors import InvalidArgument
from diloco.tape import read_tape
from diloco.task import Task, TaskContext, TaskError, build_task, checked_tokens, evaluate

if TYPE_CHECKING:
    import torch


PERIOD_SLACK = 4.0
"""An advance may come up to this many times the expected interval late before the gap
counts as a global stall."""
MIN_PERIOD_S = 1.0
"""Floor of the expected period: below a second, OS scheduling jitter of a loaded machine
(not the system) decides whether an advance is late (a tiny test model steps in ~15 ms)."""


def expected_period(interval_s: float) -> float:
    """The expected period of a system whose global model advances every ``interval_s``
    when nothing goes wrong."""
    return max(interval_s * PERIOD_SLACK, MIN_PERIOD_S)


def goodput(useful_worker_s: float, slot_worker_s: float) -> float:
    """The share of the slots' worker-seconds whose computation reached the final model."""
    return round(useful_worker_s / slot_worker_s, 4) if slot_worker_s > 0 else 0.0


def start_s(launched: float, first_steps: list[float]) -> float | None:
    """Launch to training: ``first_steps`` holds, for each worker launched at the start,
    when it began its first inner step (wall clock, as ``launched``)."""
    return round(max(first_steps) - launched, 3) if first_steps else None


def bytes_per_1k_tokens(wire_bytes: float, tokens: int) -> float | None:
    return round(1000 * wire_bytes / tokens, 2) if tokens else None


def learner_events(run_dir: Path) -> dict[str, list[dict]]:
    """Each learner's event tape (``learners/<id>.events.jsonl``)."""
    events = {}
    for path in sorted((run_dir / "learners").glob("*.events.jsonl")):
        events[path.name.removesuffix(".events.jsonl")] = list(read_tape(path))
    return events


def run_tokens(events: Mapping[str, list[dict]]) -> Callable[[float], int]:
    """The whole run's tokens at a wall-clock time, from the learners' event tapes
    (``learner_events``; a resumed run's earlier learners too): the sum over the learners
    of each one's own count then. A learner counts 0 until its first event, 0 at its
    first ``computing`` state, each ``tokens`` its events carry at their times, linearly
    in between, and its last count after its last event (it left, or was killed: what it
    trained stays trained). Linear because a learner trains at a steady rate between two
    events (at most ``--train-loss-every`` inner steps apart), so every series of a run,
    each learner's and the global model's, lands on one x-axis that a resumed run
    continues. Returns the function of time (each learner's points are sorted once)."""
    learners = []
    for records in events.values():
        started = [e["t"] for e in records if e["kind"] == "state" and e.get("state") == "computing"][:1]
        points = sorted([(t, 0) for t in started] + [(e["t"], e["tokens"]) for e in records if "tokens" in e])
        if points:
            learners.append(([t for t, _ in points], [n for _, n in points]))

    def at(t: float) -> int:
        total = 0.0
        for times, counts in learners:
            i = bisect.bisect_right(times, t)
            if i == len(times):
                total += counts[-1]
            elif i > 0:  # times[i - 1] <= t < times[i]
                share = (t - times[i - 1]) / (times[i] - times[i - 1])
                total += counts[i - 1] + share * (counts[i] - counts[i - 1])
        return round(total)

    return at


def supervisor_task(run: RunConfig, learners: int) -> Task:
    """The run's task as the supervisor builds it: for the start and final evaluation
    (with the learners' eval batches) and the tokens of one batch."""
    import torch  # not at the top: the command line imports this module while it builds its parser

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


CURVE_DIR = "curve"


def curve_path(run_dir: Path, tokens: int, suffix: str = ".safetensors") -> Path:
    """Where a run saves its global model at ``tokens`` trained tokens (``eval_curve``)."""
    return run_dir / CURVE_DIR / f"tokens-{tokens:015d}{suffix}"


def check_curve_points(points: int) -> None:
    """A config's ``curve_points`` (every system's), checked where the config is made."""
    if points < 0:
        raise InvalidArgument(f"curve points must be >= 0, got {points}")


def curve_marks(budget_tokens: int, points: int) -> list[int]:
    """The token (or step) counts at which a run of ``budget_tokens`` saves its model for a
    curve of ``points`` equal shares (the last share ends with the final model, which is
    evaluated anyway); fewer when the budget has fewer units than shares."""
    return sorted({budget_tokens * k // points for k in range(1, points)} - {0})


def eval_curve(run: RunConfig, task: Task, run_dir: Path, start: float, final: tuple[int, float]) -> list[list]:
    """``[[tokens, eval loss], ...]``: the initial model at 0 tokens, every model the run
    saved under ``curve/`` (``curve_path``), and ``final`` (tokens, eval loss)."""
    import torch
    from safetensors.torch import load_file

    points = [[0, _rounded(start)]]
    for path in sorted((run_dir / CURVE_DIR).glob("tokens-*")):
        state = load_file(str(path)) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
        points.append([int(path.stem.removeprefix("tokens-")), _rounded(eval_task(run, task, state))])
    return [*points, [final[0], _rounded(final[1])]]


def _rounded(value: float | None) -> float | None:
    return round(value, 4) if value is not None and math.isfinite(value) else value


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


def link_bytes(sites_file: Path, summaries: dict[str, dict], learner_of: dict[str, str]) -> dict | None:
    """What the kernel counted on the learners' emulated links (``diloco.coordinator.launcher``'s
    sites file: one line per learner that ran on a site) beside each learner's own count
    of the payloads it sent and received (pushes and the fp32 values it offered with
    Initialize up; replies and bootstraps down). The kernel counts every frame (TLS,
    HTTP/2, TCP/IP and Ethernet headers, heartbeats, joins): ``overhead_up`` is kernel /
    payload - 1 over the uplinks, ``overhead_down`` over the downlinks, of the learners
    that wrote a summary (a killed one writes none: its site is listed, not counted). None
    when no learner ran on a site."""
    if not sites_file.exists():
        return None
    sites = []
    for line in sites_file.read_text().splitlines():
        record = json.loads(line)
        learner = learner_of.get(record["launch_id"])
        own = summaries.get(learner) if learner else None
        if own is not None:
            record.update(payload_up=own["bytes_up"] + own.get("bytes_initialize", 0), payload_down=own["bytes_down"])
        sites.append({"learner": learner, **record})
    counted = [s for s in sites if "payload_up" in s and "up" in s]
    totals = {key: sum(s[key] for s in counted) for key in ("up", "down", "payload_up", "payload_down")}

    def overhead(kernel: int, payload: int) -> float | None:
        return round(kernel / payload - 1, 4) if payload else None

    return {"sites": sites, "kernel_up": totals["up"], "kernel_down": totals["down"],
            "payload_up": totals["payload_up"], "payload_down": totals["payload_down"],
            "overhead_up": overhead(totals["up"], totals["payload_up"]),
            "overhead_down": overhead(totals["down"], totals["payload_down"]),
            "breakdown_up": link_breakdown(counted, "up"), "breakdown_down": link_breakdown(counted, "down"),
            "not_counted": [s["learner"] or s["launch_id"] for s in sites if s not in counted]}


def link_breakdown(sites: list[dict], way: str) -> dict | None:
    """What the kernel counted on the links one way beyond the learners' payloads, by
    cause, summed over ``sites`` (records of ``Sites.counters`` with the learner's
    ``payload_<way>``): ``ethernet`` (14 bytes a frame), ``not_ip`` (frames that carry no
    IP: ARP), ``segment_headers`` (IPv4 and TCP, ``SEGMENT_HEADER_BYTES`` a segment:
    the acknowledgements that carry nothing are all header), and ``above_payload``, the
    TCP payload beyond the learners' own count (TLS records and handshakes, HTTP/2 frames,
    gRPC message headers and metadata, the calls a learner does not count as payload:
    joins, heartbeats; segments sent twice). Each in bytes and as a share of the payload
    (``*_share``); ``resent_segments``: TCP segments the sites sent again (up only; the
    hub's are counted in its own namespace). None when a site's record predates these
    counters."""
    keys = (way, f"frames_{way}", f"ip_{way}", f"segments_{way}", f"payload_{way}")
    if not sites or any(k not in s for s in sites for k in keys):
        return None
    kernel, frames, ip, segments, payload = (sum(s[k] for s in sites) for k in keys)
    parts = {"ethernet": frames * ETHERNET_HEADER_BYTES, "not_ip": kernel - frames * ETHERNET_HEADER_BYTES - ip,
             "segment_headers": segments * SEGMENT_HEADER_BYTES,
             "above_payload": ip - segments * SEGMENT_HEADER_BYTES - payload}
    shares = {f"{k}_share": round(v / payload, 4) if payload else None for k, v in parts.items()}
    resent = {"resent_segments": sum(s["resent_up"] for s in sites)} if way == "up" and all(
        "resent_up" in s for s in sites) else {}
    return {"kernel": kernel, "payload": payload, "frames": frames, "segments": segments, **parts, **shares, **resent}


def link_load(links: dict | None, tokens: int) -> dict:
    """Bytes the kernel counted on every worker's emulated link (a ``links`` section: its
    ``sites``, each with ``up`` and ``down``) per 1k tokens trained: ``link_up_per_1k_tokens``
    summed over the sites' uplinks, ``link_down_per_1k_tokens`` over their downlinks. The
    same for every system; empty without sites."""
    if not links:
        return {}
    return {f"link_{way}_per_1k_tokens": bytes_per_1k_tokens(sum(s.get(way, 0) for s in links["sites"]), tokens)
            for way in ("up", "down")}


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
