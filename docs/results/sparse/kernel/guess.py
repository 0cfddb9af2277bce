"""How good the sparse encoder's first guess is: blocks of 128 |x| (N(0, 1) and t(3)),
k = 16, the guess 0.9 x the previous block's threshold / mean |x|, then 0.8 x that, then 0
(all keys), as the C kernel does. Prints the median number of candidates, the share of
blocks needing 1, 2 or 3 passes, and the share with more than 64 candidates (the
quickselect fallback). python docs/results/sparse/kernel/guess.py  # guess.txt"""
import numpy as np
rng = np.random.default_rng(0)
for name, x in (("gauss", np.abs(rng.standard_normal((20000, 128)))), ("t3", np.abs(rng.standard_t(3, (20000, 128))))):
  x = x.astype(np.float32); k = 16; ratio = 1.5; ms = []; tries = []
  for b in x:
    a = b.mean(); g = a * ratio * 0.9; t = 0
    while (b >= g).sum() < k:
        t += 1; g = g * 0.8 if t == 1 else 0
    ms.append((b >= g).sum()); tries.append(t); ratio = np.sort(b)[-k] / a
  ms = np.array(ms); print(name, np.median(ms), np.bincount(tries, minlength=3) / len(x), (ms > 64).mean())
