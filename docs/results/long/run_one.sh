#!/usr/bin/env bash
# usage: run.sh NAME [diloco local flags...]: one Decoupled run of the long workload's budget
cd /work/main && . .venv/bin/activate
name=$1; shift
out=runs/exp/$name
rm -rf "$out"
start=$(date +%s)
diloco local --learners 4 --learner-evals 0 --curve-points 8 --out "$out" "$@" > "runs/exp/$name.log" 2>&1
python - "$out" "$name" "$(( $(date +%s) - start ))" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
print(f"{sys.argv[2]:32s} eval {s['eval_loss_final']} tokens {s['tokens']:,} wall {sys.argv[3]}s "
      f"up {s['bytes_up']/s['tokens']*1000:,.0f} down {s['bytes_down']/s['tokens']*1000:,.0f} B/1k "
      f"curve {[p[1] for p in s['curve']]}", flush=True)
PY
