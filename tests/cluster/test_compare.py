"""`diloco compare` end to end on one tiny scenario (Decoupled and DP, two workers): the
report it writes holds figures that obey their definitions, with the bytes checked
against what the shards counted and what a ring all-reduce of the model sends."""

import json
import subprocess
import sys

import pytest

from diloco.lab.baseline.common import ring_allreduce_bytes
from diloco.tape import read_tape
from diloco.tasks.byte_gpt import GPT, ModelConfig

pytestmark = pytest.mark.cluster

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "2", "--sync-every", "8",
        "--batch-size", "8"]
WORKERS, STEPS, TOKENS_PER_STEP = 2, 16, 8 * 32


def compare(out):
    return subprocess.run(
        [sys.executable, "-m", "diloco", "--insecure", "compare", "--scenario", "nofault", "--systems", "decoupled,dp",
         "--workers", str(WORKERS), "--steps", str(STEPS), "--seeds", "2", "--json", "--out", str(out), *TINY],
        capture_output=True, text=True, timeout=300,
    )


def test_compare_writes_figures_that_obey_their_definitions(tmp_path):
    out = tmp_path / "compare"
    proc = compare(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    stored = json.loads((out / "results.json").read_text())
    assert stored["results"] == [printed] and printed["scenario"] == "nofault"
    systems = printed["systems"]
    assert set(systems) == {"decoupled", "dp"}
    for name, cell in systems.items():
        # Two runs per cell, each with its own seeds: the cell's figures are their mean.
        assert len(cell["seeds"]) == 2, (name, cell)
        first, second = cell["seeds"]
        assert first["eval_loss_start"] != second["eval_loss_start"], "the runs share a model initialisation"
        for key in ("eval_loss_final", "goodput", "wall_s"):
            assert cell[key] == pytest.approx((first[key] + second[key]) / 2, abs=1e-4), (name, key)
            assert cell["spread"][key] == pytest.approx(abs(first[key] - second[key]) / 2 ** 0.5, abs=1e-4), (name, key)
        for m in cell["seeds"]:
            # The same budget for both, workers x steps x tokens of one batch: DP's global
            # steps; Decoupled's learners train until together they have (the drain lets
            # steps in flight finish, each learner launched for at most 1.5x its share).
            budget = WORKERS * STEPS * TOKENS_PER_STEP
            if name == "dp":
                assert m["tokens"] == budget, m
            else:
                assert budget <= m["tokens"] <= 1.5 * budget, m
            assert 0 < m["goodput"] <= 1 and 0 <= m["uptime"] <= 1 and m["global_stall_s"] >= 0, (name, m)
            assert 0 < m["start_s"] < m["wall_s"], (name, m)  # launch to every worker's first step
            assert m["eval_unit"] == "bits/byte" and m["eval_loss_final"] < m["eval_loss_start"], (name, m)
            # The eval curve: the initial model, the saved ones as training passed each eighth
            # of the budget (DP: after steps 2, 4, ..., 14), the final model.
            curve = m["curve"]
            assert curve[0] == [0, m["eval_loss_start"]] and curve[-1] == [m["tokens"], m["eval_loss_final"]], (name, curve)
            tokens = [t for t, _ in curve]
            assert tokens == sorted(set(tokens)) and all(0 < e < m["eval_loss_start"] for _, e in curve[1:]), (name, curve)
            if name == "dp":
                assert tokens[1:-1] == [WORKERS * TOKENS_PER_STEP * step for step in range(2, STEPS, 2)], curve
            else:  # exported when the learners' tokens reached a mark: as many as the supervisor saw pass
                assert len(curve) >= 2 and all(t >= budget // 8 for t in tokens[1:]), curve

    # Decoupled: what the learners say they sent is what the shards received; what they
    # received the shards sent (the shards also sent the bootstrap, which no push answers).
    decoupled = json.loads((out / "nofault" / "decoupled" / "seed0" / "summary.json").read_text())
    stops, pushed = [], 0
    for tape in sorted((out / "nofault" / "decoupled" / "seed0").glob("shard*/tape-S*.jsonl")):
        records = list(read_tape(tape))
        stops.append(next(r for r in records if r["kind"] == "stop"))
        pushed += sum(r["bytes"] for r in records if r["kind"] == "push")
    assert len(stops) == 2
    assert decoupled["bytes_up"] == pushed == sum(s["bytes_received"] for s in stops) > 0
    assert 0 < decoupled["bytes_down"] <= sum(s["bytes_sent"] for s in stops)
    assert systems["decoupled"]["seeds"][0]["bytes_per_1k_tokens"] == round(
        1000 * (decoupled["bytes_up"] + decoupled["bytes_down"]) / decoupled["tokens"], 2)

    # DP: one ring all-reduce of the gradients (and the loss) per step, in fp32.
    numel = sum(p.numel() for p in GPT(ModelConfig(width=32, depth=1, heads=2, context=32)).parameters())
    wire = STEPS * ring_allreduce_bytes(4 * (numel + 1), WORKERS)
    assert systems["dp"]["bytes_per_1k_tokens"] == pytest.approx(1000 * wire / (WORKERS * STEPS * TOKENS_PER_STEP))

    # The report: a row per system, the bandwidth target judged on these very figures.
    report = (out / "results.md").read_text()
    assert "| nofault | decoupled | 2 |" in report and "| nofault | dp | 2 |" in report and " ± " in report
    ratio = systems["dp"]["bytes_per_1k_tokens"] / systems["decoupled"]["bytes_per_1k_tokens"]
    target = next(t for t in stored["targets"] if t[0].startswith("nofault: bytes on the wire per token >= 50x lower than dp"))
    assert target[1] == (ratio >= 50) and f"({ratio:.1f}x)" in target[2], target
    # Decoupled's split of those bytes, learners to shards and back, adds up to them.
    for m in systems["decoupled"]["seeds"]:
        assert m["bytes_up_per_1k_tokens"] + m["bytes_down_per_1k_tokens"] == pytest.approx(m["bytes_per_1k_tokens"], abs=0.02)
    assert " up, " in report and " down" in report
    assert (out / "compare.png").stat().st_size > 10_000
    assert (out / "curves.png").stat().st_size > 10_000  # eval against tokens, one line per system

    # A second compare into the same directory is refused before it runs anything.
    again = compare(out)
    assert again.returncode != 0 and "already holds a run" in again.stderr and "Traceback" not in again.stderr


def test_sigterm_stops_the_sweep_writes_the_cells_done_and_says_so(tmp_path):
    """Each SIGTERM used to end only the running cell; the sweep went on with the next.
    Now the first one stops the running cell's processes and the sweep: no further cell
    starts, the report holds the cells done, one line says so, exit 143 (128 + SIGTERM)."""
    import os
    import signal
    import time

    from tests.polling import poll

    out = tmp_path / "compare"
    log = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco", "--insecure", "compare", "--scenario", "nofault", "--systems",
         "dp,decoupled,torchft", "--workers", "2", "--steps", "4", "--seeds", "1", "--out", str(out), *TINY],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        endpoints = out / "nofault" / "decoupled" / "seed0" / "endpoints.json"
        poll(endpoints.exists, "the second cell's processes", timeout_s=240, procs=[("compare", proc)])
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert proc.wait(timeout=90) == 128 + signal.SIGTERM
        assert time.monotonic() - signalled < 60
    finally:
        proc.kill()
    log.seek(0)
    lines = log.read().splitlines()
    assert lines[-1] == (f"diloco compare: SIGTERM stopped the sweep after 1 of 3 cells; the cells done are in "
                         f"{out / 'results.md'} and {out / 'results.json'}"), lines[-20:]
    assert not (out / "nofault" / "torchft").exists()  # the next cell never started
    stored = json.loads((out / "results.json").read_text())
    assert stored["interrupted"] == {"signal": "SIGTERM", "cells_done": 1, "cells_planned": 3}
    assert [(r["scenario"], list(r["systems"])) for r in stored["results"]] == [("nofault", ["dp"])]
    assert "| nofault | dp | 1 |" in (out / "results.md").read_text()
    for entry in json.loads(endpoints.read_text()):  # the stopped cell's processes are gone
        with pytest.raises(ProcessLookupError):
            os.kill(entry["pid"], 0)
