#!/bin/bash
# before: a worktree of eb6d511 at /tmp/wt-hb; after: /work/main (the working tree)
. /work/main/.venv/bin/activate
for build in before after before after; do
  if [ $build = before ]; then d=/tmp/wt-hb; else d=/work/main; fi
  echo "== $build"
  (cd $d && PYTHONPATH=$d python /tmp/hb-cost.py 256 1024 2048)
done
