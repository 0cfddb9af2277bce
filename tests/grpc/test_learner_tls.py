"""``diloco.Learner.join`` on a mutual-TLS run: ``tls_dir=`` or the CLI's environment
(``$DILOCO_TLS_DIR``, ``$DILOCO_INSECURE``) chooses the transport, through the one
function the CLI uses too (``rpc.choose_transport``); nothing chosen is refused; and a
join whose two ends disagree on TLS stops retrying at once and says that TLS is the
likely cause and what to give, in both directions, against a real coordinator on
127.0.0.1."""

import asyncio
import time

import pytest
import torch
from torch import nn

import diloco
from diloco import auth, rpc
from diloco.errors import InvalidArgument, Unavailable
from tests.grpc.conftest import SECRET, run
from tests.grpc.coordinator_fixtures import running_coordinator
from tests.grpc.test_learner_api import Net, shards
from diloco.cli.certs import make_certs

TOKEN = auth.join_credential(SECRET, "test", 64)


@pytest.fixture
def certs(tmp_path, monkeypatch):
    """The run's TLS directory and another run's; no transport in the environment, and the
    process's transport (which ``Learner.join`` sets) put back to plaintext afterwards."""
    monkeypatch.delenv(rpc.TLS_DIR_VARIABLE, raising=False)
    monkeypatch.delenv(rpc.INSECURE_VARIABLE, raising=False)
    make_certs(tmp_path / "run", [])
    make_certs(tmp_path / "other", [])
    rpc.use_tls(None)
    yield tmp_path / "run", tmp_path / "other"
    rpc.use_tls(None)


def test_flags_win_over_the_environment_and_tls_over_insecure(certs):
    ours, other = certs
    assert rpc.choose_transport(None, False, {}) is None
    assert rpc.choose_transport(None, False, {"DILOCO_INSECURE": "0"}) is None
    assert rpc.choose_transport(None, False, {"DILOCO_INSECURE": "yes"}).flags == ("--insecure",)
    both = {"DILOCO_TLS_DIR": str(other), "DILOCO_INSECURE": "1"}
    assert rpc.choose_transport(None, False, both).flags == ("--tls-dir", str(other.resolve()))
    assert rpc.choose_transport(ours, False, both).tls == rpc.Tls.from_dir(ours)
    assert rpc.choose_transport(None, True, both).tls is None
    with pytest.raises(InvalidArgument, match="not both"):
        rpc.choose_transport(ours, True, {})
    with pytest.raises(InvalidArgument, match="cannot read ca.crt"):
        rpc.choose_transport(None, False, {"DILOCO_TLS_DIR": str(ours / "missing")})


def test_join_with_no_transport_chosen_is_refused_saying_what_to_give(certs):
    with pytest.raises(InvalidArgument, match=r"refuses plaintext gRPC: give tls_dir=DIR .* insecure=True .*DILOCO_TLS_DIR"):
        diloco.Learner.join(Net(), "127.0.0.1:1", TOKEN)


def test_a_learner_joins_a_tls_run_through_the_environment_and_trains(tmp_path, certs, monkeypatch):
    """Every server of the run listens with mutual TLS; the learner's transport comes from
    $DILOCO_TLS_DIR, as ``diloco learner``'s would."""
    ours, _ = certs
    rpc.use_tls(rpc.Tls.from_dir(ours))  # the servers' (in this process: the same setting)
    monkeypatch.setenv("DILOCO_TLS_DIR", str(ours))

    async def scenario():
        async with shards(tmp_path, 1, (), fragments=2) as (run_cfg, servers):
            shard, address = servers[0]
            async with running_coordinator(tmp_path, shards=(address,)) as coordinator:
                shard.follow(coordinator.address)
                model = Net()
                optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)

                def own_loop():
                    with diloco.Learner.join(model, coordinator.address, TOKEN, optimizer=optimizer) as learner:
                        for _ in range(24):
                            x = torch.randint(0, 16, (32,))
                            nn.functional.cross_entropy(model(x), (x + 1) % 16).backward()
                            optimizer.step()
                            optimizer.zero_grad()
                            learner.step(tokens=x.numel())
                        lags.append(learner.version_lag)  # a property, like index and should_stop
                    return learner

                lags = []
                learner = await asyncio.to_thread(own_loop)
                assert learner.summary.replies_applied > 0 and rpc.tls_enabled()
                assert lags == [learner.version_lag] and isinstance(lags[0], int)

    run(scenario())


def failed_join(address, **transport) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(Unavailable) as failed:
        diloco.Learner.join(Net(), address, TOKEN, **transport)
    return str(failed.value), time.monotonic() - started


def test_a_plaintext_learner_at_a_tls_coordinator_is_told_tls_is_the_likely_cause(tmp_path, certs, monkeypatch):
    ours, other = certs

    async def scenario():
        rpc.use_tls(rpc.Tls.from_dir(ours))
        async with running_coordinator(tmp_path) as coordinator:
            plaintext, took_s = await asyncio.to_thread(failed_join, coordinator.address, insecure=True)
            assert f"cannot join the coordinator at {coordinator.address}" in plaintext
            assert "TLS is the likely cause" in plaintext and "tls_dir=DIR" in plaintext, plaintext
            assert "$DILOCO_TLS_DIR" in plaintext and "diloco certs" in plaintext
            assert took_s < 20  # not the 60 s a coordinator that is still starting is given
            monkeypatch.setenv("DILOCO_TLS_DIR", str(other))  # another run's CA, from the environment
            foreign, _ = await asyncio.to_thread(failed_join, coordinator.address)
            assert "the TLS handshake failed" in foreign and "another run's CA" in foreign, foreign

    run(scenario())


def test_a_tls_learner_at_a_plaintext_coordinator_is_told_to_give_insecure(tmp_path, certs):
    ours, _ = certs

    async def scenario():
        async with running_coordinator(tmp_path) as coordinator:  # plaintext: started with --insecure
            message, took_s = await asyncio.to_thread(failed_join, coordinator.address, tls_dir=ours)
            assert "the TLS handshake failed: the server is plaintext" in message, message
            assert "insecure=True" in message and "$DILOCO_INSECURE=1" in message and "--insecure" in message
            assert took_s < 20

    run(scenario())


def test_an_admin_that_speaks_plaintext_to_a_tls_coordinator_is_told_tls_is_the_likely_cause(tmp_path, certs):
    from diloco.clients.coordinator import AdminClient

    ours, _ = certs

    async def scenario():
        rpc.use_tls(rpc.Tls.from_dir(ours))  # the coordinator serves mutual TLS
        async with running_coordinator(tmp_path) as coordinator:
            rpc.use_tls(None)  # this admin does not

            def members() -> str:
                client = AdminClient(coordinator.address, "any-token", timeout_s=5)
                try:
                    with pytest.raises(Unavailable) as refused:
                        client.members()
                    return str(refused.value)
                finally:
                    client.close()

            message = await asyncio.to_thread(members)
            assert f"no coordinator answers at {coordinator.address}" in message
            assert "TLS is the likely cause" in message and "diloco --tls-dir DIR" in message, message

    run(scenario())
