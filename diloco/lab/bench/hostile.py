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
the shards' absurdity limit of 10**12), in pushes and heartbeats. The others claim what a
batch of the run's task holds:

- ``zero``: no change at all (a stalled peer: its zero norm is in the others' reference);
- ``tiny``: a random direction at 1e-4 x the fragment's norm;
- ``negate``: it trains like an honest learner (a shadow copy of the model on the task's
  own batches) and pushes its outer gradient negated, x ``NEGATE_GAIN``: the honest
  direction reversed, which the direction gate cannot tell from the others' agreement
  when such learners are the majority.

``--attackers N`` joins N of them (one credential's worth of Sybils). ``--robust-multiple``
reaches the shards as ``diloco local`` passes its settings on: a very large value turns
the bounds off, to show what they prevent.

    python -m diloco.lab.bench.hostile --seeds 0 1 2 --attacks none random grow --out docs/results/influence
"""

from __future__ import annotations

import argparse
import copy
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
ATTACKS = ("none", "random", "grow", "zero", "tiny", "negate")
CLAIMING = ("random", "grow")
"""The attacks that claim ``CLAIMED_TOKENS_PER_STEP``."""
TINY_RATIO = 1e-4
NEGATE_GAIN = 2.9


def attacker(run_dir: Path, attack: str, seed: int, step_s: float, honest: int, stop: threading.Event,
             log: list[str]) -> None:
    """Join the run in ``run_dir`` as soon as it is up and push ``attack`` until drained.
    Run it in a process of its own (``attacker_process``): joining chooses the process's
    transport (TLS) for good."""
    import diloco
    from diloco.config import RunConfig
    from diloco.learner.config import LearnerConfig
    from diloco.syncer.config import SyncerConfig
    from diloco.cli.metrics import supervisor_task, tokens_per_step

    coordinator = _wait_for_coordinator(run_dir, stop)
    if coordinator is None:
        return
    run = RunConfig.from_json((run_dir / "run.json").read_text())
    task = supervisor_task(run, 1)
    claimed = CLAIMED_TOKENS_PER_STEP if attack in CLAIMING else tokens_per_step(run, task)
    # Everything set up before joining (``attacker_process`` preloaded torch's compiler
    # front end already): nothing slow runs while the lease does.
    shadow = Shadow(run.task, task) if attack == "negate" else None
    ratio = SyncerConfig().max_delta_ratio
    # fp32 deltas: at 10x a fragment's norm, an int4 block's fp16 scale can overflow.
    learner = diloco.Learner.join(copy.deepcopy(task.model), coordinator=coordinator, tls_dir=str(run_dir / "tls"),
                                  config=LearnerConfig(delta_codec="fp32"),
                                  join_token=(run_dir / "coordinator" / "join-token").read_text().strip())
    g = torch.Generator().manual_seed(10_000 + seed)
    log.append(f"{learner.learner_id} joined: attack {attack}")
    print(log[-1], flush=True)
    with learner:
        while not (learner.should_stop or stop.is_set() or _honest_done(run_dir, honest)):
            if shadow is not None:
                shadow.train(learner)
            with torch.no_grad():
                for fragment_id, anchor in learner.anchors().items():
                    pieces = learner.plan.fragments[fragment_id].pieces
                    trained = [not p.buffer for p in pieces]
                    size = max(math.sqrt(sum(float(a.pow(2).sum()) for a, t in zip(anchor, trained) if t)), 1.0)
                    vectors = _attack_vectors(attack, anchor, pieces, shadow, fragment_id, g)
                    length = math.sqrt(sum(float(v.pow(2).sum()) for v, t in zip(vectors, trained) if t)) or 1.0
                    if attack in CLAIMING:
                        scale = SCALE * ratio * size / length
                    elif attack == "tiny":
                        scale = TINY_RATIO * size / length
                    else:
                        scale = 1.0
                    for host, a, v, t in zip(learner._host(fragment_id), anchor, vectors, trained):
                        if t:
                            host.copy_(a - scale * v)  # the learner pushes anchor - params = scale * v
            learner.step(tokens=claimed)
            time.sleep(step_s)
    log.append(f"{learner.learner_id} left after {learner.summary.inner_steps} steps, "
               f"{learner.summary.pushes_sent} pushes")
    print(log[-1], flush=True)


def _attack_vectors(attack: str, anchor: list[torch.Tensor], pieces, shadow: "Shadow | None", fragment_id: int,
                    g: torch.Generator) -> list[torch.Tensor]:
    """The delta (up to scale) each attack pushes for one fragment."""
    if attack in ("random", "tiny"):
        return [torch.randn(a.shape, generator=g) for a in anchor]
    if attack == "grow":  # delta = anchor - params = -c * anchor
        return [-a for a in anchor]
    if attack == "negate":
        return [-NEGATE_GAIN * d for d in shadow.outer_gradient(fragment_id, pieces, anchor)]
    return [torch.zeros_like(a) for a in anchor]  # zero


class Shadow:
    """An honest learner's training, kept aside: a copy of the model trained on the task's
    own batches with its own optimizer, moved by the global values as an honest learner's
    model is (the rebase rule): when a fragment's reply arrives, its values become the new
    anchor plus the progress made since the push it answers (what was pushed is in the
    anchor now, merged)."""

    def __init__(self, spec: str, task) -> None:
        from diloco.learner.config import LearnerConfig
        from diloco.learner.runner import inner_optimizer

        self.spec, self.task, self.model = spec, task, task.model
        self.cfg = LearnerConfig()
        self.params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        self.optimizer, self.schedule = inner_optimizer(task, self.cfg)
        self.batches = iter(task.batches)
        self.seen: dict[int, list[torch.Tensor]] = {}
        self.pushed: dict[int, tuple[int, list[torch.Tensor]]] = {}
        """Fragment -> (the step its latest push was sent at, the shadow's values then)."""

    def train(self, learner) -> None:
        """One inner step, after taking in what ``learner`` received and pushed since the last
        call: a fragment whose anchor moved in answer to a push is rebased onto it, and a
        push sent since is recorded with the values it stands for (none trained since: it
        went out in the ``learner.step`` after the last call)."""
        with torch.no_grad():
            for fragment_id, anchor in learner.anchors().items():
                targets = [piece.view(self.params[piece.tensor]) for piece in learner.plan.fragments[fragment_id].pieces]
                sent = learner.book.fragments[fragment_id].sent
                before = self.seen.get(fragment_id)
                if before is None or not all(torch.equal(a, b) for a, b in zip(anchor, before)):
                    pushed = self.pushed.get(fragment_id)
                    answered = before is not None and pushed is not None and (sent is None or sent.step != pushed[0])
                    for target, a, b, p in zip(targets, anchor, before or anchor, pushed[1] if answered else anchor):
                        if before is None:
                            target.copy_(a.reshape(target.shape))
                        elif answered:  # the anchor, plus the progress made since the push
                            target.copy_(a.reshape(target.shape) + (target - p))
                        else:  # moved with our push still out (a re-sync): by the anchor's move
                            target.add_((a - b).reshape(target.shape))
                    if answered:
                        del self.pushed[fragment_id]
                    self.seen[fragment_id] = [a.clone() for a in anchor]
                # A push sent since the last call stands for the values now (rebased first, as
                # an honest learner applies a reply before it sends in the same step).
                if sent is not None and self.pushed.get(fragment_id, (None,))[0] != sent.step:
                    self.pushed[fragment_id] = (sent.step, [t.detach().clone() for t in targets])
        from diloco.learner.runner import inner_step

        inner_step(self.spec, self.task, next(self.batches), self.optimizer, self.schedule, self.cfg.grad_clip)

    def outer_gradient(self, fragment_id: int, pieces, anchor: list[torch.Tensor]) -> list[torch.Tensor]:
        """What an honest learner would push for the fragment: anchor - its trained values."""
        return [a - p.view(self.params[p.tensor]).detach().reshape(a.shape) for p, a in zip(pieces, anchor)]


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


def one_run(out: Path, seed: int, attack: str, learners: int, steps: int, step_s: float, extra: list[str],
            attackers: int = 1) -> dict:
    run_dir = out / f"{attack}-seed{seed}"
    command = [sys.executable, "-m", "diloco", "local", "--learners", str(learners), "--steps", str(steps),
               "--seed", str(seed), "--out", str(run_dir), *extra]
    hostile = out / f"{attack}-seed{seed}.attacker.log"
    started = time.monotonic()
    with open(out / f"{attack}-seed{seed}.log", "w") as output, open(hostile, "w") as attacker_output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        intruders = [subprocess.Popen([sys.executable, "-m", "diloco.lab.bench.hostile", "attacker", str(run_dir), attack,
                                       str(seed * 100 + k), str(step_s), str(learners)],
                                      stdout=attacker_output, stderr=subprocess.STDOUT)
                     for k in range(attackers if attack != "none" else 0)]
        code = process.wait()
        for intruder in intruders:
            intruder.terminate()
        for intruder in intruders:
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
    from diloco.learner.server import preload

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    preload()  # before joining, as a learner does: no lease runs while it loads
    attacker(run_dir, attack, seed, step_s, honest, stop, [])
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["attacker"]:
        return attacker_process(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--attacks", nargs="+", default=["none", "random", "grow"], choices=ATTACKS)
    parser.add_argument("--learners", type=int, default=3, help="honest learners (default 3: the attacker is 1 of 4)")
    parser.add_argument("--attackers", type=int, default=1, help="hostile learners joined per attacked run")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--step-s", type=float, default=0.3, help="the attacker's pause between steps")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("extra", nargs="*", help="more diloco local flags, after --")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for attack in args.attacks:
            result = one_run(args.out, seed, attack, args.learners, args.steps, args.step_s, args.extra, args.attackers)
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
