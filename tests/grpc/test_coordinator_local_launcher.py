"""AddLearners / RemoveLearners through the LocalProcessLauncher, with a fake learner
script that Joins and Heartbeats through the real RPCs: launch, drain, terminate
(SIGTERM, then SIGKILL), launch failures in the reply, no orphans at shutdown."""

import asyncio
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path

import grpc
import pytest

from diloco.coordinator.config import LocalLauncherConfig
from diloco.coordinator import forks
from diloco.v1 import coordinator_pb2
from tests.grpc.conftest import run
from tests.grpc.coordinator_fixtures import admin_stub, running_coordinator, wait_for

FAKE_LEARNER = (sys.executable, str(Path(__file__).resolve().parents[1] / "fake_learner.py"))


def local(**kw):
    return {"launcher": "local", "local": LocalLauncherConfig(**{"command": FAKE_LEARNER, **kw})}


def test_add_drain_terminate_and_reap_learner_processes(tmp_path):
    async def scenario():
        # (no fork server: the last launch below changes the learner command)
        async with running_coordinator(tmp_path, lease_s=5.0, **local(terminate_timeout_s=1.5, fork_server=False)) as server:
            membership, launcher = server.runtime.membership, server.runtime.launcher
            async with admin_stub(server.address) as (stub, md):
                reply = await stub.AddLearners(
                    coordinator_pb2.AddLearnersRequest(count=3, overrides={"heartbeat_s": "0.05"}), metadata=md
                )
                assert [r.ok for r in reply.launches] == [True] * 3
                assert all(r.detail.startswith("pid ") for r in reply.launches)
                await wait_for(lambda: [l.state for l in membership.live()] == ["active"] * 3, "3 active learners")
                by_id = {l.id: l for l in membership.live()}
                processes = dict(launcher.processes)
                assert {l.launch_id for l in by_id.values()} == set(processes)
                log = (tmp_path / "coordinator" / "learners" / f"{by_id['L0'].launch_id}.log").read_text()
                argv = json.loads(log.splitlines()[0])["argv"]
                assert argv[argv.index("--pool") + 1] == "default" and argv[argv.index("--heartbeat-s") + 1] == "0.05"
                assert argv[argv.index("--coordinator") + 1] == server.address

                # Drain: the directive comes with the next heartbeat; the learner leaves and exits 0.
                drained = await stub.RemoveLearners(coordinator_pb2.RemoveLearnersRequest(count=1, drain=True), metadata=md)
                newest = list(drained.learner_ids)
                assert len(newest) == 1 and newest[0] in by_id
                await wait_for(lambda: membership.learner(newest[0]).state == "left", "the drained learner to leave")
                assert membership.learner(newest[0]).reason == "drained"
                await processes[by_id[newest[0]].launch_id].wait()
                assert processes[by_id[newest[0]].launch_id].returncode == 0

                # Terminate: gone at once for the shards; the process gets SIGTERM.
                (victim,) = [i for i in by_id if i not in newest][:1]
                removed = await stub.RemoveLearners(coordinator_pb2.RemoveLearnersRequest(learner_ids=[victim]), metadata=md)
                assert list(removed.learner_ids) == [victim]
                assert membership.learner(victim).state == "left"
                await processes[by_id[victim].launch_id].wait()

                # A learner that ignores SIGTERM is killed after the timeout (the operator's
                # learner command says so: launch overrides are learner settings only).
                launcher.cfg = dataclasses.replace(launcher.cfg, command=(*FAKE_LEARNER, "--ignore-sigterm", "1"))
                reply = await stub.AddLearners(
                    coordinator_pb2.AddLearnersRequest(count=1, overrides={"heartbeat_s": "0.05"}), metadata=md,
                )
                stubborn_launch = reply.launches[0].launch_id
                stubborn = launcher.processes[stubborn_launch]
                await wait_for(lambda: any(l.launch_id == stubborn_launch for l in membership.live()), "it to join")
                (stubborn_id,) = [l.id for l in membership.live() if l.launch_id == stubborn_launch]
                await stub.RemoveLearners(coordinator_pb2.RemoveLearnersRequest(learner_ids=[stubborn_id]), metadata=md)
                assert await stubborn.wait() == -9
                # Before the SIGKILL it was asked for its threads' stacks: a hang says where it was.
                stubborn_log = (tmp_path / "coordinator" / "learners" / f"{stubborn_launch}.log").read_text()
                assert "most recent call first" in stubborn_log
            survivors = [p for p in launcher.processes.values()]
            assert len(survivors) == 1
        # The coordinator stopped: its last child was stopped with it, none is left behind.
        assert all(p.returncode is not None for p in processes.values())
        assert membership.learner([i for i in by_id if i not in (newest[0], victim)][0]).reason == "stopped with the coordinator"

    run(scenario())


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not forks.available(), reason="fork servers need os.pidfd_open (Linux)")
def test_launches_are_forked_by_the_fork_server_and_nothing_outlives_the_coordinator(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path, lease_s=5.0, **local(terminate_timeout_s=5.0)) as server:
            membership, launcher = server.runtime.membership, server.runtime.launcher
            logs = tmp_path / "coordinator" / "learners"

            async def add(count):
                reply = await stub.AddLearners(
                    coordinator_pb2.AddLearnersRequest(count=count, overrides={"heartbeat_s": "0.05"}), metadata=md)
                assert all(launch.ok for launch in reply.launches), reply
                ids = [launch.launch_id for launch in reply.launches]
                await wait_for(lambda: {l.launch_id for l in membership.live()} >= set(ids), f"{ids} to join")
                return ids

            async with admin_stub(server.address) as (stub, md):
                # The fork server starts with the coordinator; both launches are its children,
                # each leading a session of its own, with the launcher's flags (and no
                # --fork-server) and its own log.
                first, second = await add(2)
                fork_server = launcher.fork_server.process
                for launch_id in (first, second):
                    pid = launcher.processes[launch_id].pid
                    assert _parent(pid) == fork_server.pid and os.getsid(pid) == pid
                    argv = json.loads((logs / f"{launch_id}.log").read_text().splitlines()[0])["argv"]
                    assert forks.FLAG not in argv and argv[argv.index("--launch-id") + 1] == launch_id
                    assert argv[argv.index("--heartbeat-s") + 1] == "0.05"
                assert "Traceback" not in (logs / "fork-server.log").read_text()
                # A killed learner's end is reported by the server (its exit code, its slot freed).
                killed = launcher.processes[first]
                os.kill(killed.pid, signal.SIGKILL)
                assert await killed.wait() == -9
                await wait_for(lambda: first not in launcher.processes, "the killed learner's end")
                # The server killed: the learner it forked is stopped (out of the launcher's reach
                # otherwise) and says why; the next launch gets a new server.
                orphan = launcher.processes[second]
                fork_server.kill()
                assert await orphan.wait() == -9 and "its fork server" in orphan.failure
                [third] = await add(1)
                assert launcher.fork_server.process.pid != fork_server.pid
                assert _parent(launcher.processes[third].pid) == launcher.fork_server.process.pid
                last = launcher.processes[third]
                last_server = launcher.fork_server.process
        # The coordinator stopped: its learner with it, then the server (its stdin closed).
        assert last.returncode is not None
        assert last_server.returncode == 0

    run(scenario())


def test_a_command_that_cannot_serve_forks_gets_processes_of_its_own(tmp_path):
    async def scenario():
        refuses = (*FAKE_LEARNER, "--refuse-fork-server")
        async with running_coordinator(tmp_path, lease_s=5.0, **local(command=refuses)) as server:
            membership, launcher = server.runtime.membership, server.runtime.launcher
            async with admin_stub(server.address) as (stub, md):
                for joined in (1, 2, 3, 4):
                    reply = await stub.AddLearners(
                        coordinator_pb2.AddLearnersRequest(count=1, overrides={"heartbeat_s": "0.05"}), metadata=md)
                    assert reply.launches[0].ok, reply
                    await wait_for(lambda: len(membership.live()) == joined, f"learner {joined} to join")
                    process = launcher.processes[reply.launches[0].launch_id]
                    assert isinstance(process, asyncio.subprocess.Process) and _parent(process.pid) == os.getpid()
            # Each server that ended cost one try; after three, launches no longer start one.
            assert launcher._fork_server_failures == launcher._MAX_FORK_SERVER_FAILURES
            assert "fork server refused" in (tmp_path / "coordinator" / "learners" / "fork-server.log").read_text()

    run(scenario())


def test_launch_failures_come_back_in_the_reply(tmp_path):
    async def scenario():
        cfg = {"launcher": "local", "local": LocalLauncherConfig(command=(str(tmp_path / "no-such-learner"),))}
        async with running_coordinator(tmp_path, **cfg) as server:
            async with admin_stub(server.address) as (stub, md):
                reply = await stub.AddLearners(coordinator_pb2.AddLearnersRequest(count=2), metadata=md)
                assert [r.ok for r in reply.launches] == [False, False]
                assert "cannot start" in reply.launches[0].detail and "No such file" in reply.launches[0].detail
                assert server.runtime.membership.occupied() == 0  # failed launches hold no slot
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.AddLearners(coordinator_pb2.AddLearnersRequest(count=1, overrides={"pool": "x"}), metadata=md)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "--pool is set by the launcher" in info.value.details()

    run(scenario())


def test_a_launched_learner_that_crashes_before_joining_frees_its_slot(tmp_path):
    async def scenario():
        crashes = (sys.executable, "-c", "import sys; print('starting'); sys.exit('diloco: error: no such task')")
        cfg = {"launcher": "local", "local": LocalLauncherConfig(command=crashes)}
        async with running_coordinator(tmp_path, **cfg) as server:
            async with admin_stub(server.address) as (stub, md):
                reply = await stub.AddLearners(coordinator_pb2.AddLearnersRequest(count=1), metadata=md)
            assert reply.launches[0].ok
            await wait_for(lambda: server.runtime.membership.occupied() == 0, "the slot to be freed")
            # ... and is listed with how it ended and its last log lines.
            [failed] = server.runtime.list_launches()
            assert failed.launch_id == reply.launches[0].launch_id
            assert failed.detail == "ended before joining: exit code 1: starting | diloco: error: no such task"

    run(scenario())
