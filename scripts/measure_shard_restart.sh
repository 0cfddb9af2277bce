#!/usr/bin/env bash
# Issue "Nothing trained is ever lost", done-when: the eval loss after a shard restart is no
# worse than the no-fault run's, within the seed noise. For seeds 0, 1, 2: `diloco compare`
# runs Decoupled DiLoCo without faults and with shard 0 snapshotted, SIGKILLed and restored
# halfway through (same workload, same metric code), and the final eval losses are set side
# by side with their mean and spread. Raw output in docs/results/shard_restart/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/results/shard_restart
mkdir -p "$out"
: > "$out/commands.txt"
for seed in 0 1 2; do
  run=$(mktemp -d)
  cmd=(diloco compare --scenario nofault --scenario shard-restart --systems decoupled --seed "$seed"
       --seed-faults "$seed" --out "$run" --json)
  echo "${cmd[*]}" >> "$out/commands.txt"
  "${cmd[@]}" > "$out/seed$seed.jsonl" 2> "$run/stderr.txt" || { cat "$run/stderr.txt"; exit 1; }
  rm -rf "$run"
done
python - "$out" > "$out/summary.txt" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = {}
for seed in (0, 1, 2):
    for line in (out / f"seed{seed}.jsonl").read_text().splitlines():
        result = json.loads(line)
        m = result["systems"]["decoupled"]
        rows.setdefault(result["scenario"], []).append((seed, m["eval_loss_final"], m.get("uptime"), m.get("goodput")))
for scenario, values in rows.items():
    finals = [v[1] for v in values]
    print(f"{scenario}: " + ", ".join(f"seed {s} eval {e:.3f} uptime {u} goodput {g}" for s, e, u, g in values)
          + f" | mean {statistics.mean(finals):.3f}, spread {max(finals) - min(finals):.3f}")
diffs = [r[1] - n[1] for r, n in zip(rows["shard-restart"], rows["nofault"])]
print("shard-restart minus nofault, per seed: " + ", ".join(f"{d:+.3f}" for d in diffs)
      + f" | mean {statistics.mean(diffs):+.3f}")
PY
cat "$out/summary.txt"
