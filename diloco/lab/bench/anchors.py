"""Can one learner poison a shard that restarts without its state? ``diloco local`` with
M honest learners and a shard SIGKILLed and restarted with no state mid-run
(``--restart-shard-at T --restart-from learners``): its fragments come back from the
learners' anchors. One more learner joins from outside with the run's join token and TLS
credential; it trains nothing and pushes nothing, reads the global values (Bootstrap)
while the shard serves, and when the shard comes back recovering it offers, for each
fragment, 4 copies of the newest values it read negated at version +100,000, then 4
copies negated at version +1: the same norm, the newest version a shard could believe.
``none``: the same learner joins and reads, and offers nothing. Same seeds side by side.

    python -m diloco.lab.bench.anchors --seeds 0 1 2 --out docs/results/anchors
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

COPIES = 4
VERSION_JUMP = 100_000


async def poison(run_dir: Path, attack: str, learners: int, stop: threading.Event) -> None:
    """Join the run in ``run_dir``, keep its fragments' newest values, and offer them
    poisoned to each shard that comes back recovering (``attack`` "negate"; "none": never)."""
    import torch

    from diloco import auth, rpc
    from diloco.clients.coordinator import LearnerSession
    from diloco.clients.syncer import SyncerClient, open_channel
    from diloco.codec import encode
    from diloco.config import RunConfig
    from diloco.manifest import Manifest
    from diloco.lab.bench.hostile import _honest_done, _wait_for_coordinator

    coordinator = _wait_for_coordinator(run_dir, stop)
    if coordinator is None:
        return
    rpc.use_tls(rpc.Tls.from_dir(run_dir / "tls"))
    run = RunConfig.from_json((run_dir / "run.json").read_text())
    session = LearnerSession(coordinator)
    await session.join((run_dir / "coordinator" / "join-token").read_text().strip(), address="anchor-poisoner")
    print(f"{session.learner_id} joined: attack {attack}", flush=True)
    credential = auth.Credential(session.learner_id, session.credential)
    topology = await session.topology()
    while not topology.manifest_json:
        await asyncio.sleep(0.5)
        topology = await session.topology()
    plan = Manifest.from_json(topology.manifest_json).plan(run.fragments)
    shards = {s.shard_id: SyncerClient(open_channel(s.address, 64 << 20), credential, timeout_s=30) for s in topology.shards}
    owned = {s.shard_id: list(s.fragments) for s in topology.shards}
    newest: dict[int, tuple[int, list]] = {}
    offered: set[int] = set()
    last_beat = 0.0
    while not stop.is_set() and not _honest_done(run_dir, learners):
        if time.monotonic() - last_beat > 1.0:
            await session.heartbeat()
            credential.renew(session.credential)
            last_beat = time.monotonic()
        for shard, client in shards.items():
            try:
                status = await client.status()
                if not status.anchors_only:
                    for update in await client.bootstrap(owned[shard]):
                        newest[update.fragment] = (update.version, [torch.as_tensor(t) for t in update.segments[-1].tensors])
                    offered.discard(shard)
                elif attack == "negate" and shard not in offered:
                    offered.add(shard)
                    held = {f.fragment for f in status.fragments}
                    asyncio.ensure_future(_offer_all(client, plan, topology.manifest_json, newest,
                                                     [f for f in owned[shard] if f not in held and f in newest], encode))
            except Exception as error:  # noqa: BLE001 - a shard down or restarting: try again
                print(f"shard {shard}: {type(error).__name__}: {str(error)[:120]}", flush=True)
        await asyncio.sleep(0.2)
    print(f"{session.learner_id} left", flush=True)
    await session.leave("done")


async def _offer_all(client, plan, manifest_json: str, newest: dict, fragments: list[int], encode) -> None:
    async def offer(fragment: int, version: int) -> str:
        values = [-t for t in newest[fragment][1]]
        encoded = [encode(p.name, t, encoding="fp32") for p, t in zip(plan.fragments[fragment].pieces, values)]
        try:
            return "taken" if await client.initialize(fragment, manifest_json, plan.plan_hash, encoded, version) else "not taken"
        except Exception as error:  # noqa: BLE001 - what the shard answered is the result
            return f"{getattr(error, 'code', lambda: type(error).__name__)()}: {getattr(error, 'details', lambda: '')()}"

    tasks = []
    for fragment in fragments:
        version = newest[fragment][0]
        tasks += [(fragment, version + VERSION_JUMP, asyncio.ensure_future(offer(fragment, version + VERSION_JUMP)))
                  for _ in range(COPIES)]
    await asyncio.sleep(0.3)
    for fragment in fragments:
        version = newest[fragment][0]
        tasks += [(fragment, version + 1, asyncio.ensure_future(offer(fragment, version + 1))) for _ in range(COPIES)]
    for fragment, version, task in tasks:
        print(f"offered fragment {fragment} negated at version {version}: {await task}", flush=True)


def attacker_process(run_dir: str, attack: str, learners: int) -> None:
    asyncio.run(poison(Path(run_dir), attack, learners, threading.Event()))


def one_run(out: Path, seed: int, attack: str, learners: int, steps: int, restart_at: float, extra: list[str]) -> dict:
    run_dir = out / f"{attack}-seed{seed}"
    command = [sys.executable, "-m", "diloco", "local", "--learners", str(learners), "--steps", str(steps),
               "--seed", str(seed), "--restart-shard-at", str(restart_at), "--restart-from", "learners",
               "--out", str(run_dir), *extra]
    started = time.monotonic()
    with open(out / f"{attack}-seed{seed}.log", "w") as output, open(out / f"{attack}-seed{seed}.attacker.log", "w") as log:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        intruder = subprocess.Popen([sys.executable, "-m", "diloco.lab.bench.anchors", "attacker", str(run_dir), attack,
                                     str(learners)], stdout=log, stderr=subprocess.STDOUT)
        code = process.wait()
        try:
            intruder.wait(30)
        except subprocess.TimeoutExpired:
            intruder.terminate()
            intruder.wait()
    summary = json.loads((run_dir / "summary.json").read_text())
    recovered = []
    for tape in sorted(run_dir.glob("shard*/tape-S*.jsonl")):
        for line in tape.read_text().splitlines():
            record = json.loads(line) if line.endswith("}") else {}
            if record.get("kind") == "initialize" and record.get("offered"):
                recovered.append({"fragment": record["fragment"], "learner": record["learner"], "version": record["version"],
                                  "offered": record["offered"]})
    return {"attack": attack, "seed": seed, "exit": code, "wall_s": round(time.monotonic() - started, 1),
            "eval_final": summary.get("eval_loss_final"), "recovered": recovered, "command": " ".join(command[2:])}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["attacker"]:
        attacker_process(argv[1], argv[2], int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(prog="python -m diloco.lab.bench.anchors")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--attacks", nargs="+", default=["none", "negate"], choices=["none", "negate"])
    parser.add_argument("--learners", type=int, default=2, help="honest learners (diloco local's)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--restart-at", type=float, default=15.0, help="seconds into the run the shard is restarted")
    parser.add_argument("--out", type=Path, required=True)
    args, extra = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for attack in args.attacks:
            row = one_run(args.out, seed, attack, args.learners, args.steps, args.restart_at, extra)
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(args.out / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
