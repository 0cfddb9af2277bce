#!/usr/bin/env bash
# Copy each compare's report from $OUT (commands.sh's, /tmp/quality-final by default) here:
# results.md, results.json, the plots, what it printed without the progress lines
# (output.txt) and each run's summary.json; then the tables (collect.py -> collect.txt).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/quality-final}
for name in long longer size-2m size-7m standard; do
  [ -d "$OUT/$name" ] || continue
  mkdir -p "$here/$name"
  cp "$OUT/$name"/results.md "$OUT/$name"/results.json "$OUT/$name"/*.png "$here/$name/"
  grep -v '^\[ *[0-9]* s\]' "$OUT/$name.txt" > "$here/$name/output.txt"
  (cd "$OUT/$name" && find . -name summary.json -path '*seed*' | while read -r f; do
     mkdir -p "$here/$name/runs/$(dirname "$f")"; cp "$f" "$here/$name/runs/$f"; done)
done
python "$here/collect.py" > "$here/collect.txt"
