#!/bin/bash
# A shard round before (BEFORE, a tree at 5c364c2 with its kernel built) and after (this
# tree), alternating, 3 times per size: docs/results/round/output.txt.
#   BEFORE=/tmp/before docs/results/round/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
for point in "1048576 8" "4194304 8" "16777216 8" "4194304 1" "4194304 32"; do
  for try in 1 2 3; do
    for tree in "$BEFORE" "$root"; do
      label=$([ "$tree" = "$root" ] && echo after || echo before)
      echo "$label $try $(cd "$here" && PYTHONPATH="$tree" python round.py $point)"
    done
  done
done
