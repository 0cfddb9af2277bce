#!/bin/bash
# The `diloco bench load` sweeps of docs/results/scale/README.md, run from the repository
# root: one JSON object per configuration in each .jsonl file, the progress on stderr.
# About 35 minutes on the 2-core machine of the README's figures.
set -euo pipefail
out=${OUT:-docs/results/scale}
load() { python -m tools.cli bench load --json "$@"; }
# Learners at a fixed fragment and a fixed offered load (16 pushes/s in all).
load --learners 1,4,16,64,256 --params 1Mi --pushes-per-s 16 --seconds 60 > "$out/learners.jsonl"
# Parameters at 8 learners, offering the same parameters per second (16Mi pushed/s).
for point in "1Mi 16" "4Mi 4" "16Mi 1" "64Mi 0.25"; do
  set -- $point
  load --learners 8 --params "$1" --pushes-per-s "$2" --seconds 120
done > "$out/params.jsonl"
# Shards for a fixed model: 16 learners pushing every fragment every 4 s.
load --learners 16 --params 4Mi --shards 1,2,4 --step-s 0.5 --seconds 60 > "$out/shards.jsonl"
# What a shard holds per learner, at a fragment where a learner's fixed costs weigh little.
load --learners 8,64 --params 16Mi --pushes-per-s 1 --seconds 60 > "$out/memory.jsonl"
