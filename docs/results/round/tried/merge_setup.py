import sys, time
sys.path.insert(0, ".")
import numpy as np
from diloco.codec import encode, accumulate
from diloco.codec.int4 import native
from diloco.codec import sparse
from diloco.codec.tensor import sumsq_f32
k = native()
n = 4 << 20
rng = np.random.default_rng(0)
ts = [encode("w", rng.standard_normal(n).astype(np.float32), encoding="sparse", block_size=128, kept=16, scale_dtype="float16") for _ in range(8)]
out = np.empty(n, np.float32)
def old():
    out.fill(0)
    for t in ts:
        sparse.axpy(memoryview(t.payload), 0.125, n, 128, 16, "float16", out)
    return sumsq_f32(out)
def new():
    return accumulate([(t, 0.125) for t in ts], out, overwrite=True)
src = np.ones(n, np.float32); dst = np.empty_like(src)
for r in range(3):
    for name, f in (("old", old), ("new", new), ("memcpy", lambda: np.copyto(dst, src))):
        best = min((lambda: (lambda t: (f(), time.perf_counter() - t)[1])(time.perf_counter()))() for _ in range(7))
        print(name, f"{best*1e3:.2f} ms", end="  ")
    print()
