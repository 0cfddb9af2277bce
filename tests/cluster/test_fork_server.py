"""``diloco.coordinator.forks`` as launchers use it, with a small server script (no torch): answers
stay clean JSON whatever the server prints, each request forks a child with its own
session and log, and every child's end comes back with its exit code."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.coordinator import forks

pytestmark = [pytest.mark.cluster, pytest.mark.skipif(not forks.available(), reason="needs os.pidfd_open (Linux)")]

SERVER = """
import os, sys, time
from diloco.coordinator import forks
answers = forks.claim_stdout()
print("noise while loading")  # must not reach the answers
given = forks.serve(answers)
if given is None:
    sys.exit(0)
print("child", os.getpid(), os.getsid(0), given, flush=True)
if given[0] == "sleep":
    time.sleep(60)
sys.exit(int(given[1]))
"""


def test_a_fork_server_forks_a_child_per_request_and_reports_each_end(tmp_path):
    root = str(Path(__file__).resolve().parents[2])
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, cwd=root)
    try:
        server.stdin.write(forks.request(["exit", "3"], tmp_path / "a.log"))
        server.stdin.write(forks.request(["sleep", "0"], tmp_path / "b.log"))
        server.stdin.flush()
        answers = [json.loads(server.stdout.readline()) for _ in range(2)]
        exited, sleeping = answers[0]["pid"], answers[1]["pid"]
        assert exited != sleeping and server.pid not in (exited, sleeping)
        # The first child exits 3 by itself; the second is killed: both ends are reported.
        assert json.loads(server.stdout.readline()) == {"pid": exited, "exit": 3}
        os.kill(sleeping, signal.SIGKILL)
        assert json.loads(server.stdout.readline()) == {"pid": sleeping, "exit": -signal.SIGKILL}
        # Each child wrote to its own log, leading its own session, with its launch's arguments.
        assert (tmp_path / "a.log").read_text() == f"child {exited} {exited} ['exit', '3']\n"
        assert (tmp_path / "b.log").read_text() == f"child {sleeping} {sleeping} ['sleep', '0']\n"
        server.stdin.close()
        assert server.wait(timeout=30) == 0
        assert server.stdout.read() == b""  # nothing but answers on the answers' pipe
        assert b"noise while loading" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
