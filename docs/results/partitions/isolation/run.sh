#!/usr/bin/env bash
# One isolation soak: diloco local with every fault an isolate-coordinator of 8 s (longer
# than the 5 s lease), on average one every 10 s, on 50 Mbit/s emulated sites (root).
# usage: [STEPS=6000] run.sh TREE OUT SEED   (TREE: a checkout of the commit to run, its C kernel built)
set -euo pipefail
cd "$1"
python -m diloco --insecure local --learners 3 --shards 2 --steps "${STEPS:-6000}" --batch-size 8 \
  --link-mbit 50 --chaos isolate-coordinator:8 --chaos-every 10 --chaos-seed "$3" --out "$2" \
  --width 32 --depth 1 --heads 2 --context 32
