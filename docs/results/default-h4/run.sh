#!/usr/bin/env bash
# usage: docs/results/default-h4/run.sh NAME [diloco local flags...], from the repository root:
# one Decoupled run of the long workload's budget into /tmp/default-h4/NAME, then its line
# (eval, tokens, wall, bytes per 1k tokens, the curve). commands.sh lists the runs of README.md.
set -euo pipefail
name=$1; shift
out=/tmp/default-h4/$name
rm -rf "$out"; mkdir -p /tmp/default-h4
start=$(date +%s)
python -m diloco local --learners 4 --learner-evals 0 --curve-points 8 ${TOKENS:---tokens 3932160} --out "$out" "$@" \
  > "/tmp/default-h4/$name.log" 2>&1
echo "$*" > "$out/flags.txt"
python - "$out" "$name" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
print(f"{sys.argv[2]:28s} eval {s['eval_loss_final']} tok {s['tokens']:,} wall {sys.argv[3]}s "
      f"B/1k {(s['bytes_up']+s['bytes_down'])/s['tokens']*1000:,.0f} curve {[p[1] for p in s['curve']]}", flush=True)
PY
