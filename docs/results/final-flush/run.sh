#!/usr/bin/env bash
# usage: docs/results/final-flush/run.sh TREE NAME [diloco local flags...]: one Decoupled run of
# the long workload's budget (today's defaults) from the checkout TREE into
# /tmp/final-flush/NAME, then its line (eval, tokens, wall, bytes per 1k tokens, the curve).
set -euo pipefail
tree=$1 name=$2; shift 2
out=/tmp/final-flush/$name
rm -rf "$out"; mkdir -p /tmp/final-flush
start=$(date +%s)
(cd "$tree" && python -m diloco local --learners 4 --learner-evals 0 --curve-points 8 --tokens 3932160 --out "$out" "$@" \
  > "/tmp/final-flush/$name.log" 2>&1)
python - "$out" "$name" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
print(f"{sys.argv[2]:16s} eval {s['eval_loss_final']} tok {s['tokens']:,} wall {sys.argv[3]}s "
      f"B/1k {(s['bytes_up']+s['bytes_down'])/s['tokens']*1000:,.0f} curve {[p[1] for p in s['curve']]}", flush=True)
PY
