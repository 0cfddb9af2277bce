#!/usr/bin/env bash
# usage: run.sh NAME [diloco local flags...]: one Decoupled run of the long workload's budget, from the worktree
. /work/main/.venv/bin/activate
name=$1; shift
out=/work/exp/runs/$name
rm -rf "$out"; mkdir -p /work/exp/runs
start=$(date +%s)
PYTHONPATH=${TREE:-/work/wt} python -m diloco local --learners 4 --learner-evals 0 --curve-points 8 ${TOKENS:---tokens 3932160} --out "$out" "$@" > "/work/exp/runs/$name.log" 2>&1
echo "$*" > "$out/flags.txt"
python - "$out" "$name" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
print(f"{sys.argv[2]:28s} eval {s['eval_loss_final']} tok {s['tokens']:,} wall {sys.argv[3]}s "
      f"B/1k {(s['bytes_up']+s['bytes_down'])/s['tokens']*1000:,.0f} curve {[p[1] for p in s['curve']]}", flush=True)
PY
