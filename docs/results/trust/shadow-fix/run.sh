#!/bin/bash
# The negate rows of docs/results/trust again, with the shadow fixed (c4e1aea: it follows
# the global values by the rebase rule). Run from the repository root.
cd "${1:-docs/results/trust/shadow-fix}"
H="python -m diloco.lab.bench.hostile --seeds 0 1 2 --steps 600"
$H --learners 2 --attackers 3 --attacks negate --out sybil-validator -- --validator > sybil-validator.txt 2>&1
$H --learners 2 --attackers 3 --attacks negate --out sybil-bounds-only > sybil-bounds-only.txt 2>&1
$H --learners 2 --attacks negate --out one-of-three > one-of-three.txt 2>&1
echo done > done
