#!/bin/bash
# The trust measurements of docs/results/trust/README.md, one after another (about 70 min
# on 2 cores). Run from the repository root; the raw outputs land beside this file.
cd "${1:-docs/results/trust}"
H="python -m diloco.lab.bench.hostile --seeds 0 1 2 --steps 600"
TINYM="--width 32 --depth 1 --heads 2 --context 32"
$H --learners 2 --attackers 3 --attacks none negate --out sybil-validator -- --validator > sybil-validator.txt 2>&1
$H --learners 2 --attackers 3 --attacks negate --out sybil-bounds-only > sybil-bounds-only.txt 2>&1
$H --learners 1 --attacks none zero tiny --out stall > stall.txt 2>&1
$H --learners 1 --attacks none --out alone-bounds-off -- --robust-multiple inf > alone-bounds-off.txt 2>&1
$H --learners 1 --attacks none --out alone-fast -- $TINYM > alone-fast.txt 2>&1
$H --learners 1 --attacks none --out alone-fast-bounds-off -- $TINYM --robust-multiple inf > alone-fast-bounds-off.txt 2>&1
$H --learners 2 --attacks none random grow zero tiny negate --out one-of-three > one-of-three.txt 2>&1
echo done > done
