"""`diloco coordinator` as a real process launching fake learner processes: SIGTERM
stops its children (no orphans) and exits 0; a restart resumes from its state file."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.clients.coordinator import AdminClient
from tests.grpc.conftest import SECRET
from tests.polling import poll

pytestmark = pytest.mark.cluster

TESTS = Path(__file__).resolve().parents[1]
TINY_FLAGS = ["--width", "16", "--depth", "1", "--heads", "2", "--context", "16", "--fragments", "2"]



def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def start(tmp_path):
    port_file = tmp_path / "port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--insecure", "coordinator", "--data-dir", str(tmp_path / "data"),
         "--port-file", str(port_file), "--secret-file", str(tmp_path / "secret"), "--lease-s", "3",
         "--learner-command", f"{sys.executable} {TESTS / 'fake_learner.py'} --heartbeat-s 0.1", *TINY_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    address = poll(lambda: port_file.exists() and port_file.read_text().strip(), "the port file", procs=[("coordinator", proc)])
    return proc, AdminClient(address, (tmp_path / "data" / "admin-token").read_text().strip(), timeout_s=10)


def test_sigterm_reaps_learners_and_a_restart_resumes(tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    proc, admin = start(tmp_path)
    try:
        assert [r["ok"] for r in admin.add_learners(2)] == [True, True]

        def both_active():
            members = admin.members()
            return members if [m["state"] for m in members] == ["active", "active"] else None

        members = poll(both_active, "2 active learners", procs=[("coordinator", proc)])
        pids = [int(m["address"].rsplit(":", 1)[1]) for m in members]
        assert all(alive(pid) for pid in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not any(alive(pid) for pid in pids)  # reaped, not orphaned
        admin.close()

        proc, admin = start(tmp_path)
        gone = admin.members(include_gone=True)
        assert [(m["id"], m["state"]) for m in gone] == [("L0", "left"), ("L1", "left")]
        admin.add_learners(1)
        poll(lambda: [m["id"] for m in admin.members() if m["state"] == "active"] == ["L2"], "L2 to join", procs=[("coordinator", proc)])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        admin.close()
        if proc.poll() is None:
            proc.kill()


def test_a_tls_coordinator_launches_learners_that_speak_its_tls(tmp_path):
    """No --learner-command: the learners the coordinator launches get its --tls-dir. The
    learner joins over mutual TLS (a plaintext one would never join), then exits for want
    of shards, which the coordinator records as its end."""
    from diloco import rpc
    from diloco.cli.certs import make_certs

    (tmp_path / "secret").write_text(SECRET)
    make_certs(tmp_path / "tls", ["localhost"])
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--tls-dir", str(tmp_path / "tls"), "--log-level", "INFO", "coordinator",
         "--data-dir", str(tmp_path / "data"), "--port-file", str(port_file), "--secret-file", str(tmp_path / "secret"),
         *TINY_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    previous = rpc.use_tls(rpc.Tls.from_dir(tmp_path / "tls"))
    admin = None
    try:
        address = poll(lambda: port_file.exists() and port_file.read_text().strip(), "the port file", procs=[("coordinator", proc)])
        admin = AdminClient(address, (tmp_path / "data" / "admin-token").read_text().strip(), timeout_s=10)
        [launch] = admin.add_learners(1)
        assert launch["ok"]
        joined = poll(lambda: [m for m in admin.members(include_gone=True) if m["id"] == "L0"], "L0 to join", procs=[("coordinator", proc)])
        assert joined[0]["pool"] == "default"
        log = (tmp_path / "data" / "learners" / f"{launch['launch_id']}.log")
        assert "refuses plaintext" not in log.read_text()
    finally:
        rpc.use_tls(previous)
        if admin is not None:
            admin.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_add_learners_says_which_launches_joined_and_why_the_others_failed(tmp_path, capsys):
    """A learner command that dies before joining: add-learners waits, names the failure
    with the exit status and the learner's last log line, exits 1; members lists it. A
    bad --set value is refused before anything is launched. A learner that joins: exit 0."""
    from diloco import command as cli

    (tmp_path / "secret").write_text(SECRET)
    port_file = tmp_path / "port"
    dies = f"{sys.executable} -c \"import sys; sys.exit('diloco: error: cannot build the task (no such file)')\""
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--insecure", "coordinator", "--data-dir", str(tmp_path / "data"),
         "--port-file", str(port_file), "--secret-file", str(tmp_path / "secret"), "--pools", "default,good",
         "--learner-command", dies, *TINY_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        address = poll(lambda: port_file.exists() and port_file.read_text().strip(), "the port file", procs=[("coordinator", proc)])
        admin = ["--insecure", "admin", "--coordinator", address, "--token-file", str(tmp_path / "data" / "admin-token")]
        assert cli.main([*admin, "add-learners", "2", "--wait-s", "60", "--json"]) == 1
        outcomes = json.loads(capsys.readouterr().out)
        assert [x["outcome"] for x in outcomes] == ["failed", "failed"]
        assert all(x["detail"] == "ended before joining: exit code 1: diloco: error: cannot build the task (no such file)"
                   for x in outcomes), outcomes
        assert cli.main([*admin, "members"]) == 0
        table = capsys.readouterr().out
        assert "launches not joined" in table and all(x["launch_id"] in table for x in outcomes)

        assert cli.main([*admin, "add-learners", "1", "--set", "steps=abc"]) == 2
        assert "--set steps=abc: not an integer" in capsys.readouterr().err
        assert cli.main([*admin, "add-learners", "1", "--set", "device=tpu"]) == 2
        assert "must be one of cpu, cuda, xla" in capsys.readouterr().err
        launched = cli.main([*admin, "members", "--json"])
        assert launched == 0 and json.loads(capsys.readouterr().out) == []  # nothing was launched for them
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_add_learners_reports_the_learner_each_launch_joined_as(tmp_path, capsys):
    from diloco import command as cli

    (tmp_path / "secret").write_text(SECRET)
    proc, client = start(tmp_path)
    try:
        admin = ["--insecure", "admin", "--coordinator", client.address, "--token-file",
                 str(tmp_path / "data" / "admin-token")]
        assert cli.main([*admin, "add-learners", "2", "--json"]) == 0
        outcomes = json.loads(capsys.readouterr().out)
        assert sorted((x["outcome"], x["learner_id"]) for x in outcomes) == [("joined", "L0"), ("joined", "L1")]
        members = {m["id"]: m["launch_id"] for m in client.members()}
        assert {x["learner_id"]: x["launch_id"] for x in outcomes} == members
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_busy_port_is_the_one_error_line_and_nothing_else(tmp_path):
    """A coordinator or a shard given a port another process holds printed gRPC's own log
    line (``E... add_port.cc ... Failed to add port``) and, as the interpreter exited, a
    stray ``Error in sys.excepthook``, around the error. Now stderr is that one line (with
    --insecure, after its warning), naming the address and the OS's reason."""
    import socket

    from diloco.cli.certs import make_certs

    (tmp_path / "secret").write_text(SECRET)
    make_certs(tmp_path / "tls", ["localhost"])
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        error = f"diloco: error: cannot listen on 127.0.0.1:{port}: Address already in use"
        warning = "WARNING diloco.cli.main: --insecure: plaintext gRPC, tokens and credentials cross the network in clear"
        secret = ["--secret-file", str(tmp_path / "secret")]
        commands = {"coordinator": ["coordinator", "--port", str(port), "--data-dir", str(tmp_path / "c"), *secret],
                    "syncer": ["syncer", "--port", str(port), "--data-dir", str(tmp_path / "s"), "--shard-id", "0",
                               "--shards", "1", *secret]}
        for name, command in commands.items():
            for transport in (["--tls-dir", str(tmp_path / "tls")], ["--insecure"]):
                proc = subprocess.run([sys.executable, "-m", "diloco", *transport, *command], capture_output=True,
                                      text=True, timeout=120)
                lines = proc.stderr.splitlines()
                assert proc.returncode == 2, (name, transport, proc.stderr)
                if transport == ["--insecure"]:
                    assert len(lines) == 2 and lines[0].endswith(warning), (name, proc.stderr)
                    lines = lines[1:]
                assert lines == [error], (name, transport, proc.stderr)
