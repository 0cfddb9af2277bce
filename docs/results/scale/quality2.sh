#!/bin/bash
# three more seeds (3, 4, 5) of quality.sh, the two sides interleaved
export PATH=/work/main/.venv/bin:$PATH
for side in after before; do
  cd /tmp/$side
  echo "== $side $(git log --oneline -1 | cut -c1-7)"
  python -m tools.cli compare --scenario nofault --systems decoupled --workers 8 --steps 180 --seeds 3 --seed 3 --out /tmp/scale/cmp2-$side --json
done
