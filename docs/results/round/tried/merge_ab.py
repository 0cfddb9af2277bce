import sys, time, statistics
sys.path.insert(0, ".")
exec(open("docs/results/round/tried/merge_setup.py").read().split("src = np.ones")[0])
src = np.ones(n, np.float32); dst = np.empty_like(src)
res = {"old": [], "new": [], "memcpy": []}
for r in range(60):
    for name, f in (("old", old), ("new", new), ("memcpy", lambda: np.copyto(dst, src))):
        t = time.perf_counter(); f(); res[name].append(time.perf_counter() - t)
for k, v in res.items():
    v.sort(); print(k, f"min {v[0]*1e3:.2f} p25 {v[15]*1e3:.2f} median {v[30]*1e3:.2f} ms")
