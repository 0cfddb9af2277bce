"""The merge of 8 sparse pushes of 4 Mi values at 1/8 (kept 16 of 128): fill, one
sparse_apply per push and a norm pass ("old"), against `accumulate` ("new": the fused
`sparse_merge` with fused-merge.diff applied), and a memcpy of the 16 MB; 60 turns each.
Run from the repository root: taskset -c 1 python docs/results/round/tried/merge_ab.py"""
import sys
import time

sys.path.insert(0, ".")
import numpy as np  # noqa: E402

from diloco.codec import accumulate, encode, sparse  # noqa: E402
from diloco.codec.tensor import sumsq_f32  # noqa: E402

n = 4 << 20
rng = np.random.default_rng(0)
ts = [encode("w", rng.standard_normal(n).astype(np.float32), encoding="sparse", block_size=128, kept=16,
             scale_dtype="float16") for _ in range(8)]
out = np.empty(n, np.float32)
src, dst = np.ones(n, np.float32), np.empty(n, np.float32)


def old():
    out.fill(0)
    for t in ts:
        sparse.axpy(memoryview(t.payload), 0.125, n, 128, 16, "float16", out)
    return sumsq_f32(out)


def new():
    return accumulate([(t, 0.125) for t in ts], out, overwrite=True)


res = {"old": [], "new": [], "memcpy": []}
for _ in range(60):
    for name, f in (("old", old), ("new", new), ("memcpy", lambda: np.copyto(dst, src))):
        t = time.perf_counter()
        f()
        res[name].append(time.perf_counter() - t)
for k, v in res.items():
    v.sort()
    print(k, f"min {v[0]*1e3:.2f} p25 {v[15]*1e3:.2f} median {v[30]*1e3:.2f} ms")
