"""The coordinator SIGKILLed mid-run and started again on its data directory, with
learners that are not its children (as pods are): the learners train through the outage
and reconnect with the credentials issued before the crash, nobody is counted twice, the
shards never see a learner fail, a revoked credential stays revoked, the snapshot
catalogue goes on from where it was; and once the coordinator is gone for good, the
learners leave by themselves after --coordinator-loss-timeout-s."""

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest

from diloco.clients.coordinator import AdminClient
from diloco import auth
from diloco.errors import Unavailable
from diloco.tape import read_tape
from diloco.v1 import coordinator_pb2, coordinator_pb2_grpc
from diloco.clients.syncer import SyncerClient, open_channel
from tests.cluster.test_snapshot_restore import TINY, free_port
from tests.polling import poll

pytestmark = pytest.mark.cluster

SECRET = "crash-secret"
LEASE_S = 8  # generous: on a loaded 2-core machine a learner's heartbeat thread can stall for seconds
OUTAGE_S = LEASE_S + 2  # longer than a lease: only the restarted coordinator's fresh leases keep them
LOSS_TIMEOUT_S = 30



def shard_versions(address: str) -> dict[int, int]:
    """A shard's fragment versions; raises if it does not answer (no silent empty answer)."""
    async def status():
        async with open_channel(address) as channel:
            reply = await SyncerClient(channel, auth.Credential("C", secret=SECRET), timeout_s=5).status()
            return {f.fragment: f.version for f in reply.fragments}

    return asyncio.run(status())


def heartbeat_as(address: str, learner_id: str) -> tuple[grpc.StatusCode, str]:
    """A heartbeat with the credential the run issued to ``learner_id``: (code, details)."""
    async def beat():
        async with grpc.aio.insecure_channel(address) as channel:
            metadata = ((auth.LEARNER_METADATA, learner_id), (auth.CREDENTIAL_METADATA, auth.sign(SECRET, learner_id)))
            try:
                await coordinator_pb2_grpc.CoordinatorStub(channel).Heartbeat(
                    coordinator_pb2.HeartbeatRequest(learner_id=learner_id), metadata=metadata, timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code(), error.details()
            return grpc.StatusCode.OK, ""

    return asyncio.run(beat())


class Run:
    def __init__(self, tmp):
        self.tmp = tmp
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.shard_ports = [free_port(), free_port()]
        self.shards = [f"127.0.0.1:{p}" for p in self.shard_ports]
        self.coordinator = None
        self.others = []

    def spawn(self, name, args):
        log = open(self.tmp / f"{name}.log", "a")
        return subprocess.Popen([sys.executable, "-m", "diloco", "--insecure", "--log-level", "INFO", *args], stdout=log, stderr=log)

    def start_coordinator(self) -> AdminClient:
        self.coordinator = self.spawn("coordinator", [
            "coordinator", "--port", str(self.port), "--data-dir", str(self.tmp / "coord"), "--launcher", "none",
            "--shards", ",".join(self.shards), "--lease-s", str(LEASE_S), "--secret-file", str(self.tmp / "secret"),
            *TINY, "--batch-size", "4",
        ])
        token = poll(lambda: (self.tmp / "coord" / "admin-token").exists()
                     and (self.tmp / "coord" / "admin-token").read_text().strip(), "the admin token")
        admin = AdminClient(self.address, token, timeout_s=10)
        poll(lambda: _answers(admin), "the coordinator to answer")
        return admin

    def start_shards(self):
        for m, port in enumerate(self.shard_ports):
            self.others.append(self.spawn(f"shard{m}", [
                "syncer", "--shard-id", str(m), "--shards", "2", "--port", str(port), "--data-dir",
                str(self.tmp / f"shard{m}"), "--coordinator", self.address, "--secret-file", str(self.tmp / "secret"),
                "--snapshot-dir", str(self.tmp / "coord" / "snapshots"), *TINY, "--batch-size", "4",
            ]))

    def start_learner(self, n: int) -> subprocess.Popen:
        proc = self.spawn(f"learner{n}", [
            "learner", "--coordinator", self.address, "--join-token-file", str(self.tmp / "coord" / "join-token"),
            "--steps", "100000", "--heartbeat-s", "0.3", "--coordinator-loss-timeout-s", str(LOSS_TIMEOUT_S),
        ])
        self.others.append(proc)
        return proc

    def stop(self):
        for proc in [self.coordinator, *self.others]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def _answers(admin) -> bool:
    try:
        admin.members()
        return True
    except Unavailable:  # not serving yet; any other error fails the test
        return False


def test_a_coordinator_sigkilled_and_restarted_keeps_its_members_credentials_and_catalogue(tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    run = Run(tmp_path)
    admin = run.start_coordinator()
    try:
        run.start_shards()
        learners = [run.start_learner(n) for n in range(3)]
        # Training, not only active: a learner heartbeats (and turns active) before its model is
        # registered and bootstrapped, and one removed then leaves with its RegisterModel refused.
        # (Steps, not tokens: they joined with the run's join credential, which credits none.)
        poll(lambda: sorted(m["id"] for m in admin.members() if m["state"] == "active" and m["inner_steps"] > 0)
             == ["L0", "L1", "L2"], "three learners training")
        poll(lambda: min(shard_versions(run.shards[0]).values(), default=0) >= 3, "shard 0 to merge rounds")
        by_id = {m["id"]: next(p for p in learners if p.pid == int(m["address"].rsplit(":", 1)[1]))
                 for m in admin.members()}
        # L2 is removed: its credential is revoked, its process leaves.
        admin.remove_learners(["L2"])
        assert by_id["L2"].wait(timeout=60) == 0
        kept = [by_id["L0"], by_id["L1"]]
        first = admin.start_snapshot()
        poll(lambda: next(s for s in admin.snapshots() if s["id"] == first)["state"] == "complete", "snapshot 1")
        steps_before = {m["id"]: m["inner_steps"] for m in admin.members()}
        versions_before = shard_versions(run.shards[0])

        run.coordinator.send_signal(signal.SIGKILL)
        run.coordinator.wait(timeout=10)
        time.sleep(OUTAGE_S)  # the learners' heartbeats fail meanwhile
        assert all(p.poll() is None for p in kept), "a learner stopped while the coordinator was down"
        # The shards kept merging the learners' pushes without a coordinator.
        assert sum(shard_versions(run.shards[0]).values()) > sum(versions_before.values())

        admin.close()
        admin = run.start_coordinator()
        members = admin.members(include_gone=True)
        assert sorted((m["id"], m["state"]) for m in members) == [("L0", "active"), ("L1", "active"), ("L2", "left")]
        # The same learners heartbeat again with the credentials issued before the crash and
        # report progress made across it; nobody joined twice.
        def progressed():
            live = {m["id"]: m for m in admin.members()}
            assert set(live) == {"L0", "L1"}, live  # neither failed nor re-joined under a new id
            return all(live[i]["inner_steps"] > steps_before[i] for i in ("L0", "L1"))

        poll(progressed, "L0 and L1 to report progress after the restart")
        assert sorted(m["id"] for m in admin.members(include_gone=True)) == ["L0", "L1", "L2"]
        assert heartbeat_as(run.address, "L0") == (grpc.StatusCode.OK, "")
        code, details = heartbeat_as(run.address, "L2")
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "L2 has left" in details, (code, details)
        # The snapshot catalogue survived: the next snapshot is 2 and the learners report it.
        second = admin.start_snapshot()
        assert second == first + 1
        poll(lambda: next(s for s in admin.snapshots() if s["id"] == second)["state"] == "complete", "snapshot 2")
        assert next(s for s in admin.snapshots() if s["id"] == first)["state"] == "complete"
        # No shard saw L0 or L1 fail across the outage.
        for m in range(2):
            failed = [r for r in read_tape(tmp_path / f"shard{m}" / f"tape-S{m}.jsonl")
                      if r["kind"] == "membership" and r["event"] == "failed" and r["learner"] in ("L0", "L1")]
            assert failed == [], failed

        # Gone for good: the learners leave by themselves (exit 0) after the loss timeout.
        run.coordinator.send_signal(signal.SIGKILL)
        run.coordinator.wait(timeout=10)
        killed = time.monotonic()
        for proc in kept:
            assert proc.wait(timeout=LOSS_TIMEOUT_S + 60) == 0
        assert time.monotonic() - killed >= LOSS_TIMEOUT_S - 1
        for n in range(3):
            if learners[n] in kept:
                assert f"lost the coordinator at {run.address}" in (tmp_path / f"learner{n}.log").read_text()
    finally:
        admin.close()
        run.stop()
