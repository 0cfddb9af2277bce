"""How many shards a deployment needs, and what each one costs: a linear model of this
implementation's shard, its coefficients fitted to ``diloco bench load`` sweeps
(docs/results/scale/), for the rounds a shard runs by default (quorum 1, grace off: a
round per push).

- CPU: a shard spends ``push_s + push_s_per_param x P`` CPU-seconds per push of a
  fragment of P parameters (receive, decode, merge, outer step, the quantized update and
  the condensed reply), whatever the number of learners.
- Memory (peak): ``rss_bytes + P_s x (rss_per_param + rss_per_param_learner x N) +
  rss_per_learner x N`` for a shard owning P_s parameters with N live learners (the
  fragment's values, optimizer state and update buffers; per learner its int8 mirror and
  what its pushes in flight hold, and its connection's buffers).
- The coordinator: ``heartbeat_s + heartbeat_s_per_learner x N`` CPU-seconds per
  heartbeat, one per learner per second (a fifth of the default lease). The stored fit
  predates heartbeats of two clock entries (docs/results/heartbeat/): its per-learner
  term, the clock's, is gone since, and the figure it gives is high by about 2x at 256
  learners until the sweeps are run again.
- Wire: ``wire_per_param`` bytes per parameter per push, the same again for its reply (int4
  blocks with their scales, framed).

A learner pushes every fragment once per ``H x step_s`` seconds, so the model's whole P
crosses to the shards N / (H x step_s) times a second. A shard is one process; the model
keeps each at ``utilization`` of one core and of its link, so that bursts (every learner
of a quorum pushing together) queue for less than a period.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from diloco.errors import InvalidArgument
from diloco.syncer.config import MAX_SHARDS


@dataclass(frozen=True)
class Costs:
    push_s: float
    push_s_per_param: float
    rss_bytes: float
    rss_per_param: float
    rss_per_param_learner: float
    rss_per_learner: float
    wire_per_param: float
    heartbeat_s: float
    heartbeat_s_per_learner: float
    """The coordinator's CPU seconds per heartbeat, ``heartbeat_s + heartbeat_s_per_learner x
    N`` with N learners (the stored sweeps' heartbeats carried a vector clock of every learner)."""


def fit_rows(rows: Iterable[Mapping]) -> list[Mapping]:
    """The rows the model describes: two learners or more (a run of one learner is not what
    it sizes; its figures varied between runs), measured without an error."""
    return [r for r in rows if r["learners"] >= 2 and r.get("cpu_s_per_push") and not r.get("errors")]


def _relative_lstsq(columns: list, y):
    """Least squares of the relative error (each row divided by its measured value): the
    model is judged by how far off it is in percent, at 1 Mi as at 64 Mi parameters."""
    import numpy as np

    a = np.stack(columns, 1) / y[:, None]
    solution, _, rank, _ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    if rank < a.shape[1]:
        raise InvalidArgument(_UNDETERMINED)
    return [float(v) for v in solution]


_UNDETERMINED = ("the measurements do not determine the costs: give configurations that vary the learners at two "
                 "fragment sizes at least, and the parameters")


def fit(rows: Iterable[Mapping]) -> Costs:
    """``bench load --json`` rows (``fit_rows``) to costs: CPU per push against the
    parameters per shard; a shard's peak RSS against its parameters, parameters x learners
    and learners; both in relative error. Wire bytes per parameter per push averaged; the
    coordinator's CPU per heartbeat against the learner count."""
    import numpy as np

    rows = list(rows)
    if len(rows) < 4:
        raise InvalidArgument(f"fitting needs at least 4 measured configurations, got {len(rows)}")
    pps = np.array([r["params"] / r["shards"] for r in rows], dtype=float)
    learners = np.array([r["learners"] for r in rows], dtype=float)
    ones = np.ones_like(pps)
    push_s, push_s_per_param = _relative_lstsq([ones, pps], np.array([r["cpu_s_per_push"] for r in rows], dtype=float))
    rss = np.array([r["rss_bytes"] / r["shards"] for r in rows], dtype=float)
    rss0, rss_p, rss_pl, rss_l = _relative_lstsq([ones, pps, pps * learners, learners], rss)
    wire = float(np.mean([r["mb_in_per_s"] * 1e6 / r["pushes_per_s"] / (r["params"] / r["shards"]) for r in rows]))
    beats = [r for r in rows if r["learners"] >= 4]  # (few learners: the coordinator idles, its figure is noise)
    n = np.array([r["learners"] for r in beats], dtype=float)
    per_beat = np.array([r["coordinator_cpu_s_per_s"] / r["learners"] for r in beats], dtype=float)
    hb0, hb1 = _relative_lstsq([np.ones_like(n), n], per_beat)
    costs = Costs(push_s, push_s_per_param, rss0, rss_p, rss_pl, rss_l, wire, hb0, hb1)
    negative = [name for name, value in asdict(costs).items() if value < 0]
    if negative:
        raise InvalidArgument(f"{_UNDETERMINED} ({', '.join(negative)} came out negative)")
    return costs


COSTS = Costs(
    push_s=0.00118713,
    push_s_per_param=1.70145e-08,
    rss_bytes=8.38958e+07,
    rss_per_param=51.311,
    rss_per_param_learner=0.998396,
    rss_per_learner=527701,
    wire_per_param=0.437427,
    heartbeat_s=0.00174301,
    heartbeat_s_per_learner=4.82234e-07,
)
"""``fit`` of the stored sweeps (docs/results/scale/: learners, params, params-64Mi and
memory; ``capacity_check.py`` prints it, and a unit test refits them and checks these
figures), on this project's 2-core machine."""


def predict(costs: Costs, params_per_shard: float, learners: int) -> dict:
    """One shard's cost per push and its memory (the figures a bench load row reports)."""
    return {
        "cpu_s_per_push": costs.push_s + costs.push_s_per_param * params_per_shard,
        "rss_bytes": costs.rss_bytes + params_per_shard * (costs.rss_per_param + costs.rss_per_param_learner * learners)
        + costs.rss_per_learner * learners,
    }


def plan(params: int, learners: int, sync_every: int, step_s: float, link_mbit: float,
         utilization: float = 0.5, costs: Costs = COSTS) -> dict:
    """Shards needed for a model of ``params`` with ``learners`` learners pushing every
    ``sync_every x step_s`` seconds, each shard held to ``utilization`` of a core and of
    a ``link_mbit`` link, and what each then needs."""
    if params < 1 or learners < 1 or sync_every < 1:
        raise InvalidArgument("params, learners and sync_every must be >= 1")
    for name, value in (("step_s", step_s), ("link_mbit", link_mbit)):
        if not (math.isfinite(value) and value > 0):
            raise InvalidArgument(f"{name} must be a positive number, got {value}")
    if not 0 < utilization <= 1:
        raise InvalidArgument(f"utilization must be in (0, 1], got {utilization}")
    period = sync_every * step_s
    pushes = learners / period  # per shard: every learner pushes each shard's fragment once a period
    param_pushes = learners * params / period  # parameters crossing to the shards per second
    fixed = pushes * costs.push_s
    if fixed >= utilization:  # more shards do not help: each one sees every learner's push
        raise InvalidArgument(
            f"{learners} learners pushing every {period:g} s cost each shard {fixed:.2f} CPU-s/s in per-push costs "
            f"alone, more than the {utilization:g} allowed: push less often (a larger H or step time)")
    mbit = param_pushes * costs.wire_per_param * 8 / 1e6  # all shards together, each way
    shards = max(1, math.ceil(param_pushes * costs.push_s_per_param / (utilization - fixed)),
                 math.ceil(mbit / (utilization * link_mbit)))
    if shards > MAX_SHARDS:
        raise InvalidArgument(f"this needs {shards} shards, more than the {MAX_SHARDS} a run can have")
    cpu, mbit = fixed + param_pushes / shards * costs.push_s_per_param, mbit / shards
    pps = params / shards
    memory = predict(costs, pps, learners)["rss_bytes"]
    learner_mbit = params * costs.wire_per_param / period * 8 / 1e6
    return {
        "params": params, "learners": learners, "sync_every": sync_every, "step_s": step_s, "link_mbit": link_mbit,
        "utilization": utilization, "shards": shards, "params_per_shard": int(pps),
        "shard_cores": round(cpu, 3), "shard_rss_gb": round(memory / 1e9, 2),
        "shard_mbit_in": round(mbit, 1), "shard_mbit_out": round(mbit, 1),
        "learner_mbit_up": round(learner_mbit, 1), "learner_link_ok": learner_mbit <= link_mbit,
        "coordinator_cores": round(learners * (costs.heartbeat_s + costs.heartbeat_s_per_learner * learners), 3),
        "costs": asdict(costs),
    }
