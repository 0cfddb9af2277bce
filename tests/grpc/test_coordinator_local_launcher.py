"""AddLearners / RemoveLearners through the LocalProcessLauncher, with a fake learner
script that Joins and Heartbeats through the real RPCs: launch, drain, terminate
(SIGTERM, then SIGKILL), launch failures in the reply, no orphans at shutdown."""

import dataclasses
import json
import sys
from pathlib import Path

import grpc
import pytest

from coordinator.config import LocalLauncherConfig
from diloco.v1 import coordinator_pb2
from tests.grpc.conftest import run
from tests.grpc.coordinator_fixtures import admin_stub, running_coordinator, wait_for

FAKE_LEARNER = (sys.executable, str(Path(__file__).resolve().parents[1] / "fake_learner.py"))


def local(**kw):
    return {"launcher": "local", "local": LocalLauncherConfig(command=FAKE_LEARNER, **kw)}


def test_add_drain_terminate_and_reap_learner_processes(tmp_path):
    async def scenario():
        # (no warm spares: the last launch below changes the learner command)
        async with running_coordinator(tmp_path, lease_s=5.0, **local(terminate_timeout_s=1.5, warm_spares=0)) as server:
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


def test_launches_go_to_warm_spares_and_no_spare_outlives_the_coordinator(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path, lease_s=5.0, **local(terminate_timeout_s=5.0, warm_spares=1)) as server:
            membership, launcher = server.runtime.membership, server.runtime.launcher
            logs = tmp_path / "coordinator" / "learners"

            async def add_one():
                reply = await stub.AddLearners(
                    coordinator_pb2.AddLearnersRequest(count=1, overrides={"heartbeat_s": "0.05"}), metadata=md)
                [launch] = reply.launches
                assert launch.ok, launch.detail
                assert launcher.spares == []  # none started (and none left) while a learner starts
                await wait_for(lambda: any(l.launch_id == launch.launch_id for l in membership.live()),
                               f"launch {launch.launch_id} to join")
                return launch.launch_id, int(launch.detail.split()[1].rstrip(","))

            async with admin_stub(server.address) as (stub, md):
                # The first launch takes the spare started with the coordinator, or its own
                # process; once it has joined (nothing is starting any more), a spare is started.
                cold, cold_pid = await add_one()
                await wait_for(lambda: len(launcher.spares) == 1, "a spare")
                [spare] = launcher.spares
                assert spare.pid != cold_pid and spare.returncode is None
                # The next launch is the spare: its pid, its log renamed to the launch's, the
                # launcher's flags read from stdin (and --standby gone); a new spare behind it.
                warm, warm_pid = await add_one()
                assert warm_pid == spare.pid
                argv = json.loads((logs / f"{warm}.log").read_text().splitlines()[0])["argv"]
                assert "--standby" not in argv and argv[argv.index("--launch-id") + 1] == warm
                assert argv[argv.index("--heartbeat-s") + 1] == "0.05"
                await wait_for(lambda: len(launcher.spares) == 1, "the next spare")
                [second_spare] = launcher.spares
                assert second_spare.pid not in (cold_pid, warm_pid)
                assert not list(logs.glob("spare-1.log"))
                # A spare that dies unassigned is passed over: the launch starts its own process.
                second_spare.kill()
                await second_spare.wait()
                await wait_for(lambda: second_spare not in launcher.spares, "the dead spare to be dropped")
                _, third_pid = await add_one()
                assert third_pid != second_spare.pid
                await wait_for(lambda: len(launcher.spares) == 1, "a spare again")
                [last_spare] = launcher.spares
        # The coordinator stopped: learners and the unassigned spare are gone; the spare
        # exited by itself when its stdin closed.
        assert last_spare.returncode == 0
        assert all(p.returncode is not None for p in (spare, last_spare))

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
