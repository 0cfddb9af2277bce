"""One shard round at the defaults, in process: ``compute_round`` (gates, merge, outer
step, int4 update) over LEARNERS pushes at the learners' default codec, then
``condense_replies`` (a condensed reply to each, each learner mirrored as after its
bootstrap), best of 5 rounds, beside LEARNERS memcpys of the fragment (distinct sources).
Prints one JSON line.

The measurement is this tree's ``diloco.lab.bench.syncer._round_and_memcpy_ms``, loaded
from its file, so that it runs unchanged against whichever ``diloco`` is importable (an
older tree through PYTHONPATH: see run.sh).

    python round.py PARAMS LEARNERS
"""

import importlib.util
import json
import sys
from pathlib import Path

params, learners = int(sys.argv[1]), int(sys.argv[2])
source = Path(__file__).resolve().parents[3] / "diloco" / "lab" / "bench" / "syncer.py"
spec = importlib.util.spec_from_file_location("round_bench", source)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
merge_ms, replies_ms, memcpy_ms = bench._round_and_memcpy_ms(params, learners)
print(json.dumps({"params": params, "learners": learners, "merge_ms": round(merge_ms, 2),
                  "replies_ms": round(replies_ms, 2), "memcpy_ms": round(memcpy_ms, 2),
                  "merge_ratio": round(merge_ms / memcpy_ms, 2), "replies_ratio": round(replies_ms / memcpy_ms, 2),
                  "round_ratio": round((merge_ms + replies_ms) / memcpy_ms, 2)}))
