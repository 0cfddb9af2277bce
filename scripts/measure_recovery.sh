#!/usr/bin/env bash
# The recovery point of a shard killed with no snapshot (README, "Nothing trained is lost"):
# three `diloco local` runs on the defaults in which shard 0 is SIGKILLed 20 s in and
# restarted with no state, so it recovers from the learners' anchors (the newest offered
# within the shard's anchor window). For each owned fragment: its version (Status) just
# before the kill, the anchors offered, the version it came back at, and the rounds lost
# between them (rounds closed in the milliseconds between the
# Status call and the kill are not seen). Raw output in docs/results/recovery/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/results/recovery
mkdir -p "$out"
: > "$out/rounds_lost.txt"
: > "$out/commands.txt"
for seed in 0 1 2; do
  run=$(mktemp -d)
  cmd=(diloco local --seed "$seed" --restart-shard-at 20 --restart-from learners --out "$run/run")
  echo "${cmd[*]}" >> "$out/commands.txt"
  "${cmd[@]}" > /dev/null 2> "$run/stderr.txt"
  cp "$run/run/summary.json" "$out/summary-seed$seed.json"
  python - "$run/run" "$seed" >> "$out/rounds_lost.txt" <<'PY'
import json, sys
from pathlib import Path
from diloco.tape import read_tape
run, seed = Path(sys.argv[1]), sys.argv[2]
(restart,) = [json.loads(line) for line in (run / "chaos.jsonl").read_text().splitlines()]
before = {int(f): v for f, v in restart["versions_before"].items()}  # Status just before the SIGKILL
lives = []
for r in read_tape(run / "shard0" / "tape-S0.jsonl"):
    if r["kind"] == "start":
        lives.append([])
    lives[-1].append(r)
records = {r["fragment"]: r for r in lives[-1] if r["kind"] == "initialize"}
for f in sorted(before):
    r = records[f]
    offered = ", ".join(f"{who}@{v}" for who, v in r.get("offered", []))
    print(f"seed {seed} fragment {f}: version {before[f]} just before the kill, recovered at {r['version']} "
          f"({r['learner']}'s anchor, the newest of those offered: {offered}), rounds lost {before[f] - r['version']}")
PY
  diloco replay "$run/run" --check | tail -1 | sed "s/^/seed $seed: /" >> "$out/rounds_lost.txt"
  rm -rf "$run"
done
cat "$out/rounds_lost.txt"
