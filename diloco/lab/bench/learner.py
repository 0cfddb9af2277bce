"""Does syncing slow training down? The same learner configuration with syncing on
(against a real local shard process, tau >= 2) and off, side by side in one run.

Each configuration runs twice, in the order off, on, on, off (a steady drift of the
machine's speed over the benchmark then favours neither), each run against a shard
process of its own (every run then meets the same shard: new, at version 0), and the
better run of each counts: on a shared machine noise only ever slows a run down.
tokens/s is measured over the inner-step loop (bootstrap, evaluation and the final drain excluded).
bytes_per_1k_tokens is wire bytes up + down per 1000 training tokens; blocked_s the time
the training loop spent handing pushes to the streamer (it never waits for replies).

The learner gets ``threads`` torch threads in both configurations (default: all cores
but one, which is left to the shard process — in a deployment the shards run on their
own CPU hosts; with every core given to torch, the shard and the streamer thread
preempt torch's parallel regions and the comparison measures oversubscription instead).

``tracing=True`` compares OpenTelemetry on and off instead, syncing on in both: each run
is a fresh learner process (a process installs its providers once), "on" with the SDK
and the real OTLP/gRPC exporters (traces and metrics) sending to a receiver in this
process, "off" with no OTEL_* variables (the API's no-op, the default). Runs go off, on,
on, off, off, on, ... and the better run of each configuration counts; the ratio of
medians and tokens per CPU-second of the learner process (what tokens/s would be on
dedicated cores, far steadier on a busy machine) are reported beside it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from diloco import auth
from diloco.config import RunConfig
from diloco.errors import InvalidArgument
from diloco.learner.config import LearnerConfig
from diloco.learner.membership import Membership
from diloco.learner.runner import run_task

_SECRET = "bench-secret"


@contextlib.contextmanager
def _fresh_shard(run: RunConfig) -> Iterator[str]:
    """The address of a shard process started for one run, stopped after it."""
    with tempfile.TemporaryDirectory() as tmp:
        shard, address = _start_shard(Path(tmp), run)
        try:
            yield address
        finally:
            shard.terminate()
            shard.wait(timeout=30)


def _order(runs: int) -> list[bool]:
    """off, on, on, off, off, on, ...: ``runs`` of each configuration, balanced so that a
    steady drift of the machine's speed favours neither."""
    return [i % 4 in (1, 2) for i in range(2 * runs)]


def _train(run: RunConfig, cfg: LearnerConfig, address: str, sync: bool = True):
    member = Membership("L0", auth.Credential("L0", secret=_SECRET), run, {0: address}, 0.0)
    return run_task(member, cfg, sync=sync)


def _start_shard(tmp: Path, run: RunConfig) -> tuple[subprocess.Popen, str]:
    (tmp / "run.json").write_text(run.to_json())
    (tmp / "secret").write_text(_SECRET)
    port_file = tmp / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--insecure", "syncer", "--run-config", str(tmp / "run.json"), "--learners", "L0",
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


def _traced_learner(run_json: str, cfg: LearnerConfig, address: str, env: dict[str, str], threads: int) -> dict:
    """One learner in a fresh process (see ``run(tracing=True)``); telemetry from ``env``."""
    from diloco import telemetry

    torch.set_num_threads(threads)
    handle = telemetry.start("learner", env, learner_id="L0")
    try:
        cpu_started = time.process_time()
        summary = _train(RunConfig.from_json(run_json), cfg, address).summary
        cpu_s = time.process_time() - cpu_started
    finally:
        handle.shutdown(timeout_s=10)
    return {"tokens_per_s": summary.tokens_per_s, "tokens_per_cpu_s": summary.tokens / cpu_s,
            "pushes_acked": summary.pushes_acked, "pushes_dropped": summary.pushes_dropped,
            "traced": bool(handle.tracer_provider)}


def _median(runs: list[dict], key: str) -> float:
    values = sorted(r[key] for r in runs)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _tracing_off_on(results: dict[bool, list[dict]], key: str, prefix: str) -> dict:
    """``key`` of the best run of each configuration, their ratio, the ratio of medians
    and every run; the ratios and runs named with ``prefix``."""
    on = max(r[key] for r in results[True])
    off = max(r[key] for r in results[False])
    return {
        f"{key}_tracing_off": round(off, 1),
        f"{key}_tracing_on": round(on, 1),
        f"{prefix}ratio": round(on / off, 3),
        f"{prefix}ratio_of_medians": round(_median(results[True], key) / _median(results[False], key), 3),
        f"{prefix}runs_off": [round(r[key], 1) for r in results[False]],
        f"{prefix}runs_on": [round(r[key], 1) for r in results[True]],
    }


def _run_tracing(run_cfg: RunConfig, cfg: LearnerConfig, threads: int, runs: int) -> dict:
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from diloco.lab.bench.otlp import OtlpReceiver

    results: dict[bool, list[dict]] = {True: [], False: []}
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
        for traced in _order(runs):
            with _fresh_shard(run_cfg) as address, ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
                result = pool.submit(_traced_learner, run_cfg.to_json(), cfg, address, env if traced else {}, threads)
                results[traced].append(result.result())
        spans = receiver.spans()
    if not all(r["traced"] for r in results[True]) or any(r["traced"] for r in results[False]):
        raise InvalidArgument("the traced runs did not install the SDK, or the untraced ones did")
    return {
        **_tracing_off_on(results, "tokens_per_s", ""),
        # Tokens per CPU-second of the learner process (all its threads, exporters included):
        # what tokens/s would be on dedicated cores; far less sensitive to a busy machine.
        **_tracing_off_on(results, "tokens_per_cpu_s", "cpu_"),
        "spans_received": len(spans),
        "sync_spans_received": sum(s.name == "sync fragment" for s in spans),
        "pushes_acked_on": sum(r["pushes_acked"] for r in results[True]),
        "pushes_dropped_on": sum(r["pushes_dropped"] for r in results[True]),
    }


def run(steps: int = 120, overlap_steps: int = 2, threads: int | None = None, tracing: bool = False, runs: int = 2) -> dict:
    if steps < 10 or overlap_steps < 2:
        raise InvalidArgument("need at least 10 steps and tau >= 2")
    if runs < 1:
        raise InvalidArgument("need at least 1 run per configuration")
    threads = threads or max((os.cpu_count() or 2) - 1, 1)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    # H = 16, as the figures in README were measured (the library default was 16 then).
    run_cfg = RunConfig(sync_every_steps=16, overlap_steps=overlap_steps, task_options={"eval_batches": "1"})
    cfg = LearnerConfig(steps=steps, eval_every_steps=10**9, warmup_steps=10)
    try:
        if tracing:
            traced = _run_tracing(run_cfg, cfg, threads, runs)
            return {**traced, "steps": steps, "overlap_steps": overlap_steps, "threads": threads}
        results = {True: [], False: []}
        for sync in _order(2):
            with _fresh_shard(run_cfg) as address:
                learner = _train(run_cfg, cfg, address, sync=sync)
            results[sync].append(learner.summary)
    finally:
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
