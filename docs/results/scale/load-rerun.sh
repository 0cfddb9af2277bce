#!/bin/bash
# The two sweep points that failed at c40e191 (64 Mi parameters; 64 learners on 16 Mi: a
# client process's event loop was blocked past every learner's lease while it prepared the
# initial values), again at the commit that fixed it. README.md says which lines are which.
set -euo pipefail
out=${OUT:-docs/results/scale}
python -m tools.cli bench load --json --learners 8 --params 64Mi --pushes-per-s 0.25 --seconds 120 > "$out/params-64Mi.jsonl"
python -m tools.cli bench load --json --learners 8,64 --params 16Mi --pushes-per-s 1 --seconds 60 > "$out/memory.jsonl"
