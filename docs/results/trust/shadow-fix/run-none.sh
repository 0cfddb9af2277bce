#!/bin/bash
# The honest baselines of run.sh's rows at today's defaults (no attacker: the shadow plays
# no part), run after it. Run from the repository root.
cd "${1:-docs/results/trust/shadow-fix}"
H="python -m diloco.lab.bench.hostile --seeds 0 1 2 --steps 600"
$H --learners 2 --attacks none --out none-validator -- --validator > none-validator.txt 2>&1
$H --learners 2 --attacks none --out none-bounds-only > none-bounds-only.txt 2>&1
echo done > done-none
