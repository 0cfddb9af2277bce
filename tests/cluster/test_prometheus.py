"""Metrics in a real Prometheus: Debian's ``prometheus`` server on 127.0.0.1 scrapes every
process of a ``diloco local --prometheus`` run each second, finding them through the
targets file the run keeps (RUN_DIR/prometheus-targets.json, file_sd_configs). Afterwards
its HTTP query API must show every target up, each learner's training loss falling, the
shards' rounds, pushes and bytes growing (never past what their tapes recorded), and the
coordinator's member counts as the run had them.

``METRICS`` and ``LABELS`` are the names checked here, as the OpenTelemetry exporter writes
them; the Grafana dashboard (k8s/grafana/diloco-dashboard.json) uses exactly these
(tests/k8s/test_dashboard.py), and each of its queries must find data here."""

import collections
import json
import math
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from diloco.tape import read_tape
from tests.polling import poll
from tests.required import require_binary
from diloco.cli.local.config import PROMETHEUS_TARGETS

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

METRICS = (
    "diloco_learner_train_loss",
    "diloco_learner_tokens_per_second",
    "diloco_sync_latency_seconds_bucket",
    "diloco_round_closed_total",
    "diloco_push_received_total",
    "diloco_wire_bytes_total",
    "diloco_coordinator_members",
)
LABELS = ("diloco_learner_id", "diloco_shard_id", "diloco_state", "diloco_push_outcome", "diloco_direction")
"""The labels of those series the dashboard groups and filters by (besides ``le``)."""
DASHBOARD = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "diloco-dashboard.json"
LEARNERS, SHARDS = 3, 2
TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8"]
WHOLE_RUN = "[10m]"  # a range selector over the whole run: its raw samples


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A Prometheus server on 127.0.0.1 (its own storage in ``directory``) scraping the
    targets listed in ``targets_file`` every second; its query API."""

    def __init__(self, binary: str, directory, targets_file) -> None:
        directory.mkdir()
        config = directory / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [{"job_name": "diloco",
                                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "1s"}]}],
        }))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(directory / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        poll(self._ready, "Prometheus to be ready", timeout_s=60, procs=[("prometheus", self.proc)])

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError):  # not listening yet, or still starting (503)
            return False

    def _get(self, path: str, **params) -> object:
        with urllib.request.urlopen(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """``/api/v1/query``: an instant vector (``value``) or, for a range selector, each
        series' raw samples (``values``), as the API gives them."""
        return self._get("/api/v1/query", query=promql, **({"time": at} if at is not None else {}))["result"]

    def names(self) -> set[str]:
        return set(self._get("/api/v1/label/__name__/values"))

    def labels(self) -> set[str]:
        return set(self._get("/api/v1/labels"))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def samples(series: dict) -> list[tuple[float, float]]:
    return [(t, float(v)) for t, v in series["values"]]


def target(labels: dict) -> tuple[str, ...]:
    """Which process a series came from, by the labels of its target in the targets file."""
    return (labels["role"], labels.get("learner") or labels.get("shard") or "")


def tape_counts(run_dir) -> dict[int, dict]:
    """Per shard, from its tape: rounds closed per fragment, pushes received, their bytes."""
    counts = {}
    for m in range(SHARDS):
        records = list(read_tape(run_dir / f"shard{m}" / f"tape-S{m}.jsonl"))
        pushes = [r for r in records if r["kind"] == "push"]
        counts[m] = {"rounds": collections.Counter(str(r["fragment"]) for r in records if r["kind"] == "round"),
                     "pushes": len(pushes), "bytes_up": sum(r["bytes"] for r in pushes)}
    return counts


def by_shard(result: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """Each shard's samples summed over its series (fragments, outcomes), at each scrape."""
    summed: dict[str, dict[float, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for series in result:
        for t, v in samples(series):
            summed[series["metric"]["shard"]][t] += v
    return {shard: sorted(points.items()) for shard, points in summed.items()}


def test_a_real_prometheus_scrapes_every_process_of_a_local_run(tmp_path):
    binary = require_binary("prometheus", "apt-get install -y prometheus")
    out = tmp_path / "run"
    out.mkdir()  # empty, as --out takes it: Prometheus watches for the targets file from before the run starts
    prometheus = Prometheus(binary, tmp_path / "prometheus", out / PROMETHEUS_TARGETS)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "diloco", "local", "--prometheus", "--learners", str(LEARNERS), "--shards",
             str(SHARDS), "--steps", "1200", "--batch-size", "8", "--out", str(out), "--json", *TINY],
            capture_output=True, text=True, timeout=240,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        summary = json.loads(run.stdout)
        # The run keeps the file current: once it is over, no process is listed.
        assert json.loads((out / PROMETHEUS_TARGETS).read_text()) == []

        assert set(METRICS) <= prometheus.names(), sorted(set(METRICS) - prometheus.names())
        assert set(LABELS) <= prometheus.labels(), sorted(set(LABELS) - prometheus.labels())
        learners = {f"L{n}" for n in range(LEARNERS)}
        assert {record["id"] for record in summary["learners"]} == learners

        # The coordinator's members: every sample sums to the learners joined so far, none failed,
        # none in the scavenged pool; all three active at once; all three counted at the end.
        members: dict[float, dict[tuple[str, str], float]] = collections.defaultdict(dict)
        for series in prometheus.query(f"diloco_coordinator_members{WHOLE_RUN}"):
            labels = series["metric"]
            assert labels["role"] == "coordinator"
            for t, v in samples(series):
                members[t][labels["diloco_state"], labels["diloco_pool"]] = v
        timeline = sorted(members.items())
        assert len(timeline) >= 5, timeline
        for t, counts in timeline:
            assert counts.keys() == {(s, p) for s in ("joining", "active", "draining", "failed", "left")
                                     for p in ("default", "scavenged")}, counts
            assert sum(counts.values()) <= LEARNERS and counts["failed", "default"] == 0, (t, counts)
            assert not any(v for (_, pool), v in counts.items() if pool == "scavenged"), (t, counts)
        assert sum(timeline[-1][1].values()) == LEARNERS == summary["learners_joined"], timeline[-1]
        all_active = [t for t, counts in timeline if counts["active", "default"] == LEARNERS]
        assert all_active, timeline

        # Every process was a target, scraped more than once; while all learners trained, all
        # up. (Prometheus applies target changes at most every 5 s: a learner is scraped from
        # a few seconds after it joined, and a process that ended is scraped, down, a few times more.)
        up = {target(series["metric"]): samples(series) for series in prometheus.query(f"up{WHOLE_RUN}")}
        expected = {("coordinator", ""), *(("shard", str(m)) for m in range(SHARDS)),
                    *(("learner", i) for i in learners)}
        assert up.keys() == expected, up.keys()
        for process, points in up.items():
            assert sum(v for _, v in points) >= 3, (process, points)
        at = {target(s["metric"]): float(s["value"][1]) for s in prometheus.query("up", at=all_active[-1])}
        assert at == dict.fromkeys(expected, 1.0), at

        # Each query of the dashboard finds data then (Grafana's rate interval: 10 scrapes).
        for panel in json.loads(DASHBOARD.read_text())["panels"]:
            for query in panel["targets"]:
                result = prometheus.query(query["expr"].replace("$__rate_interval", "10s"), at=all_active[-1])
                values = [float(s["value"][1]) for s in result]
                assert values and all(math.isfinite(v) for v in values), (panel["title"], query["expr"], result)

        # Each learner's training loss: its own series (the target's learner and the
        # process's resource agree), finite, in a sane range, ending well below the untrained loss.
        losses = prometheus.query(f"diloco_learner_train_loss{WHOLE_RUN}")
        assert {s["metric"]["learner"] for s in losses} == learners
        for series in losses:
            assert series["metric"]["diloco_learner_id"] == series["metric"]["learner"], series["metric"]
            values = [v for _, v in samples(series)]
            assert len(values) >= 3 and all(math.isfinite(v) and 0 < v < 10 for v in values), values
            # Below the untrained model's loss (the run's start eval, same unit), by a margin. Not
            # "below its own first sample": learners start training before Prometheus first
            # scrapes them (it applies target changes every 5 s), and since the coordinator
            # seeds the shards they start sooner, so that sample may come after the loss levelled
            # off (the fresh-clone CI of 799191b: 3.1995 first, 3.2156 last).
            assert values[-1] < summary["eval_loss_start"] - 2.0, (values, summary["eval_loss_start"])
        rates = prometheus.query(f"diloco_learner_tokens_per_second{WHOLE_RUN}")
        assert {s["metric"]["learner"] for s in rates} == learners
        for series in rates:
            values = [v for _, v in samples(series)]
            assert all(math.isfinite(v) and v >= 0 for v in values) and max(values) > 0, values
        # Sync latency: the median of each learner's whole histogram, from its buckets.
        medians = prometheus.query("histogram_quantile(0.5, max by (learner, le) "
                                   f"(max_over_time(diloco_sync_latency_seconds_bucket{WHOLE_RUN})))")
        assert {s["metric"]["learner"] for s in medians} == learners
        for series in medians:
            assert 0 < float(series["value"][1]) < 30, series

        # The shards' counters grew and never passed what their tapes recorded.
        tapes = tape_counts(out)
        rounds = prometheus.query(f"diloco_round_closed_total{WHOLE_RUN}")
        for series in rounds:
            values = [v for _, v in samples(series)]
            assert values == sorted(values), series["metric"]
            assert series["metric"]["diloco_shard_id"] == series["metric"]["shard"], series["metric"]
            shard, fragment = int(series["metric"]["shard"]), series["metric"]["diloco_fragment"]
            assert 0 < values[-1] <= tapes[shard]["rounds"][fragment], (series["metric"], values, tapes[shard])
        assert {(int(s["metric"]["shard"]), s["metric"]["diloco_fragment"]) for s in rounds} == \
            {(m, f) for m in range(SHARDS) for f in tapes[m]["rounds"]}
        for name, selector, tape_key in (
            ("rounds", f"diloco_round_closed_total{WHOLE_RUN}", None),
            ("pushes", f"diloco_push_received_total{WHOLE_RUN}", "pushes"),
            ("push bytes", f'diloco_wire_bytes_total{{role="shard", diloco_direction="up"}}{WHOLE_RUN}', "bytes_up"),
        ):
            grown = by_shard(prometheus.query(selector))
            assert grown.keys() == {str(m) for m in range(SHARDS)}, (name, grown.keys())
            for shard, points in grown.items():
                first, last = points[0][1], points[-1][1]
                assert last > first, (name, shard, points)
                if tape_key is not None:
                    assert last <= tapes[int(shard)][tape_key], (name, shard, last, tapes[int(shard)])
    finally:
        prometheus.close()
