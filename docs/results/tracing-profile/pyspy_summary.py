"""Summarise py-spy's raw (collapsed) stacks of a traced and an untraced learner:

    python pyspy_summary.py /tmp/prof_off.txt /tmp/prof_on.txt > pyspy_summary.txt

samples per thread, samples with an OpenTelemetry or diloco telemetry frame, and where the
main thread's samples went (by the innermost frame of this project's code)."""
import collections
import sys

for path in sys.argv[1:]:
    total = otel = 0
    threads, main = collections.Counter(), collections.Counter()
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        n, frames = int(n), stack.split(";")
        total += n
        threads[frames[0].split(":")[-1].strip()[:30]] += n
        if "opentelemetry" in stack or "telemetry.py" in stack:
            otel += n
        if "MainThread" in frames[0]:
            ours = [f for f in frames if any(k in f for k in ("learner/", "diloco/", "tools/bench"))]
            main[(ours[-1] if ours else frames[min(len(frames) - 1, 3)])[:90]] += n
    print(f"{path}: {total} samples, {otel} with a telemetry frame ({otel / total:.2%})")
    for name, n in threads.most_common(8):
        print(f"  thread {name}: {n}")
    print("  main thread, top frames of this project:")
    for frame, n in main.most_common(8):
        print(f"    {n:6d} {frame}")
