#!/usr/bin/env bash
# #53's closing measurements at today's defaults, one after another on this 2-core machine
# (about 70 min): the long and longer workloads, Decoupled and DP side by side, 3 seeds each;
# then Decoupled on the long workload at the two larger model sizes of ../outer/size/ (whose
# DP cells are reused: DP's path has not changed). Each compare's report and output is
# copied here by collect.sh.
set -euo pipefail
OUT=${OUT:-/tmp/quality-final}
mkdir -p "$OUT"
python -m diloco compare --scenario nofault --workload long --systems decoupled,dp --seeds 3 --out "$OUT/long" > "$OUT/long.txt" 2>&1
python -m diloco compare --scenario nofault --workload long --systems decoupled --seeds 1 --width 256 --heads 4 --out "$OUT/size-2m" > "$OUT/size-2m.txt" 2>&1
python -m diloco compare --scenario nofault --workload longer --systems decoupled,dp --seeds 3 --out "$OUT/longer" > "$OUT/longer.txt" 2>&1
python -m diloco compare --scenario nofault --workload long --systems decoupled --seeds 1 --width 384 --depth 4 --heads 6 --out "$OUT/size-7m" > "$OUT/size-7m.txt" 2>&1
# The standard workload's targets at the same commit (Decoupled; DP's and torchft's cells: ../std-long-fix/):
python -m diloco compare --scenario nofault --scenario mtbf30 --systems decoupled --seeds 3 --out "$OUT/standard" > "$OUT/standard.txt" 2>&1
