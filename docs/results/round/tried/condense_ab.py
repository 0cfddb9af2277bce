"""mirror_condense of 4 Mi values at 16 kept of 128 from two builds of the kernel, 40 turns
each: taskset -c 1 python condense_ab.py OLD.so NEW.so (each built with the package's
flags: gcc -O3 -ffp-contract=off -shared -fPIC)."""
import importlib.machinery, importlib.util, sys, time
import numpy as np
def load(path):
    loader = importlib.machinery.ExtensionFileLoader("_int4", path)
    m = importlib.util.module_from_spec(importlib.util.spec_from_loader("_int4", loader)); loader.exec_module(m); return m
old, new = load(sys.argv[1]), load(sys.argv[2])
n = 4 << 20
rng = np.random.default_rng(0)
goal = rng.standard_normal(n).astype(np.float32)
anchor = goal - (rng.standard_normal(n) * 1e-2).astype(np.float32)
codes = np.zeros(n, np.int8); sc = np.zeros(-(-n // 512), np.float32)
old.mirror_store(anchor, goal, codes, sc, n, 512)
res = {"old": [], "new": []}
for r in range(40):
    for name, m in (("old", old), ("new", new)):
        c, s = codes.copy(), sc.copy()
        t = time.perf_counter(); m.mirror_condense(c, s, anchor, goal, goal - 1e-3, n, 512, 128, 16, 2); res[name].append(time.perf_counter() - t)
for k, v in res.items():
    v.sort(); print(k, f"min {v[0]*1e3:.2f} p25 {v[10]*1e3:.2f} median {v[20]*1e3:.2f} ms")
