"""How many shards a deployment needs, and what each one costs: a linear model of this
implementation's shard, its coefficients fitted to ``diloco bench load`` sweeps
(docs/results/scale/), for the rounds a shard runs by default (quorum 1, grace off: a
round per push).

- CPU: a shard spends ``push_s + push_s_per_param x P`` CPU-seconds per push of a
  fragment of P parameters (receive, decode, merge, outer step, the quantized update and
  the condensed reply), whatever the number of learners.
- Memory: ``rss_bytes + P_s x (rss_per_param + rss_per_param_learner x N)`` for a shard
  owning P_s parameters with N live learners (the fragment's values, optimizer state and
  update buffers; per learner its int8 mirror and what its pushes in flight hold).
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


@dataclass(frozen=True)
class Costs:
    push_s: float
    push_s_per_param: float
    rss_bytes: float
    rss_per_param: float
    rss_per_param_learner: float
    wire_per_param: float


def fit(rows: Iterable[Mapping]) -> Costs:
    """Least squares over ``diloco bench load --json`` rows: CPU per push against the
    parameters per shard; a shard's RSS against its parameters and parameters x learners;
    wire bytes per parameter per push averaged."""
    import numpy as np

    rows = [r for r in rows if r.get("cpu_s_per_push")]
    if len(rows) < 3:
        raise InvalidArgument(f"fitting needs at least 3 measured configurations, got {len(rows)}")
    pps = np.array([r["params"] / r["shards"] for r in rows], dtype=float)
    learners = np.array([r["learners"] for r in rows], dtype=float)
    cpu = np.array([r["cpu_s_per_push"] for r in rows], dtype=float)
    (push_s, push_s_per_param), *_ = np.linalg.lstsq(np.stack([np.ones_like(pps), pps], 1), cpu, rcond=None)
    rss = np.array([r["rss_bytes"] / r["shards"] for r in rows], dtype=float)
    (rss0, rss_p, rss_pl), *_ = np.linalg.lstsq(np.stack([np.ones_like(pps), pps, pps * learners], 1), rss, rcond=None)
    wire = float(np.mean([r["mb_in_per_s"] * 1e6 / r["pushes_per_s"] / (r["params"] / r["shards"]) for r in rows]))
    return Costs(*(float(v) for v in (push_s, push_s_per_param, rss0, rss_p, rss_pl, wire)))


COSTS = Costs(push_s=0.0, push_s_per_param=0.0, rss_bytes=0.0, rss_per_param=0.0, rss_per_param_learner=0.0,
              wire_per_param=0.0)
"""``fit`` of the stored sweeps (docs/results/scale/fit.txt; a unit test refits them and
checks these figures)."""


def predict(costs: Costs, params_per_shard: float, learners: int) -> dict:
    """One shard's cost per push and its memory (the figures a bench load row reports)."""
    return {
        "cpu_s_per_push": costs.push_s + costs.push_s_per_param * params_per_shard,
        "rss_bytes": costs.rss_bytes + params_per_shard * (costs.rss_per_param + costs.rss_per_param_learner * learners),
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
    param_pushes_per_s = learners * params / period  # parameters crossing to the shards per second
    wire_bytes_per_s = param_pushes_per_s * costs.wire_per_param

    def cost(shards: int) -> tuple[float, float]:
        """CPU seconds per second and inbound Mbit/s of one of ``shards`` shards."""
        pushes = learners / period  # per shard: every learner pushes each shard's fragment once a period
        return (pushes * costs.push_s + param_pushes_per_s / shards * costs.push_s_per_param,
                wire_bytes_per_s / shards * 8 / 1e6)

    shards = 1
    while True:
        cpu, mbit = cost(shards)
        if (cpu <= utilization and mbit <= utilization * link_mbit) or shards >= params:
            break
        if learners / period * costs.push_s > utilization:  # the fixed cost per push alone saturates a shard
            raise InvalidArgument(
                f"{learners} learners pushing every {period:g} s cost a shard {learners / period * costs.push_s:.2f} "
                f"CPU-s/s in fixed costs alone, above the {utilization:g} allowed: push less often (a larger H or "
                "step time) or split the learners over runs")
        shards += 1
    pps = params / shards
    memory = predict(costs, pps, learners)["rss_bytes"]
    learner_mbit = params * costs.wire_per_param / period * 8 / 1e6
    return {
        "params": params, "learners": learners, "sync_every": sync_every, "step_s": step_s, "link_mbit": link_mbit,
        "utilization": utilization, "shards": shards, "params_per_shard": int(pps),
        "shard_cores": round(cpu, 3), "shard_rss_gb": round(memory / 1e9, 2),
        "shard_mbit_in": round(mbit, 1), "shard_mbit_out": round(mbit, 1),
        "learner_mbit_up": round(learner_mbit, 1), "learner_link_ok": learner_mbit <= link_mbit,
        "costs": asdict(costs),
    }
