"""`diloco bench load` end to end, small: synthetic learners join a real coordinator over
mutual TLS and push to a real shard; every figure is measured, no call fails."""

import json
import math
import subprocess
import sys

import pytest

from diloco.errors import InvalidArgument
from diloco.lab.bench.load import LoadConfig, run_one

pytestmark = pytest.mark.cluster


def test_bench_load_runs_learners_through_a_real_coordinator_and_shards():
    cfg = LoadConfig(learners=6, params=128 * 1024, shards=2, seconds=6, warmup_s=2, step_s=0.1, sync_every=4)
    result = run_one(cfg)
    assert result["errors"] == {}, result["error_examples"]
    assert result["joined"] == 6
    # 6 learners x 2 fragments every 0.4 s offer 30 pushes/s; on 2 shared cores most of them go through.
    assert result["offered_pushes_per_s"] == 30
    assert 0.5 * 30 <= result["pushes_per_s"] <= 30 * 1.1
    # Quorum 1: about one round per push (a push that lands while a round computes joins the next).
    assert 0.3 * result["pushes_per_s"] <= result["rounds_per_s"] <= result["pushes_per_s"] * 1.05
    for key in ("cpu_s_per_push", "cpu_s_per_round", "p50_reply_ms", "p99_reply_ms", "p99_ack_ms", "mb_in_per_s",
                "mb_out_per_s", "coordinator_cpu_s_per_s"):
        assert result[key] > 0 and math.isfinite(result[key]), key
    assert result["p50_reply_ms"] <= result["p99_reply_ms"]
    # int4 pushes: about half a byte per parameter and push (0.44 framed at 1 Mi: zstd takes some).
    per_push = result["mb_in_per_s"] * 1e6 / result["pushes_per_s"] / (cfg.params / cfg.shards)
    assert 0.3 < per_push < 0.7
    # Two shard processes without torch, each well under 200 MB.
    assert 2 * 40e6 < result["rss_bytes"] < 2 * 200e6


@pytest.mark.parametrize("change,message", [
    ({"learners": 0}, "learners must be in"),
    ({"params": 1000}, "multiple of 1024"),
    ({"params": 3 * 1024, "shards": 2}, "multiple of 1024 x shards"),
    ({"seconds": 0}, "seconds must be > 0"),
    ({"shards": 17}, "shards must be in"),
])
def test_bench_load_refuses_bad_sizes(change, message):
    with pytest.raises(InvalidArgument, match=message):
        LoadConfig(**change).check()


def test_bench_load_cli_refuses_bad_input_in_one_line_before_starting():
    proc = subprocess.run([sys.executable, "-m", "diloco", "bench", "load", "--learners", "4,0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "argument --learners: expected a positive whole number" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "diloco", "bench", "load", "--learners", "2000", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "learners must be in [1, 1024], got 2000" in proc.stderr and proc.stdout == ""
    with pytest.raises(json.JSONDecodeError):
        json.loads(proc.stdout)
