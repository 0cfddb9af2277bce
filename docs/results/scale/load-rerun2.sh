#!/bin/bash
# The learner sweep and the memory points again at the commit where learners stay members
# until the shards' RSS at the window's end is read (before it, learners that had no push in
# flight left first and took their mirrors: rss_now_bytes read low). README.md says which
# files hold which run.
set -euo pipefail
out=${OUT:-docs/results/scale}
python -m tools.cli bench load --json --learners 8,64 --params 16Mi --pushes-per-s 1 --seconds 60 > "$out/memory.jsonl"
python -m tools.cli bench load --json --learners 1,4,16,64,256 --params 1Mi --pushes-per-s 16 --seconds 60 > "$out/learners.jsonl"
