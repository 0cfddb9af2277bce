"""Which of the attacker's pushes a run merged, read from its shards' tapes: one line per
run directory (``diloco local --out``) with its final eval and, for each push of ``L0``
merged at a factor above 0, ``f<fragment>v<version>``, ``<`` or ``>`` (before or after the
fragment's first honest push), the round's participation and the factor (clip x gate).

    python merged.py RUN_DIR [RUN_DIR ...]
"""

import json
import sys
from pathlib import Path

from diloco.tape import read_tape

ATTACKER = "L0"


def merged(run_dir: Path) -> list[str]:
    out = []
    for tape in sorted(run_dir.glob("shard*/tape-*.jsonl")):
        rounds = [r for r in read_tape(tape) if r["kind"] == "round"]
        first_honest: dict[int, int] = {}
        for r in rounds:
            if any(learner != ATTACKER for learner in r["participants"]):
                first_honest.setdefault(r["fragment"], r["version"])
        for r in rounds:
            n = len(r["participants"])
            for learner, clip, gate in zip(r["participants"], r.get("clip") or [1.0] * n, r.get("gate") or [1.0] * n):
                if learner == ATTACKER and clip * gate > 0:
                    side = "<" if r["version"] < first_honest.get(r["fragment"], float("inf")) else ">"
                    out.append(f"f{r['fragment']}v{r['version']}{side}p{r['participation']:.2f}x{clip * gate:.2f}")
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        run_dir = Path(arg)
        final = json.loads((run_dir / "summary.json").read_text()).get("eval_loss_final")
        pushes = merged(run_dir)
        print(f"{run_dir}  eval {final:.4f}  merged {len(pushes)}: {' '.join(pushes)}")
