#!/bin/bash
# Decoupled, nofault, 8 learners taking turns (quorum 1): float32 mirrors (2392f10) vs int8 mirrors (ee67de6)
export PATH=/work/main/.venv/bin:$PATH
for side in before after; do
  cd /tmp/$side
  echo "== $side $(git log --oneline -1 | cut -c1-7)"
  python -m tools.cli compare --scenario nofault --systems decoupled --workers 8 --steps 180 --seeds 3 --out /tmp/scale/cmp-$side --json
done
