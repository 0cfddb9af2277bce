"""The whole control plane with real processes: 1 coordinator, 2 shards, 3 learners
launched by the coordinator; a snapshot mid-run; every process killed; restore from the
snapshot; training continues from the snapshot's versions."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys

import grpc
import pytest

from safetensors.torch import load_file

from diloco import auth
from diloco.errors import Unavailable
from diloco.clients.coordinator import AdminClient
from diloco.tasks.byte_gpt import GPT, ModelConfig
from diloco.snapshots import find_manifest, read_manifest
from diloco.syncer import snapshot as snapshot_files
from diloco.clients.syncer import SyncerClient, open_channel
from tests.polling import poll

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def versions(address: str) -> dict[int, int]:
    async def status():
        async with open_channel(address) as channel:
            reply = await SyncerClient(channel, auth.Credential("C", secret="cluster-secret"), timeout_s=5).status()
            return {f.fragment: f.version for f in reply.fragments}

    try:
        return asyncio.run(status())
    except grpc.aio.AioRpcError as e:  # not up yet; anything else fails the test
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return {}


class Cluster:
    def __init__(self, tmp, shard_ports):
        self.tmp, self.shard_ports, self.procs = tmp, shard_ports, []
        self.shards = [f"127.0.0.1:{p}" for p in shard_ports]
        self.coordinator_port = free_port()
        self.coordinator = f"127.0.0.1:{self.coordinator_port}"

    def spawn(self, name, args):
        log = open(self.tmp / f"{name}.log", "a")
        proc = subprocess.Popen([sys.executable, "-m", "diloco", "--insecure", *args], stdout=log, stderr=log)
        self.procs.append(proc)
        return proc

    def start(self, restore=None):
        common = ["--secret-file", str(self.tmp / "secret"), *TINY, "--batch-size", "4"]
        restore_flags = ["--restore", restore] if restore else []
        self.spawn("coordinator", [
            "coordinator", "--port", str(self.coordinator_port), "--data-dir", str(self.tmp / "coord"),
            "--shards", ",".join(self.shards), *restore_flags,
            "--learner-command", f"{sys.executable} -m diloco --insecure learner --steps 100000 --heartbeat-s 0.3",
            *common,
        ])
        for m, port in enumerate(self.shard_ports):
            self.spawn(f"shard{m}", [
                "syncer", "--shard-id", str(m), "--shards", "2", "--port", str(port), "--data-dir",
                str(self.tmp / f"shard{m}"), "--coordinator", self.coordinator, "--quorum", "2", "--grace", "0.2",
                "--snapshot-dir", str(self.tmp / "coord" / "snapshots"), *restore_flags, *common,
            ])
        token = poll(lambda: (self.tmp / "coord" / "admin-token").exists()
                     and (self.tmp / "coord" / "admin-token").read_text().strip(), "the admin token")
        return AdminClient(self.coordinator, token, timeout_s=10)

    def kill_all(self, admin):
        learner_pids = [int(m["address"].rsplit(":", 1)[1]) for m in admin.members()]
        for pid in learner_pids:
            os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.kill()
            proc.wait(timeout=30)
        self.procs = []


def test_snapshot_kill_everything_restore_and_continue(tmp_path):
    (tmp_path / "secret").write_text("cluster-secret")
    cluster = Cluster(tmp_path, [free_port(), free_port()])
    admin = None
    try:
        admin = cluster.start()
        assert all(r["ok"] for r in poll(lambda: _try(lambda: admin.add_learners(3)), "AddLearners"))
        poll(lambda: len([m for m in _try(admin.members) or [] if m["state"] == "active"]) == 3, "3 active learners")
        # Each shard owns 2 of the 4 fragments: both must have closed two rounds.
        poll(lambda: all(len(v := versions(s)) == 2 and min(v.values()) >= 2 for s in cluster.shards), "rounds")

        snapshot_id = admin.start_snapshot()
        snap = poll(lambda: next((s for s in admin.snapshots() if s["id"] == snapshot_id and s["state"] != "running"),
                                 None), "the snapshot")
        assert snap["state"] == "complete", snap
        manifest = read_manifest(find_manifest(tmp_path / "coord" / "snapshots", "latest"))
        recorded = {}
        for m in range(2):
            state = snapshot_files.loads(tmp_path / "coord" / "snapshots" / f"{snapshot_id:06d}" / f"S{m}-state.npz")
            recorded.update({int(f["id"]): int(f["version"]) for f in state["fragments"]})
        assert {p for p in manifest["participants"]} >= {"S0", "S1"}
        assert sum(1 for p in manifest["participants"] if p.startswith("L")) == 3

        cluster.kill_all(admin)
        admin.close()

        admin = cluster.start(restore="latest")
        restored = poll(lambda: {f: v for s in cluster.shards for f, v in versions(s).items()}
                        if all(versions(s) for s in cluster.shards) else None, "the restored shards")
        # Back at the snapshot's versions, plus at most the round its in-flight pushes complete.
        assert all(recorded[f] <= v <= recorded[f] + 1 for f, v in restored.items()), (recorded, restored)
        before = {m["id"] for m in admin.members(include_gone=True)}
        assert all(r["ok"] for r in admin.add_learners(3))
        poll(lambda: len(now := {f: v for s in cluster.shards for f, v in versions(s).items()}) == 4
             and all(v >= restored[f] + 2 for f, v in now.items()), "training to continue after the restore")
        # The three learners added after the restore are the ones training: new ids, active, stepping.
        poll(lambda: len([m for m in admin.members() if m["id"] not in before and m["state"] == "active"
                          and m["inner_steps"] > 0]) == 3, "the 3 new learners to report steps")
        # The operator exports the live global model; it loads into a fresh byte GPT.
        export = subprocess.run(
            [sys.executable, "-m", "diloco", "--insecure", "admin", "--coordinator", cluster.coordinator, "--token-file",
             str(tmp_path / "coord" / "admin-token"), "export", "--out", str(tmp_path / "model.safetensors"), "--json"],
            capture_output=True, text=True, timeout=120,
        )
        assert export.returncode == 0, export.stderr
        info = json.loads(export.stdout)
        assert {int(f): v for f, v in info["versions"].items()}.keys() == set(range(4))
        assert all(v >= restored[int(f)] for f, v in info["versions"].items())
        model = GPT(ModelConfig(width=32, depth=1, heads=2, context=32))
        model.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    finally:
        if admin is not None:
            try:
                cluster.kill_all(admin)
            except Exception:
                for proc in cluster.procs:
                    proc.kill()


def _try(fn):
    """``fn()``, or None while the coordinator is not serving yet; any other error fails."""
    try:
        return fn()
    except Unavailable:
        return None
