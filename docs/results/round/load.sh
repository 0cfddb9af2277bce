#!/bin/bash
# Real processes (diloco bench load: a coordinator, a shard, synthetic learners over gRPC
# with mutual TLS): the shard's CPU per push before (BEFORE, a tree at 5c364c2 with its
# kernel built) and after (this tree), alternating, twice: docs/results/round/load.jsonl.
#   BEFORE=/tmp/before docs/results/round/load.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
for try in 1 2; do
  for tree in "$BEFORE" "$root"; do
    label=$([ "$tree" = "$root" ] && echo after || echo before)
    for point in "--learners 16 --params 1Mi --pushes-per-s 16" "--learners 8 --params 4Mi --pushes-per-s 4"; do
      echo "{\"tree\": \"$label\", \"try\": $try, \"result\": $(cd /tmp && PYTHONPATH="$tree" python -m diloco bench load --json $point --seconds 40 2>/dev/null)}"
    done
  done
done
