#!/usr/bin/env bash
# Copies a bandwidth sweep's report and each run's small records (no models, no tapes)
# into this directory: collect.sh SWEEP_OUT NAME
set -euo pipefail
src=$1; dst=$(cd "$(dirname "$0")" && pwd)/$2
mkdir -p "$dst"
cp "$src"/bandwidth.md "$src"/bandwidth.json "$src"/bandwidth.png "$dst"/
cd "$src"
find . -path '*seed*' \( -name summary.json -o -name stats.json -o -name sites.jsonl -o -name 'L*.json' \) \
  -not -name '*.events.jsonl' | while read -r f; do mkdir -p "$dst/runs/$(dirname "$f")"; cp "$f" "$dst/runs/$f"; done
