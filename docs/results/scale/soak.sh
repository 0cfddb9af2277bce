#!/bin/bash
# 256 synthetic learners against one shard for 5 minutes (docs/results/scale/README.md):
# every learner pushes a 1 Mi-parameter fragment every 16 s, and heartbeats every second.
set -euo pipefail
python -m tools.cli bench load --json --learners 256 --params 1Mi --pushes-per-s 16 --seconds 300
