#!/bin/bash
# The coordinator of tests/cluster/test_local_chaos.py's run SIGSTOPped for 5 s at each of
# several moments (seconds after launch), one run after another, each run's line on stdout.
# usage: sweep.sh OUT_DIR [T...]   (from the repository root whose code is measured)
out=$1; shift
mkdir -p "$out"
for T in "${@:-5 6 7 8 9 10 11 12}"; do
  rm -rf "$out/t$T"
  python "$(dirname "$0")/stall.py" "$out/t$T" "$T"
done
