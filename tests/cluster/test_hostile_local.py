"""One hostile learner in a real `diloco local` run (the short version of
docs/results/influence/): it joins with the run's own join token and TLS credential and
pushes, every time a push is due, a delta along the model's own values at 95 % of what a
shard accepts, claiming 10**10 tokens per step. The same run without it, side by side:
the model still trains, the shards clipped every one of its merged pushes, its tokens are
credited as at most a few learners' worth, and the rounds replay bit for bit from the
tapes (the clips are recorded)."""

import json
import subprocess
import sys

import pytest

from diloco.lab.bench.hostile import CLAIMED_TOKENS_PER_STEP, one_run

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(480)]

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8",
        "--batch-size", "8"]
STEPS = 80


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    return {attack: one_run(out, 0, attack, 3, STEPS, 0.1, TINY) | {"dir": out / f"{attack}-seed0"}
            for attack in ("none", "grow")}


def test_a_learner_pushing_the_largest_accepted_delta_every_time_does_not_ruin_the_run(runs):
    honest, attacked = runs["none"], runs["grow"]
    assert honest["exit"] == 0 and attacked["exit"] == 0
    assert attacked["attacker"][0].endswith("joined: attack grow"), attacked["attacker"]
    assert attacked["attacker_pushes_merged"] >= 10
    assert attacked["attacker_factor_median"] < 0.2  # its deltas are cut to the honest ones' scale and direction
    start = json.loads((honest["dir"] / "summary.json").read_text())["eval_loss_start"]
    assert honest["eval_final"] < start - 1.5
    # Without the bounds this run ends far above its start (the model's norm grows ~10x per merged push).
    assert attacked["eval_final"] < honest["eval_final"] * 1.10


def test_its_claimed_tokens_count_as_a_few_learners_worth(runs):
    honest = json.loads((runs["none"]["dir"] / "summary.json").read_text())["tokens"]
    attacked = json.loads((runs["grow"]["dir"] / "summary.json").read_text())["tokens"]
    assert STEPS * CLAIMED_TOKENS_PER_STEP > 1000 * honest  # what it claimed
    # The three honest learners' tokens plus at most 3x one's rate over as long as they trained.
    assert attacked < 2.3 * honest


def test_the_attacked_run_replays_bit_for_bit(runs):
    proc = subprocess.run([sys.executable, "-m", "diloco", "replay", str(runs["grow"]["dir"]), "--json", "--check"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["max_abs_diff"] == 0.0 and sum(s["rounds"] for s in result["shards"]) > 0
