#!/bin/bash
# The one-hostile-learner-of-three rows (bounds alone) with the direction gate's start
# fixed, and the honest baseline beside them. Run from the repository root; each line about
# 5.5 minutes on a 2-core machine (the random/zero/tiny line about 16, the sybil line 14).
cd "${1:-docs/results/trust/direction-bootstrap}"
H="python -m diloco.lab.bench.hostile --seeds 0 1 2 --steps 600 --learners 2"
$H --attacks negate --out one-of-three > one-of-three.txt 2>&1
$H --attacks grow --out grow > grow.txt 2>&1
$H --attacks none --out none-bounds-only > none-bounds-only.txt 2>&1
$H --attacks random zero tiny --out others > others.txt 2>&1
$H --attackers 3 --attacks negate --out sybil-validator -- --validator > sybil-validator.txt 2>&1
python merged.py one-of-three/negate-seed? > merged.txt
