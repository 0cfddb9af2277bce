"""`diloco syncer` as a real process: it serves without loading torch, and SIGTERM
answers waiting pushes, flushes the tape and exits 0."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.codec import encode
from diloco.tape import read_tape
from tests.grpc.conftest import SECRET, client_for
from tests.grpc.test_syncer_service import FakeLearner
from tests.seeded import gpt_run, model_plan

pytestmark = pytest.mark.cluster


def test_sigterm_answers_waiting_pushes_flushes_tape_and_exits_0(tmp_path):
    (tmp_path / "secret").write_text(SECRET)
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--insecure", "syncer", "--width", "16", "--depth", "1", "--heads", "2",
         "--context", "16", "--fragments", "2", "--learners", "L0,L1", "--quorum", "2", "--grace", "off",
         "--data-dir", str(tmp_path), "--port-file", str(port_file), "--secret-file", str(tmp_path / "secret")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        address = port_file.read_text().strip()

        async def scenario():
            manifest, plan, state = model_plan(gpt_run(width=16, depth=1, heads=2, context=16, fragments=2))
            initial = plan.gather(0, state)
            learner = FakeLearner("L0", plan, [t.numpy() for t in initial])
            async with client_for(address, "L0") as client:
                # The shard starts holding no model: the first learner's values become version 0.
                encoded = [encode(p.name, t, encoding="fp32") for p, t in zip(plan.fragments[0].pieces, initial)]
                assert await client.initialize(0, manifest.to_json(), plan.plan_hash, encoded)
                assert not await client.initialize(0, manifest.to_json(), plan.plan_hash, encoded)
                acked = asyncio.Event()
                push = asyncio.ensure_future(learner.push_with_ack(client, acked))
                await asyncio.wait_for(acked.wait(), 30)  # in the round, waiting for L1
                # The shard took the push in (unframed, checked, measured) without torch.
                maps = Path(f"/proc/{proc.pid}/maps").read_text()
                assert "libtorch" not in maps and "libc10" not in maps
                proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(push, 30)

        result = asyncio.run(scenario())
        assert result.update.close_reason == "shard shutting down" and result.update.version == 1
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    kinds = [r["kind"] for r in read_tape(tmp_path / "tape-S0.jsonl")]
    assert kinds[0] == "start" and kinds[-1] == "stop" and kinds.count("push") == 1 and kinds.count("round") == 1
    assert kinds.count("initialize") == 1


def test_every_diloco_process_runs_numpy_blas_on_one_thread():
    """A BLAS worker thread spins after every call (two thirds of a shard's CPU at 4
    learners): ``diloco``'s main sets one thread before numpy loads (its parser loads it),
    whatever the machine's core count; an operator's own setting wins."""
    code = (
        "import ctypes\n"
        "from diloco.command import main\n"
        "try:\n"
        "    main(['syncer', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "import sys\n"
        "assert 'numpy' in sys.modules\n"
        "lib = next(l.split()[-1] for l in open('/proc/self/maps') if 'openblas' in l.lower())\n"
        "print(ctypes.CDLL(lib).scipy_openblas_get_num_threads64_())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "1"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "OPENBLAS_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "2"
