"""The sparse codec's C kernels of two commits side by side, in one process: each built
from that commit's diloco/codec/_int4.c (the build's own flags: -O3 -ffp-contract=off,
AVX2 clones), timed in turns against one memcpy (best of REPEATS each), and their bytes
and decoded values checked equal.

    python docs/results/sparse/kernel/compare.py OLD_COMMIT [NEW_COMMIT|worktree]

64 MiB of N(0, 1) float32, blocks of 128, float16 scales, 2 threads for encoding (as
`diloco bench codec`); decoding and condensing (a learner's push from its goal and
anchor, the anchor advanced) are one thread, as the kernel runs them."""
import importlib.machinery
import importlib.util
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[4]
REPEATS = 9
N = 16 << 20


def build(commit: str, out: Path):
    source = (ROOT / "diloco/codec/_int4.c").read_text() if commit == "worktree" else subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:diloco/codec/_int4.c"], check=True, capture_output=True,
        text=True).stdout
    c_file = out / f"int4_{commit}.c"
    c_file.write_text(source)
    built = out / f"_int4_{commit}.so"
    subprocess.run(["gcc", "-O3", "-ffp-contract=off", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}",
                    str(c_file), "-o", str(built)], check=True)
    loader = importlib.machinery.ExtensionFileLoader("_int4", str(built))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("_int4", loader))
    loader.exec_module(module)
    return module


def best(fn, setup=lambda: None) -> float:
    times = []
    for _ in range(REPEATS):
        arg = setup()
        t = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    old_commit = sys.argv[1]
    new_commit = sys.argv[2] if len(sys.argv) > 2 else "worktree"
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {old_commit: build(old_commit, Path(tmp)), new_commit: build(new_commit, Path(tmp))}
        x = np.random.default_rng(0).standard_normal(N, dtype=np.float32)
        copy = np.empty_like(x)
        anchor = x - np.random.default_rng(1).standard_normal(N, dtype=np.float32) * np.float32(0.01)
        out = np.empty_like(x)
        print(f"{N * 4 >> 20} MiB N(0, 1) float32, blocks of 128, float16 scales, best of {REPEATS}")
        rows = {}
        for label, kept in (("sparse 1/8", 16), ("dense 2-bit", 128)):
            payloads = {name: k.sparse_quantize(x, N, 128, kept, 2, 2) for name, k in kernels.items()}
            same = len({p for p in payloads.values()}) == 1
            decoded = []
            for name, k in kernels.items():
                status, _, payload = payloads[name]
                assert status == 0
                k.sparse_apply(payload, N, 128, kept, 2, out, 1.0, 0)
                decoded.append(out.view(np.uint32).copy())
            condensed = [k.sparse_condense(x, a, N, 128, kept, 2) + (a.view(np.uint32),)
                         for k, a in ((k, anchor.copy()) for k in kernels.values())]
            same_condensed = (condensed[0][2] == condensed[1][2] and condensed[0][3] == condensed[1][3]
                              and np.array_equal(condensed[0][4], condensed[1][4]))
            print(f"{label}: payloads identical: {same}; decoded values identical: {np.array_equal(*decoded)}; "
                  f"condensed payloads, left norms and anchors identical: {same_condensed}")
            for turn in range(3):  # in turns, so that both see the same machine
                memcpy_s = best(lambda _: np.copyto(copy, x))
                for name, k in kernels.items():
                    payload = payloads[name][2]
                    q = best(lambda _: k.sparse_quantize(x, N, 128, kept, 2, 2))
                    d = best(lambda _: k.sparse_apply(payload, N, 128, kept, 2, out, 1.0, 0))
                    c = best(lambda a: k.sparse_condense(x, a, N, 128, kept, 2), lambda: anchor.copy())
                    rows.setdefault((label, name), []).append((memcpy_s / q, memcpy_s / d, memcpy_s / c,
                                                               N * 4 / memcpy_s / 1e9))
        print("ratios to the memcpy of the same turn, 3 turns each")
        print(f"{'codec':<12} {'kernel':<10} {'quantize':<20} {'dequantize':<20} {'condense (1 thread)':<20} memcpy GB/s")
        for (label, name), turns in rows.items():
            cells = [" ".join(f"{t[i]:.3f}" for t in turns) for i in range(3)]
            m = " ".join(f"{t[3]:.1f}" for t in turns)
            print(f"{label:<12} {name:<10} {cells[0]:<20} {cells[1]:<20} {cells[2]:<20} {m}")


if __name__ == "__main__":
    main()
