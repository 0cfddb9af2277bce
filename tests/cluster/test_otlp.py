"""OpenTelemetry end to end with real processes: a coordinator, a shard and a learner the
coordinator launches, each exporting with the real OTLP/gRPC exporter to a receiver in
this test (the collector's trace service on 127.0.0.1). The receiver gets spans from all
three services, and a learner's ``sync fragment`` and the shard's ``push`` share a trace:
sync fragment -> the PushFragment client span -> its server span -> push."""

import os
import signal
import subprocess
import sys

import pytest

from diloco.clients.coordinator import AdminClient
from diloco.lab.bench.otlp import OtlpReceiver
from tests.grpc.conftest import SECRET
from tests.polling import poll

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "2", "--sync-every", "4"]
SERVER, CLIENT = 2, 3  # OTLP span kinds



def test_every_process_exports_and_a_sync_and_its_push_share_a_trace(tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    with OtlpReceiver() as receiver:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_METRIC_EXPORT_INTERVAL": "1000"}
        env.pop("OTEL_SDK_DISABLED", None)
        common = ["--secret-file", str(tmp_path / "secret"), *TINY, "--batch-size", "4", "--task-option", "eval_batches=1"]
        procs = []

        def spawn(name, args):
            log = open(tmp_path / f"{name}.log", "w")
            proc = subprocess.Popen([sys.executable, "-m", "diloco", "--insecure", "--log-level", "INFO", *args],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
            procs.append((name, proc))
            return proc

        try:
            spawn("shard", ["syncer", "--learners", "L0", "--port-file", str(tmp_path / "shard-port"), *common])
            shard = poll(lambda: (tmp_path / "shard-port").exists() and (tmp_path / "shard-port").read_text().strip(),
                         "the shard", procs=procs)
            learner = f"{sys.executable} -m diloco --insecure --log-level INFO learner --steps 16 --eval-every 8 --heartbeat-s 0.2"
            spawn("coordinator", ["coordinator", "--data-dir", str(tmp_path / "coordinator"), "--shards", shard,
                                  "--port-file", str(tmp_path / "coordinator-port"), "--learner-command", learner, *common])
            address = poll(lambda: (tmp_path / "coordinator-port").exists()
                           and (tmp_path / "coordinator-port").read_text().strip(), "the coordinator", procs=procs)
            admin = AdminClient(address, (tmp_path / "coordinator" / "admin-token").read_text().strip())
            try:
                assert [r["ok"] for r in admin.add_learners(1)] == [True]
                # The learner trains, syncs, leaves and exits: its spans are flushed at exit.
                poll(lambda: any(m["state"] == "left" for m in admin.members(include_gone=True)), "the learner to leave",
                     procs=procs, timeout_s=90)
            finally:
                admin.close()

            def synced():
                spans = receiver.spans()
                services = {s.service for s in spans}
                return spans if {"diloco-learner", "diloco-syncer", "diloco-coordinator"} <= services and any(
                    s.name == "sync fragment" and s.attributes.get("diloco.outcome") == "applied" for s in spans) else None

            spans = poll(synced, "spans from all three services", procs=procs, timeout_s=30)
        finally:
            for _, proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for _, proc in procs:
                proc.wait(timeout=30)
        assert [proc.returncode for _, proc in procs] == [0, 0], [(tmp_path / f"{n}.log").read_text()[-2000:] for n, _ in procs]
        spans = receiver.spans()  # with what the shard and the coordinator flushed at exit
        metrics = receiver.metrics()

    by_id = {s.span_id: s for s in spans}
    syncs = [s for s in spans if s.name == "sync fragment" and s.attributes.get("diloco.outcome") == "applied"]
    pushes = {s.trace_id: s for s in spans if s.name == "push" and s.service == "diloco-syncer"}
    joined = [(sync, pushes[sync.trace_id]) for sync in syncs if sync.trace_id in pushes]
    assert joined, "no learner sync span shares a trace with a shard push span"
    sync, push = joined[0]
    server = by_id[push.parent_span_id]
    client = by_id[server.parent_span_id]
    assert (server.service, server.kind, server.name) == ("diloco-syncer", SERVER, "/diloco.v1.Syncer/PushFragment")
    assert (client.service, client.kind, client.name) == ("diloco-learner", CLIENT, "/diloco.v1.Syncer/PushFragment")
    assert client.parent_span_id == sync.span_id and sync.parent_span_id == ""
    assert sync.resource["diloco.learner.id"] == "L0" and sync.resource["diloco.pool"] == "default"
    assert push.resource["diloco.shard.id"] == 0
    assert sync.attributes["diloco.learner.id"] == push.attributes["diloco.learner.id"] == "L0"

    rounds = [s for s in spans if s.name == "round"]
    assert rounds and all(s.service == "diloco-syncer" and s.links for s in rounds)
    assert any((push.trace_id, push.span_id) in r.links for r in rounds)
    coordinator = {s.name for s in spans if s.service == "diloco-coordinator"}
    assert {"/diloco.v1.Coordinator/Heartbeat", "/diloco.v1.Coordinator/Leave"} <= coordinator
    assert not any("grpc.health" in s.name for s in spans)  # probes are not traced

    exported = {name for _, name in metrics}
    assert {"diloco.sync.latency", "diloco.round.participants", "diloco.learner.tokens",
            "diloco.learner.train_loss", "diloco.learner.eval_loss"} <= exported, exported
