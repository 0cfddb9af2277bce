"""One shard round at the defaults, in process: ``compute_round`` (gates, merge, outer
step, int4 update) over LEARNERS pushes at the learners' default codec, then
``condense_replies`` (a condensed reply to each, each learner mirrored as after its
bootstrap), best of 5 rounds, beside LEARNERS memcpys of the fragment (distinct sources).
Prints one JSON line. Runs against whichever ``diloco`` is on the path (see run.sh).

    python round.py PARAMS LEARNERS
"""

import json
import sys

from diloco.lab.bench import syncer

params, learners = int(sys.argv[1]), int(sys.argv[2])
if hasattr(syncer, "_round_and_memcpy_ms"):
    merge_ms, replies_ms, memcpy_ms = syncer._round_and_memcpy_ms(params, learners)
else:
    # An older tree: the same round, defined here (this file's copy of the function above).
    sys.path.insert(0, sys.argv[3])
    from round_old import round_and_memcpy_ms

    merge_ms, replies_ms, memcpy_ms = round_and_memcpy_ms(params, learners)
print(json.dumps({"params": params, "learners": learners, "merge_ms": round(merge_ms, 2),
                  "replies_ms": round(replies_ms, 2), "memcpy_ms": round(memcpy_ms, 2),
                  "merge_ratio": round(merge_ms / memcpy_ms, 2), "replies_ratio": round(replies_ms / memcpy_ms, 2),
                  "round_ratio": round((merge_ms + replies_ms) / memcpy_ms, 2)}))
