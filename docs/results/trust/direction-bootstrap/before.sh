#!/bin/bash
# Before the fix, at 2d4d12f (run from the repository root at that commit, with this
# directory's merged.py copied in): seed 2 of the one-negate-of-three row four times, its
# tapes kept and read by merged.py, and the grow row.
cd "${1:-docs/results/trust/direction-bootstrap}"
H="python -m diloco.lab.bench.hostile --steps 600 --learners 2"
for i in 1 2 3 4; do
  $H --seeds 2 --attacks negate --out before-$i > before-$i.txt 2>&1
done
python merged.py before-?/negate-seed2 > merged-before.txt
$H --seeds 0 1 2 --attacks grow --out grow-before > grow-before.txt 2>&1
