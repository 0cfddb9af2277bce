"""Does one bad learner ruin a run? ``diloco local`` with M honest learners, and the same
run with one more learner that holds the run's join token and TLS credential and sends
the worst push the shards accept, every time one is due. Same seeds, side by side.

The hostile learner joins from outside, as a compromised pod or a diverging host would,
through the own-loop API (``diloco.Learner.join``): it trains nothing, and before each
step it sets every fragment to its anchor plus an attack vector scaled to just under what
a shard accepts (``SyncerConfig.max_delta_ratio`` x the fragment's norm), so every push
carries that vector as its delta. Attacks:

- ``random``: a fresh random direction every step;
- ``grow``: along the fragment's own values (each merged push scales the model up);

and in both it claims 10**10 tokens per step (10**11 per push of H = 8 steps or so, under
the shards' absurdity limit of 10**12), in pushes and heartbeats. ``--robust-multiple``
reaches the shards as ``diloco local`` passes its settings on: a very large value turns
the bounds off, to show what they prevent.

    python -m diloco.lab.bench.hostile --seeds 0 1 2 --attacks none random grow --out docs/results/influence
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

CLAIMED_TOKENS_PER_STEP = 10**10
SCALE = 0.95
"""Of the largest delta a shard accepts."""


def attacker(run_dir: Path, attack: str, seed: int, step_s: float, honest: int, stop: threading.Event,
             log: list[str]) -> None:
    """Join the run in ``run_dir`` as soon as it is up and push ``attack`` until drained.
    Run it in a process of its own (``attacker_process``): joining chooses the process's
    transport (TLS) for good."""
    import diloco
    from diloco.config import RunConfig
    from diloco.learner.config import LearnerConfig
    from diloco.syncer.config import SyncerConfig
    from diloco.cli.metrics import supervisor_task

    coordinator = _wait_for_coordinator(run_dir, stop)
    if coordinator is None:
        return
    run = RunConfig.from_json((run_dir / "run.json").read_text())
    model = supervisor_task(run, 1).model
    ratio = SyncerConfig().max_delta_ratio
    # fp32 deltas: at 10x a fragment's norm, an int4 block's fp16 scale can overflow.
    learner = diloco.Learner.join(model, coordinator=coordinator, tls_dir=str(run_dir / "tls"),
                                  config=LearnerConfig(delta_codec="fp32"),
                                  join_token=(run_dir / "coordinator" / "join-token").read_text().strip())
    g = torch.Generator().manual_seed(10_000 + seed)
    log.append(f"{learner.learner_id} joined: attack {attack}")
    print(log[-1], flush=True)
    with learner:
        while not (learner.should_stop or stop.is_set() or _honest_done(run_dir, honest)):
            with torch.no_grad():
                for fragment_id, anchor in learner.anchors().items():
                    pieces = learner.plan.fragments[fragment_id].pieces
                    trained = [not p.buffer for p in pieces]
                    size = math.sqrt(sum(float(a.pow(2).sum()) for a, t in zip(anchor, trained) if t))
                    if attack == "random":
                        vectors = [torch.randn(a.shape, generator=g) for a in anchor]
                    else:  # grow: delta = anchor - params = -c * anchor
                        vectors = [-a for a in anchor]
                    length = math.sqrt(sum(float(v.pow(2).sum()) for v, t in zip(vectors, trained) if t)) or 1.0
                    scale = SCALE * ratio * max(size, 1.0) / length
                    for host, a, v, t in zip(learner._host(fragment_id), anchor, vectors, trained):
                        if t:
                            host.copy_(a - scale * v)  # the learner pushes anchor - params = scale * v
            learner.step(tokens=CLAIMED_TOKENS_PER_STEP)
            time.sleep(step_s)
    log.append(f"{learner.learner_id} left after {diloco.learner.summary.inner_steps} steps, "
               f"{diloco.learner.summary.pushes_sent} pushes")
    print(log[-1], flush=True)


def _honest_done(run_dir: Path, honest: int) -> bool:
    """Every learner ``diloco local`` launched has written its summary: the attacker
    leaves too (a run that predates the end waiting only for its own learners would wait
    for it)."""
    return len(list((run_dir / "learners").glob("*.json"))) >= honest


def _wait_for_coordinator(run_dir: Path, stop: threading.Event, timeout_s: float = 120.0) -> str | None:
    deadline = time.monotonic() + timeout_s
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            endpoints = json.loads((run_dir / "endpoints.json").read_text())
            if (run_dir / "coordinator" / "join-token").is_file():
                return next(e["address"] for e in endpoints if e["role"] == "coordinator")
        except (OSError, ValueError, StopIteration):
            pass
        stop.wait(0.2)
    return None


def one_run(out: Path, seed: int, attack: str, learners: int, steps: int, step_s: float, extra: list[str]) -> dict:
    run_dir = out / f"{attack}-seed{seed}"
    command = [sys.executable, "-m", "diloco", "local", "--learners", str(learners), "--steps", str(steps),
               "--seed", str(seed), "--out", str(run_dir), *extra]
    hostile = out / f"{attack}-seed{seed}.attacker.log"
    started = time.monotonic()
    with open(out / f"{attack}-seed{seed}.log", "w") as output, open(hostile, "w") as attacker_output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        intruder = None
        if attack != "none":
            intruder = subprocess.Popen([sys.executable, "-m", "diloco.lab.bench.hostile", "attacker", str(run_dir), attack,
                                         str(seed), str(step_s), str(learners)],
                                        stdout=attacker_output, stderr=subprocess.STDOUT)
        code = process.wait()
        if intruder is not None:
            intruder.terminate()
            try:
                intruder.wait(30)
            except subprocess.TimeoutExpired:
                intruder.kill()
                intruder.wait()
    log = [line.strip() for line in hostile.read_text().splitlines() if " joined: attack " in line or " left after " in line]
    summary = json.loads((run_dir / "summary.json").read_text())
    factors = [f for shard in sorted(run_dir.glob("shard*")) for f in _factors(shard)]
    theirs = [f for own, f in factors if not own]
    ours = [f for own, f in factors if own]
    return {"attack": attack, "seed": seed, "exit": code, "wall_s": round(time.monotonic() - started, 1),
            "eval_final": summary.get("eval_loss_final"), "attacker": log,
            "attacker_factor_median": statistics.median(theirs) if theirs else None,
            "attacker_pushes_merged": len(theirs), "honest_pushes_merged": len(ours),
            "honest_pushes_cut": sum(1 for f in ours if f < 1),
            "honest_cut_factor_median": statistics.median([f for f in ours if f < 1] or [1.0])}


def _factors(shard: Path) -> list[tuple[bool, float]]:
    """(pushed by a ``diloco local`` learner, the factor its delta was merged at: norm clip x
    direction gate) for every push the shard merged."""
    from diloco.tape import read_tape

    run_dir = shard.parent
    own = {p.name.removesuffix(".json") for p in (run_dir / "learners").glob("*.json")}
    factors = []
    for tape in shard.glob("tape-*.jsonl"):
        for r in read_tape(tape):
            if r["kind"] == "round":
                n = len(r["participants"])
                for learner, c, g in zip(r["participants"], r.get("clip") or [1.0] * n, r.get("gate") or [1.0] * n):
                    factors.append((learner in own, c * g))
    return factors


def attacker_process(argv: list[str]) -> int:
    """``attacker RUN_DIR ATTACK SEED STEP_S HONEST``: the attacker, in this process, until
    drained or SIGTERM."""
    run_dir, attack, seed, step_s, honest = Path(argv[0]), argv[1], int(argv[2]), float(argv[3]), int(argv[4])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    attacker(run_dir, attack, seed, step_s, honest, stop, [])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["attacker"]:
        return attacker_process(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--attacks", nargs="+", default=["none", "random", "grow"], choices=["none", "random", "grow"])
    parser.add_argument("--learners", type=int, default=3, help="honest learners (default 3: the attacker is 1 of 4)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--step-s", type=float, default=0.3, help="the attacker's pause between steps")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("extra", nargs="*", help="more diloco local flags, after --")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for attack in args.attacks:
            result = one_run(args.out, seed, attack, args.learners, args.steps, args.step_s, args.extra)
            results.append(result)
            print(json.dumps(result), flush=True)
    print(f"\n{'attack':8} {'eval (mean ± sd)':>20}  runs   vs none")
    base = [r["eval_final"] for r in results if r["attack"] == "none" and r["eval_final"] is not None]
    for attack in args.attacks:
        values = [r["eval_final"] for r in results if r["attack"] == attack and r["eval_final"] is not None]
        if not values:
            continue
        mean = statistics.mean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        versus = f"{100 * (mean / statistics.mean(base) - 1):+.1f} %" if base else "-"
        print(f"{attack:8} {mean:>12.3f} ± {sd:<6.3f} {len(values):>4}   {versus}")
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
