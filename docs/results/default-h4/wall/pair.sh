#!/usr/bin/env bash
# The default `diloco local` (3 learners x 150 steps) under the new defaults and the old,
# alternating, N pairs, from the repository root: its closing line each (wall, tokens, eval).
N=${1:-2}
OLD="--sync-every 8 --delta-codec int4 --reply-codec int4 --inner-optimizer adamw"
for i in $(seq 1 "$N"); do
  for which in new old; do
    out=/tmp/wall-pair/$which-$i; rm -rf "$out"; mkdir -p /tmp/wall-pair
    flags=""; [ "$which" = old ] && flags=$OLD
    python -m diloco local --out "$out" $flags > "$out.log" 2>&1
    echo "$which $i: $(grep '^eval' "$out.log")"
  done
done
