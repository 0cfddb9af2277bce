#!/usr/bin/env bash
# Launch -> every learner's first step (summary.json's start_s) and the initial values the
# learners sent (their summaries' bytes_initialize), 3 learners on emulated sites at each
# rate, RUNS runs per rate, for the build in the current directory.
# Usage (root, the project's venv active): run.sh OUT [RATES] [RUNS]
set -euo pipefail
out=$1; rates=${2:-1000 5 1}; runs=${3:-3}
mkdir -p "$out"
for rate in $rates; do
  for i in $(seq 1 "$runs"); do
    dir=$out/${rate}mbit-$i
    rm -rf "$dir"
    python -m diloco local --learners 3 --tokens 600000 --link-mbit "$rate" --learner-evals 0 --out "$dir" > "$dir.log" 2>&1
    python - "$dir" "$rate" <<'PY'
import json, pathlib, sys
d = pathlib.Path(sys.argv[1]); s = json.loads((d / "summary.json").read_text())
init = [json.loads(p.read_text()).get("bytes_initialize", 0) for p in sorted((d / "learners").glob("L*.json"))]
print(f"{sys.argv[2]:>5} Mbit/s  start_s {s['start_s']:6.2f}  wall {s['wall_s']:6.1f}  initial values sent {sum(init):>9,} B {init}")
PY
  done
done
