#!/usr/bin/env bash
# Regenerates the figures in docs/ from real `diloco local` runs (about 5 minutes on a
# quiet 2-core machine). Usage: scripts/regenerate_figures.sh [RUNS_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-runs/figures}
rm -rf "$runs/default" "$runs/chaos"

# The README's first command: the defaults, no faults.
diloco local --out "$runs/default" --json > "$runs.default.json"
cp "$runs/default/timeline.png" docs/timeline.png

# Chaos: a slow learner, two kills (replaced), two scavenged learners, a shard restart.
diloco local --slow-learner L1:1.5 --kill-learner-every 20 --max-kills 2 --chaos-seed 9 \
    --scavenge 2@25 --restart-shard-at 35 --out "$runs/chaos" --json > "$runs.chaos.json"
cp "$runs/chaos/timeline.png" docs/timeline_chaos.png
diloco replay --check "$runs/default"
diloco replay --check "$runs/chaos"
echo "figures in docs/; summaries in $runs.default.json and $runs.chaos.json"
