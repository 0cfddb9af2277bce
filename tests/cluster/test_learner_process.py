"""`diloco learner` as a real process against a real shard process: it trains, and on
SIGTERM it finishes its in-flight pushes, writes its summary and exits 0."""

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from diloco import auth
from diloco.clients.syncer import SyncerClient, open_channel
from tests.polling import poll

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "2", "--sync-every", "4"]



def shard_pushes(address):
    async def status():
        async with open_channel(address) as channel:
            return (await SyncerClient(channel, auth.Credential("C", secret="s"), timeout_s=5).status()).pushes_received

    return asyncio.run(status())


@pytest.mark.parametrize("standby", [False, True], ids=["started", "warm-spare"])
def test_learner_trains_and_exits_cleanly_on_sigterm(tmp_path, standby):
    """Started with its flags, or as a launcher's warm spare (``--standby``) that loads
    first and reads the rest of its command line from stdin."""
    (tmp_path / "secret").write_text("s")
    common = ["--secret-file", str(tmp_path / "secret"), *TINY]
    shard = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "--insecure", "syncer", "--learners", "L0", "--data-dir", str(tmp_path),
         "--port-file", str(tmp_path / "port"), *common],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    learner = None
    try:
        poll(lambda: (tmp_path / "port").exists(), "the shard", timeout_s=60)
        flags = ["--shards", (tmp_path / "port").read_text().strip(), "--learner-id", "L0", "--steps", "100000",
                 "--batch-size", "4", "--summary", str(tmp_path / "summary.json"), *common]
        command = [sys.executable, "-m", "tools.cli", "--insecure", "--log-level", "INFO", "learner"]
        learner = subprocess.Popen(command + (["--standby"] if standby else flags), stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=open(tmp_path / "learner.log", "w"))
        if standby:
            poll(lambda: learner.poll() is not None or "waiting for a launch" in (tmp_path / "learner.log").read_text(),
                 "the spare to load", timeout_s=60)
            learner.stdin.write((json.dumps(flags) + "\n").encode())
        learner.stdin.close()
        address = (tmp_path / "port").read_text().strip()
        poll(lambda: learner.poll() is not None or shard_pushes(address) >= 2, "the first pushes", timeout_s=90)
        assert learner.poll() is None, (tmp_path / "learner.log").read_text()
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(timeout=60) == 0, (tmp_path / "learner.log").read_text()
        assert "SIGTERM, finishing in-flight pushes" in (tmp_path / "learner.log").read_text()
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert 0 < summary["inner_steps"] < 100000
        assert summary["pushes_acked"] == summary["pushes_sent"] > 0 and summary["pushes_dropped"] == 0
    finally:
        for proc in (learner, shard):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    assert shard.returncode == 0


def test_a_warm_spare_exits_when_its_launcher_goes_and_refuses_a_bad_launch_line():
    command = [sys.executable, "-m", "tools.cli", "--insecure", "learner", "--standby"]
    gone = subprocess.run(command, input=b"", capture_output=True, timeout=120)
    assert gone.returncode == 0, gone.stderr
    bad = subprocess.run(command, input=b'{"steps": 3}\n', capture_output=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.decode().strip().splitlines()[-1] == (
        "diloco: error: --standby: stdin must be one JSON list of strings (the learner's arguments)")
