"""The capacity model (`diloco simulate --capacity`): its coefficients are the fit of the
stored `diloco bench load` sweeps, it predicts the sweeps' held-out points within 20 %,
and it sizes deployments consistently."""

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from diloco.config import RunConfig
from diloco.errors import InvalidArgument
from diloco.lab.simulate import capacity

SCALE = Path(__file__).resolve().parents[2] / "docs" / "results" / "scale"
FITTED = ("learners.jsonl", "params.jsonl", "params-64Mi.jsonl", "memory.jsonl")
"""The sweeps the coefficients are fitted to; the others are held out to check them."""
HELD_OUT = ("shards.jsonl", "soak.jsonl")


def _rows(*names: str) -> list[dict]:
    return [json.loads(line) for name in names for line in (SCALE / name).read_text().splitlines() if line.strip()]


def test_the_coefficients_are_the_fit_of_the_stored_sweeps():
    fitted = capacity.fit(capacity.fit_rows(_rows(*FITTED)))
    for name, value in asdict(capacity.COSTS).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-3, abs=1e-12), name


def test_held_out_measurements_are_predicted_as_the_docs_say():
    """What docs/results/scale/README.md claims of the held-out points: CPU per push within
    25 % (the 20 % target is missed at 4 Mi: a fragment that fits the caches costs less per
    parameter than the line through 1-64 Mi), peak RSS within 20 % but for one run whose
    peak was 1.8x the prediction (transient arrays the model does not describe)."""
    rows = capacity.fit_rows(_rows(*HELD_OUT))
    assert len(rows) == 4
    cpu, rss = [], []
    for row in rows:
        predicted = capacity.predict(capacity.COSTS, row["params"] / row["shards"], row["learners"])
        cpu.append(row["cpu_s_per_push"] / predicted["cpu_s_per_push"])
        rss.append(row["rss_bytes"] / row["shards"] / predicted["rss_bytes"])
    assert all(0.75 <= r <= 1.25 for r in cpu), cpu
    assert sum(0.8 <= r <= 1.2 for r in cpu) == 3, cpu
    assert sum(0.8 <= r <= 1.2 for r in rss) == 3 and max(rss) < 2, rss


def test_every_stored_configuration_ran_without_an_error():
    for row in _rows(*FITTED, *HELD_OUT):
        assert row["errors"] == {}, row


COSTS = capacity.Costs(push_s=0.01, push_s_per_param=5e-8, rss_bytes=1e8, rss_per_param=16.0,
                       rss_per_param_learner=1.0, rss_per_learner=2e5, wire_per_param=0.53, heartbeat_s=1e-3, heartbeat_s_per_learner=1e-6)


def test_the_fit_recovers_the_costs_that_made_the_rows():
    rows = []
    for learners, params, shards in [(4, 1 << 20, 1), (16, 1 << 20, 1), (64, 1 << 20, 1), (8, 1 << 24, 1),
                                     (8, 1 << 22, 2), (16, 1 << 26, 4), (64, 1 << 24, 1)]:
        pps = params / shards
        p = capacity.predict(COSTS, pps, learners)
        rows.append({"learners": learners, "params": params, "shards": shards, "cpu_s_per_push": p["cpu_s_per_push"],
                     "rss_bytes": p["rss_bytes"] * shards, "pushes_per_s": 2.0, "mb_in_per_s": 2.0 * pps * 0.53 / 1e6,
                     "coordinator_cpu_s_per_s": learners * (1e-3 + 1e-6 * learners)})
    fitted = capacity.fit(rows)
    for name, value in asdict(COSTS).items():
        assert getattr(fitted, name) == pytest.approx(value, rel=1e-6, abs=1e-12), name


def test_the_fit_refuses_rows_that_do_not_determine_the_costs():
    rows = []
    for params in (1 << 20, 1 << 22, 1 << 24, 1 << 26):  # one learner count only: memory per learner unknown
        p = capacity.predict(COSTS, params, 8)
        rows.append({"learners": 8, "params": params, "shards": 1, "cpu_s_per_push": p["cpu_s_per_push"],
                     "rss_bytes": p["rss_bytes"] * (1.1 if params == 1 << 22 else 1.0), "pushes_per_s": 1.0,
                     "mb_in_per_s": params * 0.53 / 1e6, "coordinator_cpu_s_per_s": 8e-3})
    with pytest.raises(InvalidArgument, match="do not determine the costs"):
        capacity.fit(rows)
    with pytest.raises(InvalidArgument, match="at least 4 measured configurations"):
        capacity.fit(rows[:3])


def test_plan_sizes_shards_to_the_cpu_and_the_link():
    row = capacity.plan(10**9, 64, sync_every=100, step_s=1.0, link_mbit=10_000, costs=COSTS)
    period = 100.0
    # 64 learners push 1e9 parameters per 100 s: 6.4e8 parameter-pushes/s at 5e-8 s each = 32 CPU-s/s,
    # plus 0.64 pushes/s x 0.01 s per shard; at 0.5 of a core each that is 65 shards.
    fixed = 64 / period * COSTS.push_s
    assert row["shards"] == math.ceil(64 * 1e9 / period * COSTS.push_s_per_param / (0.5 - fixed)) == 65
    assert row["shard_cores"] <= 0.5 and row["shard_mbit_in"] <= 0.5 * 10_000
    assert row["shard_rss_gb"] == pytest.approx((1e8 + 1e9 / 65 * (16 + 64) + 64 * 2e5) / 1e9, abs=0.01)
    assert row["learner_mbit_up"] == pytest.approx(1e9 * 0.53 / period * 8 / 1e6, abs=0.1)
    assert row["coordinator_cores"] == pytest.approx(64 * (1e-3 + 64e-6), abs=1e-3)
    # A slow link: the bandwidth decides.
    slow = capacity.plan(10**9, 64, sync_every=100, step_s=1.0, link_mbit=10, costs=COSTS)
    assert slow["shards"] == math.ceil(64 * 1e9 / period * 0.53 * 8 / 1e6 / 5) > row["shards"]
    assert slow["shard_mbit_in"] <= 5
    # More learners, more shards; pushing less often, fewer.
    assert capacity.plan(10**9, 256, 100, 1.0, 10_000, costs=COSTS)["shards"] > row["shards"]
    assert capacity.plan(10**9, 64, 400, 1.0, 10_000, costs=COSTS)["shards"] < row["shards"]


@pytest.mark.parametrize("kwargs,message", [
    ({"params": 0}, "must be >= 1"),
    ({"step_s": 0.0}, "step_s must be a positive number"),
    ({"link_mbit": float("nan")}, "link_mbit must be a positive number"),
    ({"utilization": 1.5}, r"utilization must be in \(0, 1\]"),
    ({"learners": 10_000, "sync_every": 1, "step_s": 0.1}, "per-push costs alone"),
    ({"params": 10**15}, "more than the 1024 a run can have"),
])
def test_plan_refuses_what_cannot_be_sized(kwargs, message):
    args = {"params": 10**9, "learners": 64, "sync_every": 100, "step_s": 1.0, "link_mbit": 10_000.0, **kwargs}
    with pytest.raises(InvalidArgument, match=message):
        capacity.plan(**args, costs=COSTS)


def test_the_cli_prints_the_worked_example_and_refuses_bad_input():
    proc = subprocess.run([sys.executable, "-m", "diloco", "simulate", "--capacity", "--params", "1G",
                           "--learners", "64", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(proc.stdout)
    assert row == capacity.plan(10**9, 64, RunConfig.sync_every_steps, 1.0, 10_000.0)
    proc = subprocess.run([sys.executable, "-m", "diloco", "simulate", "--capacity", "--params", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--params: '0' must be a positive whole number" in proc.stderr
