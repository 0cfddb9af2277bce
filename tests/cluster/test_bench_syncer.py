"""`diloco bench syncer` end to end on a small fragment: a real shard process, real client
processes, the do-nothing gRPC server; every figure it reports is measured."""

import pytest

from diloco.lab.bench import syncer as bench
from diloco.errors import InvalidArgument

pytestmark = pytest.mark.cluster


def test_bench_syncer_measures_every_figure_on_a_small_fragment():
    result = bench.run(params=64 * 1024, learners=2, rounds=2)
    assert (result["params"], result["learners"], result["rounds"]) == (64 * 1024, 2, 2)
    for key in ("tcp_loopback_mbps", "grpc_noop_mbps", "ingress_mbps", "merge_ms", "replies_ms", "memcpy_ms",
                "rounds_per_s", "shard_cpu_ms_per_round", "shard_mb_per_cpu_s", "rss_peak_mb"):
        assert result[key] > 0, key
    assert result["ingress_ratio"] == pytest.approx(result["ingress_mbps"] / result["tcp_loopback_mbps"], abs=2e-3)
    assert result["replies_ratio"] == pytest.approx(result["replies_ms"] / result["memcpy_ms"], abs=1e-2)
    assert result["ingress_vs_grpc"] == pytest.approx(result["ingress_mbps"] / result["grpc_noop_mbps"], abs=2e-3)
    # A shard without torch: far below the 300 MB the budget allows for the process itself.
    assert result["rss_peak_mb"] < 200


def test_bench_syncer_rejects_bad_sizes():
    with pytest.raises(InvalidArgument, match="multiple of 1024"):
        bench.run(params=1000)
