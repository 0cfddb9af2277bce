"""What keeping the version ceiling costs a shard: one atomic, fsynced rewrite of
ceiling-S<m>.json each time a fragment's version passes its ceiling (once per
CEILING_STRIDE rounds), nothing otherwise."""
import pathlib
import statistics
import tempfile
import time

from diloco.syncer.ceiling import CEILING_STRIDE, VersionCeiling, ceiling_name

d = pathlib.Path(tempfile.mkdtemp())
c = VersionCeiling(d / ceiling_name(0))
times = []
for i in range(200):
    t = time.perf_counter(); c.advance(i % 4, (i // 4 + 1) * (CEILING_STRIDE + 1)); times.append(time.perf_counter() - t)
skip = []
for v in range(2000):
    t = time.perf_counter(); c.advance(0, 1); skip.append(time.perf_counter() - t)
print(f"ceiling rewrite (atomic, fsynced), 4 fragments: median {statistics.median(times)*1e3:.2f} ms, p90 {sorted(times)[179]*1e3:.2f} ms over 200 writes; "
      f"a round within the stride: {statistics.median(skip)*1e6:.2f} us; one rewrite per {CEILING_STRIDE} rounds of a fragment")
