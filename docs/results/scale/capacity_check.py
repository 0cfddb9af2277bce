"""The capacity model's fit and its check (docs/results/scale/README.md): the costs fitted to
the sweeps, then each held-out configuration measured against what the model predicts.
Run from the repository root: python docs/results/scale/capacity_check.py"""

import json
from dataclasses import asdict
from pathlib import Path

from tools.simulate import capacity

HERE = Path(__file__).resolve().parent
FITTED = ("learners.jsonl", "params.jsonl", "params-64Mi.jsonl", "memory.jsonl")
HELD_OUT = ("shards.jsonl", "soak.jsonl")


def rows(*names: str) -> list[dict]:
    return [json.loads(line) for name in names for line in (HERE / name).read_text().splitlines() if line.strip()]


def main() -> None:
    costs = capacity.fit(capacity.fit_rows(rows(*FITTED)))
    print(f"fitted to {', '.join(FITTED)}:")
    for name, value in asdict(costs).items():
        print(f"  {name} = {value:.6g}")
    print(f"\nheld out ({', '.join(HELD_OUT)}): measured / predicted")
    for row in capacity.fit_rows(rows(*HELD_OUT)):
        predicted = capacity.predict(costs, row["params"] / row["shards"], row["learners"])
        cpu, rss = row["cpu_s_per_push"], row["rss_bytes"] / row["shards"]
        print(f"  {row['learners']:>3} learners, {row['params'] / 2**20:g} Mi params, {row['shards']} shard(s): "
              f"CPU per push {cpu * 1e3:.1f} / {predicted['cpu_s_per_push'] * 1e3:.1f} ms "
              f"({cpu / predicted['cpu_s_per_push']:.2f}), peak RSS per shard {rss / 1e6:.0f} / "
              f"{predicted['rss_bytes'] / 1e6:.0f} MB ({rss / predicted['rss_bytes']:.2f})")


if __name__ == "__main__":
    main()
