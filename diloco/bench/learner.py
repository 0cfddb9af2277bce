"""Does syncing slow training down? The same learner configuration with syncing on
(against a real local shard process, tau >= 2) and off, side by side in one run.

Each configuration runs twice, interleaved (off, on, off, on), and the better run of
each counts: on a shared machine noise only ever slows a run down. tokens/s is measured
over the inner-step loop (bootstrap, evaluation and the final drain excluded).
bytes_per_1k_tokens is wire bytes up + down per 1000 training tokens; blocked_s the time
the training loop spent handing pushes to the streamer (it never waits for replies).

The learner gets ``threads`` torch threads in both configurations (default: all cores
but one, which is left to the shard process — in a deployment the shards run on their
own CPU hosts; with every core given to torch, the shard and the streamer thread
preempt torch's parallel regions and the comparison measures oversubscription instead).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from diloco import auth
from diloco.config import RunConfig
from diloco.errors import InvalidArgument
from learner.config import LearnerConfig
from learner.worker import Learner

_SECRET = "bench-secret"


def _start_shard(tmp: Path, run: RunConfig) -> tuple[subprocess.Popen, str]:
    (tmp / "run.json").write_text(run.to_json())
    (tmp / "secret").write_text(_SECRET)
    port_file = tmp / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco.cli", "syncer", "--run-config", str(tmp / "run.json"), "--learners", "L0",
         "--secret-file", str(tmp / "secret"), "--port-file", str(port_file)],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise InvalidArgument("the benchmark shard did not start")
        time.sleep(0.05)
    return proc, port_file.read_text().strip()


def run(steps: int = 120, overlap_steps: int = 2, threads: int | None = None) -> dict:
    if steps < 10 or overlap_steps < 2:
        raise InvalidArgument("need at least 10 steps and tau >= 2")
    threads = threads or max((os.cpu_count() or 2) - 1, 1)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    run_cfg = RunConfig(overlap_steps=overlap_steps)
    cfg = LearnerConfig(steps=steps, eval_every_steps=10**9, eval_batches=1, warmup_steps=10)
    with tempfile.TemporaryDirectory() as tmp:
        shard, address = _start_shard(Path(tmp), run_cfg)
        try:
            results = {True: [], False: []}
            for sync in (False, True, False, True):
                learner = Learner(run_cfg, cfg, "L0", auth.sign(_SECRET, "L0"), {0: address}, sync=sync)
                results[sync].append(learner.train())
        finally:
            shard.terminate()
            shard.wait(timeout=30)
            torch.set_num_threads(previous_threads)
    best_sync = max(results[True], key=lambda s: s.tokens_per_s)
    best_nosync = max(results[False], key=lambda s: s.tokens_per_s)
    wire = best_sync.bytes_up + best_sync.bytes_down
    return {
        "tokens_per_s_sync": round(best_sync.tokens_per_s, 1),
        "tokens_per_s_nosync": round(best_nosync.tokens_per_s, 1),
        "ratio": round(best_sync.tokens_per_s / best_nosync.tokens_per_s, 3),
        "bytes_per_1k_tokens": round(1000 * wire / best_sync.tokens, 1),
        "blocked_s": round(best_sync.blocked_s, 4),
        "pushes_acked": best_sync.pushes_acked,
        "pushes_dropped": best_sync.pushes_dropped,
        "replies_late": best_sync.replies_late,
        "steps": steps,
        "overlap_steps": overlap_steps,
        "threads": threads,
        "params": sum(p.numel() for p in learner.model.parameters()),
    }
