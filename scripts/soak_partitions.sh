#!/usr/bin/env bash
# The partitions soak of docs/results/partitions: `diloco local --chaos` with every fault
# kind for SECONDS per seed on 20 Mbit/s emulated sites (root), then `diloco check` over
# all the runs. Keeps each run's console output, chaos.jsonl, check.json and summary.json
# (the run directories themselves, with their push logs, stay in WORK).
# Usage: scripts/soak_partitions.sh [SECONDS per seed, default 660] [SEEDS, default "1 2 3"]
set -euo pipefail
seconds=${1:-660}
seeds=${2:-1 2 3}
out=docs/results/partitions
work=${WORK:-/tmp/diloco-soak}
rm -rf "$work" && mkdir -p "$work" "$out"
kinds=cut:15,cut-shard:15,cut-coordinator:15,isolate-coordinator:10,flap:15,starve:15,kill,restart-shard
runs=()
for seed in $seeds; do
  cmd=(diloco local --out "$work/seed$seed" --learners 3 --shards 2 --steps 4000 --time-limit-s "$seconds"
       --link-mbit 20 --chaos "$kinds" --chaos-every 8 --chaos-seed "$seed")
  echo "\$ ${cmd[*]}" > "$out/output-seed$seed.txt"
  python -m diloco "${cmd[@]:1}" >> "$out/output-seed$seed.txt" 2>&1 || true  # the check below says why
  for f in chaos.jsonl check.json summary.json; do cp "$work/seed$seed/$f" "$out/${f%%.*}-seed$seed.${f#*.}"; done
  runs+=("$work/seed$seed")
done
echo "\$ diloco check ${runs[*]}" > "$out/check.txt"
python -m diloco check "${runs[@]}" >> "$out/check.txt"
