"""docs/own-loop.md, run as written: its ``bash`` blocks, in order, as one ``bash -euo
pipefail`` script in a temporary directory holding ``examples/own_loop.py`` (where the
doc's first step copies it from), with free ports in place of the doc's. Real processes
throughout: ``diloco certs``, a coordinator with ``--launcher none``, two shards, two
own-loop learners joining over mutual TLS, ``diloco admin export`` and a clean stop.
The loss falls on both learners and on the exported model; the doc's stop leaves no
process behind, and whatever happens the test kills the script's process group."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "own-loop.md"


def bash_blocks(markdown: str) -> list[str]:
    """The walkthrough: every fenced ``bash`` block, in order (other blocks are output or code)."""
    return re.findall(r"^```bash\n(.*?)^```$", markdown, flags=re.S | re.M)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:  # held together: the ports differ
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(pgid: int, grace_s: float = 10.0) -> None:
    """SIGTERM the script's process group, SIGKILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_alive(pgid):
            return
        os.killpg(pgid, sig)
        deadline = time.monotonic() + grace_s
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)  # nothing to wait on for another session's processes


def walkthrough_script() -> str:
    script = "\n".join(bash_blocks(DOC.read_text()))
    ports = sorted(set(re.findall(r"--port (\d+)", script)))
    assert ports == ["7000", "7100", "7101"], ports  # the coordinator's and two shards'
    for port, free in zip(ports, free_ports(len(ports))):
        script = re.sub(rf"\b{port}\b", str(free), script)
    return script


@pytest.mark.timeout(240)
def test_the_own_loop_walkthrough_runs_as_written(tmp_path):
    script = walkthrough_script()
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "own_loop.py", tmp_path / "examples")
    env = {k: v for k, v in os.environ.items() if k not in ("DILOCO_TLS_DIR", "DILOCO_INSECURE", "DILOCO_SECRET")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # this venv's diloco and python
    proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=180)
        left_running = group_alive(proc.pid)
    finally:
        stop_group(proc.pid)
        proc.kill()
        proc.wait()
    run = tmp_path / "own-loop"
    logs = {p.name: p.read_text() for p in run.glob("*.log")}
    context = output[-4000:] + "".join(f"\n--- {name}\n{text[-1500:]}" for name, text in logs.items())
    assert proc.returncode == 0, context
    assert not left_running, "the walkthrough's stop left processes running\n" + context
    assert {"coordinator.log", "shard0.log", "shard1.log", "learner.log"} <= set(logs)
    assert not [name for name, text in logs.items() if "Traceback" in text], context

    finals = re.findall(r"^(L\d): eval loss ([\d.]+) -> ([\d.]+) in (\d+) steps", output, flags=re.M)
    assert sorted(name for name, *_ in finals) == ["L0", "L1"], context
    for name, start, final, steps in finals:
        assert int(steps) == 200 and float(final) < 0.5 * float(start), (name, start, final)
    assert (run / "model.safetensors").stat().st_size > 0
    (exported,) = re.findall(r"^model\.safetensors: eval loss ([\d.]+) \(the untrained model: ([\d.]+)\)", output,
                             flags=re.M)
    assert float(exported[0]) < 0.5 * float(exported[1]), exported
