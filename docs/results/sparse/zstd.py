"""Bits per value of each codec's payload before and after zstd framing, N(0, 1) data.
Run: python docs/results/sparse/zstd.py > docs/results/sparse/zstd.txt"""
import numpy as np

from diloco.codec import encode, frame

x = np.random.default_rng(0).standard_normal(1 << 22).astype(np.float32)
for label, kw in (("int4", {"encoding": "int4"}), ("sparse 1/8", {"encoding": "sparse", "kept": 16}),
                  ("sparse 1/16", {"encoding": "sparse", "kept": 8}), ("dense 2-bit", {"encoding": "sparse", "kept": 128})):
    payload = encode("w", x, **kw).payload
    framed = sum(map(len, frame([payload])))
    print(f"{label:12s} {8 * len(payload) / x.size:.3f} bits/value, {8 * framed / x.size:.3f} after zstd framing")
