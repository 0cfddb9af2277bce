"""`diloco local` runs over mutual TLS by default: every process of the run talks mutual
TLS with the run's own CA (RUN_DIR/tls). The run trains and replays bit for bit; a plaintext client is refused by
the coordinator and the shards; `diloco admin --run-dir` uses the run's certificates."""

import asyncio
import json
import subprocess
import sys
import time

import grpc

from diloco.v1 import syncer_pb2, syncer_pb2_grpc
from tests.cluster.test_snapshot_restore import TINY


def test_a_local_run_over_mutual_tls(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "diloco", "local", "--learners", "2", "--shards", "2", "--steps", "300",
         "--batch-size", "8", "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_loss_final"] < summary["eval_loss_start"] - 1.0 and summary["rounds"] > 10
    assert sorted(p.name for p in (out / "tls").iterdir()) == ["ca.crt", "ca.key", "tls.crt", "tls.key"]
    replay = subprocess.run([sys.executable, "-m", "diloco", "replay", str(out), "--check"],
                            capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stdout + replay.stderr


def test_a_tls_run_refuses_plaintext_and_admin_uses_the_run_s_certificates(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "local", "--learners", "1", "--shards", "1", "--steps", "100000",
         "--out", str(out), *TINY],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        def admin(*args):
            return subprocess.run([sys.executable, "-m", "diloco", "admin", "--run-dir", str(out), *args],
                                  capture_output=True, text=True, timeout=60)

        deadline = time.monotonic() + 120
        while True:
            members = admin("members", "--json")
            if members.returncode == 0 and any(m["state"] == "active" for m in json.loads(members.stdout)):
                break
            assert time.monotonic() < deadline and proc.poll() is None, members.stderr + proc.stderr.read()
            time.sleep(0.5)
        endpoints = {e["role"]: e["address"] for e in json.loads((out / "endpoints.json").read_text())}

        async def plaintext_status(address):
            async with grpc.aio.insecure_channel(address) as channel:
                await syncer_pb2_grpc.SyncerStub(channel).Status(syncer_pb2.StatusRequest(), timeout=5)

        for role in ("coordinator", "shard0"):
            try:
                asyncio.run(plaintext_status(endpoints[role]))
                raise AssertionError(f"{role} answered a plaintext client")
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, (role, error)
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) in (0, 130)
