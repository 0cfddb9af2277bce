"""Mutual TLS (``--tls-dir``): a real shard on 127.0.0.1 serving with the run's
certificate answers only clients that present a certificate of the same CA; a plaintext
client, a client of another run's CA, and a server of another run's CA all fail the
handshake. ``diloco certs`` writes the files with private keys 0600."""

import asyncio
import stat

import grpc
import pytest

from diloco import auth, rpc
from diloco.cli.certs import make_certs
from diloco.command import main
from diloco.errors import AlreadyExists, InvalidArgument
from diloco.v1 import syncer_pb2, syncer_pb2_grpc
from tests.grpc.conftest import SECRET, running_shard

CREDENTIAL = ((auth.LEARNER_METADATA, "L0"), (auth.CREDENTIAL_METADATA, auth.sign(SECRET, "L0")))


@pytest.fixture
def run_certs(tmp_path):
    make_certs(tmp_path / "run", ["localhost"])
    make_certs(tmp_path / "other", [])
    yield rpc.Tls.from_dir(tmp_path / "run"), rpc.Tls.from_dir(tmp_path / "other")
    rpc.use_tls(None)


async def status_with(address, tls):
    """A Status call over a channel opened with ``tls`` (None: plaintext)."""
    previous = rpc.use_tls(tls)
    try:
        async with rpc.channel(address) as channel:
            return await syncer_pb2_grpc.SyncerStub(channel).Status(syncer_pb2.StatusRequest(), metadata=CREDENTIAL,
                                                                    timeout=5)
    finally:
        rpc.use_tls(previous)


def test_a_tls_shard_answers_only_clients_of_its_run_s_ca(tmp_path, run_certs):
    ours, theirs = run_certs

    async def scenario():
        rpc.use_tls(ours)
        async with running_shard(tmp_path / "shard") as (server, address):
            assert (await status_with(address, ours)).plan_hash  # same CA: served
            for who, tls in (("a plaintext client", None), ("another run's client", theirs)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await status_with(address, tls)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, who
        rpc.use_tls(theirs)  # a server of another CA: our client refuses it
        async with running_shard(tmp_path / "impostor") as (server, address):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await status_with(address, ours)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_certs_are_written_private_and_never_overwritten_by_accident(tmp_path, capsys):
    assert main(["certs", "--out", str(tmp_path / "tls"), "--hosts", "shard-0.diloco.ml.svc,10.0.0.7"]) == 0
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "tls").iterdir()}
    assert modes == {"ca.crt": 0o644, "ca.key": 0o600, "tls.crt": 0o644, "tls.key": 0o600}
    with pytest.raises(AlreadyExists, match="--overwrite"):
        make_certs(tmp_path / "tls")
    with pytest.raises(InvalidArgument, match="not a host name"):
        make_certs(tmp_path / "bad", ["a host"])
    capsys.readouterr()
    assert main(["--tls-dir", str(tmp_path / "missing"), "admin", "--coordinator", "127.0.0.1:1", "members"]) == 2
    err = capsys.readouterr().err
    assert "cannot read ca.crt" in err and "Traceback" not in err


def test_a_tls_shard_answers_plaintext_health_probes_on_its_health_port(tmp_path, run_certs):
    """Kubelet's gRPC probes present no certificate: --health-port serves grpc.health.v1
    alone, in plaintext, with the main server's statuses; nothing else is reachable there."""
    import socket

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from diloco.syncer.config import SyncerConfig
    from diloco.syncer.server import SERVICE_NAME, ShardServer, ShardServerConfig
    from tests.grpc.conftest import SECRET, TINY
    from tests.seeded import seeded_core

    ours, _ = run_certs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        health_port = s.getsockname()[1]

    async def scenario():
        rpc.use_tls(ours)
        cfg = SyncerConfig()
        server = ShardServer(TINY, cfg, ShardServerConfig(secret=SECRET, data_dir=tmp_path, health_port=health_port),
                             seeded_core(TINY, cfg))
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as other:
                    await syncer_pb2_grpc.SyncerStub(channel).Status(syncer_pb2.StatusRequest(), timeout=5)
                assert other.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as gone:  # the probe port goes with the server
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize("command", [
    ["coordinator", "--data-dir", "{tmp}/coord"],
    ["syncer", "--learners", "L0"],
    ["learner", "--coordinator", "127.0.0.1:1", "--join-token-file", "{tmp}/join"],
    ["admin", "--coordinator", "127.0.0.1:1", "members"],
])
def test_every_networked_command_refuses_plaintext_unless_asked(tmp_path, monkeypatch, capsys, command):
    """Neither --tls-dir nor --insecure (nor $DILOCO_TLS_DIR / $DILOCO_INSECURE): exit 2
    with one line saying what to give, before anything listens or dials."""
    monkeypatch.delenv("DILOCO_TLS_DIR", raising=False)
    monkeypatch.delenv("DILOCO_INSECURE", raising=False)
    argv = [part.format(tmp=tmp_path) for part in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{argv[0]} refuses plaintext gRPC: give --tls-dir DIR" in err and "--insecure" in err
    assert "Traceback" not in err and not (tmp_path / "coord").exists()


def test_the_environment_chooses_the_transport_and_a_flag_overrides_it(tmp_path, monkeypatch, capsys, caplog):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    (tmp_path / "token").write_text("t")
    admin = ["admin", "--coordinator", closed, "--token-file", str(tmp_path / "token"), "members"]
    monkeypatch.delenv("DILOCO_TLS_DIR", raising=False)
    monkeypatch.setenv("DILOCO_INSECURE", "1")  # plaintext asked for by the environment: it dials
    assert main(admin) == 2
    err = capsys.readouterr().err
    assert f"no coordinator answers at {closed}" in err
    assert "--insecure: plaintext gRPC, tokens and credentials cross the network in clear" in caplog.text
    monkeypatch.setenv("DILOCO_TLS_DIR", str(tmp_path / "missing"))  # TLS from the environment wins over it
    assert main(admin) == 2
    assert "cannot read ca.crt" in capsys.readouterr().err
    assert main(["--insecure", *admin]) == 2  # and an explicit flag over the environment
    assert f"no coordinator answers at {closed}" in capsys.readouterr().err
