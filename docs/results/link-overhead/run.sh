#!/usr/bin/env bash
# What the kernel counts on the learners' emulated links beyond the payloads they count,
# by cause (summary.json's links.breakdown_up / breakdown_down, diloco.cli.metrics.link_breakdown):
# `diloco local` on its defaults (3 learners, int4 pushes) with every learner on a site
# of RATE Mbit/s each way, RUNS runs per rate, then the table (table.py).
# Usage (root, the project's venv active): run.sh OUT [RATES] [RUNS]
set -euo pipefail
out=$1; rates=${2:-1000 20 5 1}; runs=${3:-1}
mkdir -p "$out"
for rate in $rates; do
  for i in $(seq 1 "$runs"); do
    dir=$out/${rate}mbit-$i
    rm -rf "$dir"
    python -m diloco local --link-mbit "$rate" --learner-evals 0 --out "$dir" > "$dir.log" 2>&1
  done
done
python "$(dirname "$0")/table.py" "$out"/*mbit-*/summary.json
