"""What status.json's curves cost at the coordinator's bounds (256 learners' curves of 512
points each): the size of what a refresh sends and the time to build it on the event loop
(``LossCurves.to_json``) and in all (with ``json.dumps``, on the page's thread), against
sending every kept point. Usage: python docs/results/status-page/payload.py > payload.txt"""

import json
import time

from coordinator.core.progress import MAX_CURVES, MAX_POINTS, LossCurves

curves = LossCurves()
for i in range(MAX_CURVES):
    for j in range(MAX_POINTS):
        curves.add(f"L{i}", float(j), 1000 * j + 7 * i, 3.0 + 1.0 / (j + 1) + i * 1e-6)
everything = lambda: {i: [[p.tokens, p.loss] for p in c] for i, c in curves.curves.items()}  # noqa: E731
for name, build in (("sent (to_json)", curves.to_json), ("every kept point", everything)) * 3:
    started = time.perf_counter()
    document = build()
    built = time.perf_counter()
    text = json.dumps(document)
    done = time.perf_counter()
    print(f"{name}: {len(document)} curves, {sum(map(len, document.values()))} points, {len(text) / 1e6:.2f} MB, "
          f"{(built - started) * 1e3:.1f} ms to build, {(done - started) * 1e3:.1f} ms in all")
