"""Hostile learners in a real `diloco local` run: the short version of
docs/results/influence/ and docs/results/trust/ (tiny model, one seed). Each attack of
the harness (``diloco.lab.bench.hostile``) joins one learner with the run's own join
credential and TLS credential beside 3 honest ones for 150 steps: the model still trains
as far as without it (with 2 honest ones, as docs/results/trust/ measures at 600 steps, a
run this short is mostly its first seconds, where a zero peer's floor cuts the honest
learners' large early deltas). Three learners of one credential pushing their negated
outer gradient against 2 honest ones for 1500 steps are scored out by the validator. The attacked runs replay bit for
bit from the tapes (clips, gates and trust are recorded)."""

import json
import subprocess
import sys

import pytest

from diloco.lab.bench.hostile import CLAIMED_TOKENS_PER_STEP, one_run
from diloco.tape import read_tape

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "32", "--fragments", "4", "--sync-every", "8",
        "--batch-size", "8"]
STEPS = 150
SYBIL_STEPS = 1500
"""The tiny model trains 400 steps in ~10 s, about the time the attackers take to join."""
ATTACKS = ("grow", "random", "zero", "tiny", "negate")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile")
    runs = {attack: one_run(out, 0, attack, 3, STEPS, 0.1, TINY) | {"dir": out / f"{attack}-seed0"}
            for attack in ("none", *ATTACKS)}
    sybil = tmp_path_factory.mktemp("sybil")
    for attack in ("none", "negate"):
        runs[f"sybil-{attack}"] = one_run(sybil, 0, attack, 2, SYBIL_STEPS, 0.1, [*TINY, "--validator"], attackers=3) \
            | {"dir": sybil / f"{attack}-seed0"}
    return runs


def _start(run) -> float:
    return json.loads((run["dir"] / "summary.json").read_text())["eval_loss_start"]


@pytest.mark.parametrize("attack", ATTACKS)
def test_one_hostile_learner_of_four_does_not_ruin_the_run(runs, attack):
    honest, attacked = runs["none"], runs[attack]
    assert honest["exit"] == 0 and attacked["exit"] == 0
    assert attacked["attacker"][0].endswith(f"joined: attack {attack}"), attacked["attacker"]
    assert attacked["attacker_pushes_merged"] >= 5
    assert honest["eval_final"] < _start(honest) - 1.5
    # Without the bounds, grow ends far above its start (the model's norm grows ~10x per merged push).
    # negate costs this short run about 6 % with the bounds (16 pairs: 1.005 to 1.115 x the
    # honest run; its first pushes, alone before the honest learners join, pass whole):
    # docs/results/trust/ci-bound/.
    assert attacked["eval_final"] < honest["eval_final"] * (1.20 if attack == "negate" else 1.10)


def test_the_largest_pushes_are_cut_to_the_honest_scale_and_direction(runs):
    for attack in ("grow", "random"):
        assert runs[attack]["attacker_factor_median"] < 0.2, attack


def test_its_claimed_tokens_count_for_nothing(runs):
    honest = json.loads((runs["none"]["dir"] / "summary.json").read_text())["tokens"]
    attacked = json.loads((runs["grow"]["dir"] / "summary.json").read_text())["tokens"]
    assert STEPS * CLAIMED_TOKENS_PER_STEP > 1000 * honest  # what it claimed
    assert attacked < 1.2 * honest  # the honest learners' tokens, give or take their timing


def test_the_validator_scores_three_sybils_out(runs):
    honest, attacked = runs["sybil-none"], runs["sybil-negate"]
    assert honest["exit"] == 0 and attacked["exit"] == 0
    assert len([line for line in attacked["attacker"] if "joined: attack negate" in line]) == 3
    tapes = [list(read_tape(tape)) for tape in sorted(attacked["dir"].glob("shard*/tape-*.jsonl"))]
    attackers = {r["learner"] for tape in tapes for r in tape if r["kind"] == "trust"} - {
        p.name.removesuffix(".json") for p in (attacked["dir"] / "learners").glob("*.json")}
    assert len(attackers) == 3
    # On probation from the run's first push: every push of theirs merged before the validator
    # had judged one of their pushes of that fragment counted for nothing (run with the
    # attackers first, trusted until the first judgement, they once ruined it: 6.1 bits/byte,
    # docs/results/trust/judge-order/).
    unjudged = []
    for tape in tapes:
        judged = set()
        for r in tape:
            if r["kind"] == "trust":
                judged.add((r["learner"], r["fragment"]))
            elif r["kind"] == "round":
                trust = r.get("trust") or [1.0] * len(r["participants"])
                unjudged += [t for learner, t in zip(r["participants"], trust)
                             if learner in attackers and (learner, r["fragment"]) not in judged]
    assert unjudged and set(unjudged) == {0.0}, unjudged
    # Their pushes merged at a median factor of nothing (norm clip x direction gate x trust):
    # probation first, then the validator's judgement of their pushes (a short run's few
    # judgements, of pushes from a cold optimizer, some near a cosine of 0:
    # docs/results/trust/judge-order/).
    assert attacked["attacker_factor_median"] < 0.1
    # At 600 steps of the default model the attacked runs end at -1.3 % (docs/results/trust/);
    # this short run on a loaded CI machine is noisier (4.01 against 3.21 once). With the
    # bounds alone the same attack ends at 32 to 1,466 bits/byte.
    assert attacked["eval_final"] < honest["eval_final"] * 1.5


@pytest.mark.parametrize("run", ["grow", "sybil-negate"])
def test_the_attacked_run_replays_bit_for_bit(runs, run):
    proc = subprocess.run([sys.executable, "-m", "diloco", "replay", str(runs[run]["dir"]), "--json", "--check"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout)
    assert result["max_abs_diff"] == 0.0 and sum(s["rounds"] for s in result["shards"]) > 0
