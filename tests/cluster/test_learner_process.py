"""`diloco learner` as a real process against a real shard process: it trains, and on
SIGTERM it finishes its in-flight pushes, writes its summary and exits 0."""

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco import auth
from diloco.coordinator import forks
from diloco.clients.syncer import SyncerClient, open_channel
from tests.polling import poll

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "2", "--sync-every", "4"]



def shard_pushes(address):
    async def status():
        async with open_channel(address) as channel:
            return (await SyncerClient(channel, auth.Credential("C", secret="s"), timeout_s=5).status()).pushes_received

    return asyncio.run(status())


def _start_learner(tmp_path, command, flags, forked):
    """The learner as a process of its own, or forked by ``diloco learner --fork-server``:
    (the server or None, the learner's pid, a function that waits for its exit code)."""
    log = tmp_path / "learner.log"
    if not forked:
        learner = subprocess.Popen(command + flags, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=open(log, "w"))
        return None, learner.pid, lambda: learner.wait(timeout=60)
    server = subprocess.Popen(command + [forks.FLAG], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=open(tmp_path / "fork-server.log", "w"))
    server.stdin.write(forks.request(flags, log))
    server.stdin.flush()
    pid = json.loads(server.stdout.readline())["pid"]

    def exit_code():
        answer = json.loads(server.stdout.readline())
        assert answer["pid"] == pid, answer
        return answer["exit"]

    return server, pid, exit_code


@pytest.mark.parametrize("forked", [False, True], ids=["started", "forked"])
def test_learner_trains_and_exits_cleanly_on_sigterm(tmp_path, forked):
    """Started with its flags, or forked by a launcher's fork server (``--fork-server``)
    that loaded first and reads each launch's arguments from stdin."""
    (tmp_path / "secret").write_text("s")
    common = ["--secret-file", str(tmp_path / "secret"), *TINY]
    shard = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--insecure", "syncer", "--learners", "L0", "--data-dir", str(tmp_path),
         "--port-file", str(tmp_path / "port"), *common],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    server = pid = None
    try:
        poll(lambda: (tmp_path / "port").exists(), "the shard", timeout_s=60)
        flags = ["--shards", (tmp_path / "port").read_text().strip(), "--learner-id", "L0", "--steps", "100000",
                 "--batch-size", "4", "--summary", str(tmp_path / "summary.json"), *common]
        command = [sys.executable, "-m", "diloco", "--insecure", "--log-level", "INFO", "learner"]
        server, pid, exit_code = _start_learner(tmp_path, command, flags, forked)
        address = (tmp_path / "port").read_text().strip()
        poll(lambda: not _alive(pid) or shard_pushes(address) >= 2, "the first pushes", timeout_s=90)
        assert _alive(pid), (tmp_path / "learner.log").read_text()
        os.kill(pid, signal.SIGTERM)
        assert exit_code() == 0, (tmp_path / "learner.log").read_text()
        pid = None
        assert "SIGTERM, finishing in-flight pushes" in (tmp_path / "learner.log").read_text()
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert 0 < summary["inner_steps"] < 100000
        assert summary["pushes_acked"] == summary["pushes_sent"] > 0 and summary["pushes_dropped"] == 0
        if server is not None:  # the server outlives its learners, and goes when its stdin closes
            assert server.poll() is None
            server.stdin.close()
            assert server.wait(timeout=60) == 0
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        for proc in (server, shard):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    assert shard.returncode == 0


def _alive(pid: int) -> bool:
    """Not ended (a zombie not yet reaped by the fork server counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_fork_server_answers_a_bad_request_and_exits_when_its_launcher_goes(tmp_path):
    command = [sys.executable, "-m", "diloco", "--insecure", "learner", forks.FLAG]
    requests = b'{"steps": 3}\n' + forks.request(["--steps", "1"], str(tmp_path / "no-such-dir" / "log"))
    served = subprocess.run(command, input=requests, capture_output=True, timeout=120)
    assert served.returncode == 0, served.stderr
    answers = [json.loads(line) for line in served.stdout.splitlines()]
    assert answers == [{"error": 'a request is {"args": [strings], "log": "path"}'},
                       {"error": f"[Errno 2] No such file or directory: '{tmp_path / 'no-such-dir' / 'log'}'"}]
