"""Join credentials on a real coordinator on 127.0.0.1: each admits at most its signed
limit of learners at once (PERMISSION_DENIED naming it beyond), a forged or old-format one
is UNAUTHENTICATED, the counts outlive a coordinator restart, the learners the coordinator
launches get one each, and `diloco admin join-credential` mints one that joins."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from diloco import auth
from diloco.clients.coordinator import LearnerSession
from diloco.errors import DilocoError, PermissionDenied, Unauthenticated
from tests.grpc.conftest import SECRET, run
from tests.grpc.coordinator_fixtures import reconnect, running_coordinator


async def _join(address, credential):
    session = LearnerSession(address, timeout_s=10)
    await session.join(credential, address="test")
    return session


def test_a_credential_admits_its_limit_and_refuses_the_rest_across_a_restart(tmp_path):
    one, three = auth.join_credential(SECRET, "solo", 1), auth.join_credential(SECRET, "trio", 3)

    async def scenario():
        async with running_coordinator(tmp_path) as server:
            first = await _join(server.address, one)
            with pytest.raises(DilocoError, match=r"join credential 'solo' admits at most 1 learner at once") as refused:
                await _join(server.address, one)
            assert isinstance(refused.value, PermissionDenied)
            trio = [await _join(server.address, three) for _ in range(3)]
            assert [s.learner_id for s in trio] == ["L1", "L2", "L3"]
            with pytest.raises(DilocoError, match=r"'trio' admits at most 3 learners at once, and 3 are members"):
                await _join(server.address, three)
            assert server.runtime.membership.learner("L2").credential == "trio"
            await trio[0].leave("done")  # a learner that left frees its slot
            trio[0] = await _join(server.address, three)
        # Restarted: the admissions are in the state file, so the limits still hold.
        async with running_coordinator(tmp_path) as server:
            await reconnect(first, server.address)
            await first.heartbeat()
            for credential, name in ((one, "solo"), (three, "trio")):
                with pytest.raises(DilocoError, match=f"'{name}' admits at most") as refused:
                    await _join(server.address, credential)
                assert isinstance(refused.value, PermissionDenied)
            await first.leave("done")
            assert (await _join(server.address, one)).learner_id == "L5"

    run(scenario())


def test_a_forged_limit_and_an_old_token_are_unauthenticated(tmp_path):
    name, limit, rate, mac = auth.join_credential(SECRET, "solo", 1, 1000).split(".")
    old = auth._mac(SECRET, "diloco-join-v1")  # the single-MAC join token of earlier versions

    async def scenario():
        async with running_coordinator(tmp_path) as server:
            for forged, message in ((f"{name}.64.{rate}.{mac}", "invalid join credential 'solo'"),
                                    (f"{name}.{limit}.any.{mac}", "invalid join credential 'solo'"),
                                    (old, "not a join credential .*older single-MAC kind")):
                with pytest.raises(DilocoError, match=message) as refused:
                    await _join(server.address, forged)
                assert isinstance(refused.value, Unauthenticated)
            assert server.runtime.membership.live() == []

    run(scenario())


def test_the_data_dir_credential_and_the_launch_credentials(tmp_path):
    async def scenario():
        async with running_coordinator(tmp_path, join_learners=2, join_tokens_per_s=500.0) as server:
            data_dir = tmp_path / "coordinator"
            token = (data_dir / "join-token").read_text().strip()
            assert auth.check_join(SECRET, token) == auth.JoinCredential("run", 2, 500.0)
            assert (data_dir / "join-token").stat().st_mode & 0o777 == 0o600
            a = await _join(server.address, token)
            await _join(server.address, token)
            with pytest.raises(DilocoError, match="'run' admits at most 2 learners"):
                await _join(server.address, token)
            assert server.runtime.membership.learner(a.learner_id).max_tokens_per_s == 500.0
            launch = auth.check_join(SECRET, server.launch_credential("a1b2c3d4"))
            assert launch == auth.JoinCredential("launch-a1b2c3d4", 1, None)
            assert auth.check_join(SECRET, server.launch_credential("Odd/Id")).name.startswith("launch-")

    run(scenario())


def test_diloco_admin_mints_a_credential_that_joins(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("DILOCO_SECRET", None)
    command = [sys.executable, "-m", "diloco", "admin", "join-credential", "ops", "--learners", "2",
               "--tokens-per-s", "1500", "--secret-file", str(secret_file)]
    minted = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert minted.returncode == 0, minted.stderr
    credential = minted.stdout.strip()
    assert auth.check_join(SECRET, credential) == auth.JoinCredential("ops", 2, 1500.0)
    reserved = subprocess.run(command[:5] + ["run"] + command[6:], capture_output=True, text=True, env=env,
                              timeout=60, cwd=tmp_path)
    assert reserved.returncode != 0 and "Traceback" not in reserved.stderr
    assert "the coordinator's own" in reserved.stderr and len(reserved.stderr.strip().splitlines()) == 1

    async def scenario():
        async with running_coordinator(tmp_path) as server:
            assert [(await _join(server.address, credential)).learner_id for _ in range(2)] == ["L0", "L1"]
            with pytest.raises(DilocoError, match="'ops' admits at most 2 learners"):
                await _join(server.address, credential)

    run(scenario())
