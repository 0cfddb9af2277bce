#!/bin/bash
# bench syncer, before (2392f10: float32 mirrors) and after (int8 mirrors), interleaved
export PATH=/work/main/.venv/bin:$PATH
for L in 4 16 32; do
  for side in before after; do
    cd /tmp/$side
    echo "== $side learners=$L $(git log --oneline -1 | cut -c1-7)"
    python -m tools.cli bench syncer --params 1Mi --learners $L --rounds 10 --json
  done
done
