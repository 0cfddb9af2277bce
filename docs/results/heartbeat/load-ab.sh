#!/bin/bash
# before: a worktree of eb6d511 at /tmp/wt-hb; after: /work/main (the working tree)
. /work/main/.venv/bin/activate
for pass in 1 2; do
  for build in before after; do
    if [ $build = before ]; then d=/tmp/wt-hb; else d=/work/main; fi
    echo "== pass $pass $build"
    (cd $d && PYTHONPATH=$d python -m diloco --insecure bench load --learners 256,512 --params 64Ki --step-s 2 --seconds 30 --json)
  done
done
