"""`diloco bench codec` and `diloco bench learner` as a user runs them, small: every
figure is measured (positive) and every ratio equals its printed parts."""

import json
import subprocess
import sys

import pytest

from diloco.config import RunConfig
from diloco.cli.metrics import supervisor_task

pytestmark = pytest.mark.cluster


def bench(*args, timeout=300):
    proc = subprocess.run([sys.executable, "-m", "diloco", "--insecure", "bench", *args, "--json"],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bench_codec_ratios_are_their_parts():
    r = bench("codec", "--size-mib", "1", "--repeats", "2")
    assert (r["size_mib"], r["repeats"], r["statistic"], r["kernel"]) == (1, 2, "best", "c")
    for key in ("memcpy_gbps", "quantize_gbps", "dequantize_gbps", "zstd_gbps", "unzstd_gbps", "encode_gbps",
                "decode_gbps"):
        assert r[key] > 0, key
    assert r["quantize_ratio"] == round(r["quantize_gbps"] / r["memcpy_gbps"], 3)
    assert r["dequantize_ratio"] == round(r["dequantize_gbps"] / r["memcpy_gbps"], 3)
    # int4 codes of N(0, 1) data carry under 4 bits of entropy each: zstd shrinks them, a little.
    assert 0.5 < r["zstd_ratio"] < 1.0, r
    # The sparse codec: 16 of 128 kept (indices, codes, a scale), and all 128 at 2 bits.
    assert (r["sparse_bits_per_value"], r["dense2_bits_per_value"]) == (1.375, 2.125), r
    for key in ("sparse_quantize_ratio", "sparse_dequantize_ratio", "dense2_quantize_ratio", "dense2_dequantize_ratio"):
        assert r[key] > 0, key


def test_bench_codec_refuses_a_bad_size():
    proc = subprocess.run([sys.executable, "-m", "diloco", "bench", "codec", "--size-mib", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "must be positive" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_learner_ratio_is_its_parts_and_the_learner_synced():
    r = bench("learner", "--steps", "10")
    assert (r["steps"], r["overlap_steps"]) == (10, 2)
    assert r["tokens_per_s_sync"] > 0 and r["tokens_per_s_nosync"] > 0
    assert r["ratio"] == pytest.approx(r["tokens_per_s_sync"] / r["tokens_per_s_nosync"], abs=1.5e-3)
    # The synced runs really synced: pushes acknowledged, bytes on the wire, none dropped.
    assert r["pushes_acked"] >= 1 and r["pushes_dropped"] == 0 and r["bytes_per_1k_tokens"] > 0, r
    assert r["params"] == sum(p.numel() for p in supervisor_task(RunConfig(), 1).model.parameters())


def test_slowpage_bench_runs_against_a_real_coordinator():
    """``diloco.lab.bench.slowpage``, small: a real coordinator, 40 trickling clients, every
    figure measured (it once joined with a credential format the coordinator no longer took,
    and failed at its first step unnoticed)."""
    proc = subprocess.run([sys.executable, "-m", "diloco.lab.bench.slowpage", "--connections", "40",
                           "--interval-s", "0.5", "--seconds", "3"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert result["server"] == "current" and result["threads_max"] <= 64
    for window in ("before", "during"):
        for key in ("get_ms", "connect_ms", "heartbeat_ms"):
            figures = result[window][key]
            assert figures["n"] > 0 and figures["failed"] == 0 and figures["max"] >= figures["p50"] > 0, (window, key)
    # every client connected: it holds its connection, or the page's 5 s deadline closed it
    # (the clients live about 5.5 s here) and it is connecting again
    slow = result["slow"]
    assert slow["connect_failed"] == 0 and 0 < slow["open"] <= 40 and slow["open"] + slow["closed_by_server"] >= 40, slow
