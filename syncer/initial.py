"""A shard's starting point, without loading torch into the shard process.

The fragment plan comes from the model's (name, shape) list and the shard starts its
fragments from the learners' seeded initialisation; both need torch. A shard process
never loads torch (it would cost about 220 MB of its memory and two seconds of its
start), so a short-lived helper, ``python -m syncer.initial``, builds them exactly as a
learner does and hands them over in one ``.npz`` file (``syncer.snapshot`` format). A
process that has torch loaded already (tests, benchmarks, ``diloco replay``) builds them
in-process.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from diloco.config import RunConfig
from diloco.errors import FailedPrecondition
from diloco.fragments import FragmentPlan, plan_fragments
from syncer import snapshot

_HELPER_TIMEOUT_S = 600.0


def initial_fragments(run: RunConfig, shard_id: int, num_shards: int) -> tuple[FragmentPlan, dict[int, list[np.ndarray]]]:
    """The run's fragment plan and, for each fragment the shard owns, its pieces' initial
    values (float32)."""
    if "torch" in sys.modules:
        tree = _build(run, shard_id, num_shards)
    else:
        tree = _build_in_helper(run, shard_id, num_shards)
    plan = plan_fragments([(name, tuple(shape)) for name, shape in tree["shapes"]], run.fragments)
    return plan, {int(f["id"]): list(f["pieces"]) for f in tree["fragments"]}


def _build(run: RunConfig, shard_id: int, num_shards: int) -> dict:
    plan = run.plan()
    state = run.initial_state()
    fragments = [
        {"id": f.id, "pieces": [np.array(t.detach().numpy(), dtype=np.float32) for t in plan.gather(f.id, state)]}
        for f in plan.owned_by(shard_id, num_shards)
    ]
    return {"shapes": [[name, list(shape)] for name, shape in run.named_shapes()], "fragments": fragments}


def _build_in_helper(run: RunConfig, shard_id: int, num_shards: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="diloco-initial-") as tmp:
        out = Path(tmp) / "initial.npz"
        try:
            done = subprocess.run(
                [sys.executable, "-m", "syncer.initial", str(out), str(shard_id), str(num_shards)],
                input=run.to_json(), capture_output=True, text=True, timeout=_HELPER_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise FailedPrecondition(f"building the initial fragments took over {_HELPER_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            detail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
            raise FailedPrecondition(f"cannot build the initial fragments: {detail}")
        return snapshot.loads(out)


def main(argv: list[str]) -> int:
    out, shard_id, num_shards = Path(argv[0]), int(argv[1]), int(argv[2])
    run = RunConfig.from_json(sys.stdin.read())
    out.write_bytes(snapshot.dumps(_build(run, shard_id, num_shards)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
