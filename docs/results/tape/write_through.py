"""What handing each round's tape record to the operating system costs (TapeWriter.write_through,
called once per round before its replies go out), against leaving it in Python's buffer:
2,000 round records of the size a K = 1 round writes, best of 5, fsync every 64 records in both.

    python docs/results/tape/write_through.py > docs/results/tape/write_through.txt
"""

import os
import tempfile
import time

from diloco.tape import TapeWriter

RECORD = dict(fragment=0, version=1, participants=["L0"], weights=[1.0], clip=[1.0], gate=[1.0], participation=0.25,
              outer=[0.0, 0.0, 0.0], quorum_s=0.0, grace_s=0.0, merge_s=0.0012, reason="quorum 1/4 reached, no grace",
              opened_t=1.0, closed_t=1.0, clock={"L0": 5, "S0": 9})
for through in (False, True):
    writer = TapeWriter(os.path.join(tempfile.mkdtemp(), "tape.jsonl"))
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(2000):
            writer.append("round", 1.0, **RECORD)
            if through:
                writer.write_through()
        best = min(best, (time.perf_counter() - started) / 2000)
    writer.close()
    print(f"{'write-through' if through else 'buffered':13s} {best * 1e6:.1f} us per round record")
