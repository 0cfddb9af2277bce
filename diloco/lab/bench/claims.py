"""Can token claims end a token-budgeted run early? ``diloco local --tokens N`` with its own
learners, and the same run with ``claimers`` more learners that join from outside with the
run's join credential (``DATA_DIR/join-token``) and claim 10**10 tokens per step in every
heartbeat, stepping as fast as the run's own learners report, while training and pushing
nothing. The coordinator credits each at most its credential's tokens/s
(``--join-tokens-per-s``, 0 by default), so the budget, the reported tokens and the
goodput count what the run's learners trained. Same seeds, side by side.

    python -m diloco.lab.bench.claims --seeds 0 1 2 --out docs/results/tokens
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from diloco.lab.bench.hostile import _wait_for_coordinator

CLAIMED_TOKENS_PER_STEP = 10**10
CLAIM_EVERY_S = 0.25


async def _claim(run_dir: Path, coordinator: str, count: int, stop: threading.Event) -> None:
    from diloco import rpc
    from diloco.clients.coordinator import LearnerSession
    from diloco.errors import DilocoError

    rpc.use_tls(rpc.choose_transport(run_dir / "tls", False, {}).tls)
    token = (run_dir / "coordinator" / "join-token").read_text().strip()
    sessions = []
    for _ in range(count):
        session = LearnerSession(coordinator, timeout_s=10)
        try:
            await session.join(token, address="claimer")
        except DilocoError as error:
            print(f"refused: {error}", flush=True)
            continue
        print(f"{session.learner_id} joined", flush=True)
        sessions.append(session)
    steps, started = 0, time.monotonic()
    while sessions and not stop.is_set():
        steps = max(steps + 1, int((time.monotonic() - started) / 0.02))  # 50 steps/s, faster than a small model
        for session in list(sessions):
            try:
                await session.heartbeat(tokens=steps * CLAIMED_TOKENS_PER_STEP, inner_steps=steps,
                                        tokens_per_s=CLAIMED_TOKENS_PER_STEP * 50.0)
            except DilocoError as error:
                print(f"{session.learner_id} stopped: {error}", flush=True)
                sessions.remove(session)
        await asyncio.sleep(CLAIM_EVERY_S)
    for session in sessions:
        try:
            await session.leave("claims done", tokens=steps * CLAIMED_TOKENS_PER_STEP, inner_steps=steps)
        except DilocoError:
            pass
    print(f"claimed {steps} steps x {CLAIMED_TOKENS_PER_STEP:.0e} tokens each", flush=True)


def claimer_process(argv: list[str]) -> int:
    """``claimer RUN_DIR COUNT``: the claimers, in this process, until SIGTERM or refused."""
    run_dir, count = Path(argv[0]), int(argv[1])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    coordinator = _wait_for_coordinator(run_dir, stop)
    if coordinator is not None:
        asyncio.run(_claim(run_dir, coordinator, count, stop))
    return 0


def one_run(out: Path, seed: int, claimers: int, learners: int, tokens: int, extra: list[str]) -> dict:
    name = f"claimers{claimers}-seed{seed}"
    run_dir = out / name
    command = [sys.executable, "-m", "diloco", "local", "--learners", str(learners), "--tokens", str(tokens),
               "--seed", str(seed), "--out", str(run_dir), *extra]
    with open(out / f"{name}.log", "w") as output, open(out / f"{name}.claimers.log", "w") as claimer_output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        claimer = None
        if claimers:
            claimer = subprocess.Popen([sys.executable, "-m", "diloco.lab.bench.claims", "claimer", str(run_dir),
                                        str(claimers)], stdout=claimer_output, stderr=subprocess.STDOUT)
        code = process.wait()
        if claimer is not None:
            claimer.terminate()
            claimer.wait(30)
    summary = json.loads((run_dir / "summary.json").read_text())
    own = {p.name.removesuffix(".json") for p in (run_dir / "learners").glob("*.json")}
    rows = summary["learners"]
    return {"claimers": claimers, "seed": seed, "exit": code, "wall_s": summary["wall_s"],
            "tokens": summary["tokens"], "goodput": summary["goodput"], "eval_final": summary["eval_loss_final"],
            "own_tokens": sum(r["tokens"] for r in rows if r["id"] in own),
            "own_steps": sum(r["inner_steps"] for r in rows if r["id"] in own),
            "claimer_tokens": [r["tokens"] for r in rows if r["id"] not in own]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["claimer"]:
        return claimer_process(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--claimers", type=int, default=4)
    parser.add_argument("--learners", type=int, default=2, help="the run's own learners")
    parser.add_argument("--tokens", type=int, default=614400, help="the run's token budget")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("extra", nargs="*", help="more diloco local flags, after --")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for claimers in (0, args.claimers):
            result = one_run(args.out, seed, claimers, args.learners, args.tokens, args.extra)
            results.append(result)
            print(json.dumps(result), flush=True)
    print(f"\n{'claimers':>8} {'own tokens (mean)':>18} {'vs none':>8} {'max goodput':>12} {'eval (mean)':>12}")
    base = statistics.mean(r["own_tokens"] for r in results if r["claimers"] == 0)
    for claimers in (0, args.claimers):
        rows = [r for r in results if r["claimers"] == claimers]
        own = statistics.mean(r["own_tokens"] for r in rows)
        print(f"{claimers:>8} {own:>18,.0f} {100 * (own / base - 1):>+7.1f}% {max(r['goodput'] for r in rows):>12.3f} "
              f"{statistics.mean(r['eval_final'] for r in rows):>12.3f}")
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
