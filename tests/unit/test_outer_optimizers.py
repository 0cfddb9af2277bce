"""The outer optimizers for asynchronous rounds (diloco.syncer.core.outer.momentum_step):
delayed Nesterov is, period by period, torch's Nesterov SGD on each period's summed
deltas, with the plain part applied as each round arrives."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.errors import InvalidArgument
from diloco.syncer.config import MergeConfig
from diloco.syncer.core.outer import MomentumStep, momentum_step, nesterov_


def test_nesterov_is_the_same_step_every_round():
    assert momentum_step("nesterov", 0.9, 0.0, 0.25) == MomentumStep(0.9, 0.9, 0.0)
    assert momentum_step("nesterov", 0.9, 0.5, 0.25) == MomentumStep(0.9, 0.9, 0.0)


def test_delayed_nesterov_applies_the_momentum_once_per_share_of_every_learner():
    share, steps = 0.0, []
    for _ in range(8):  # two periods of 4 single-push rounds (K = 1, 4 live learners)
        step = momentum_step("delayed-nesterov", 0.9, share, 0.25)
        steps.append(step)
        share = step.share
    assert [s.decay for s in steps] == [0.9, 1.0, 1.0, 1.0] * 2
    assert [s.look for s in steps] == [0.0, 0.0, 0.0, 0.9] * 2
    assert [s.share for s in steps] == [0.25, 0.5, 0.75, 0.0] * 2
    # A round of every live learner (K = M) is a period of its own: Nesterov each round.
    assert momentum_step("delayed-nesterov", 0.9, 0.0, 1.0) == MomentumStep(0.9, 0.9, 0.0)
    # Thirds sum to 1 up to rounding: three rounds close the period.
    share = 0.0
    for _ in range(3):
        step = momentum_step("delayed-nesterov", 0.5, share, 1 / 3)
        share = step.share
    assert step.look == 0.5 and share == 0.0


@settings(max_examples=60, deadline=None)
@given(
    mu=st.floats(0.05, 0.95),  # torch takes Nesterov only with momentum > 0
    lr=st.floats(0.1, 2.0),
    learners=st.integers(1, 6),
    periods=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_delayed_nesterov_over_a_period_is_torch_nesterov_on_the_period_sum(mu, lr, learners, periods, seed):
    """What the shard applies round by round (each a learner's delta at 1/M of the outer
    lr, as ``scale_by = live`` has it) adds up, period by period, to
    torch.optim.SGD(nesterov=True) stepping once on the period's summed share-weighted
    deltas: the momentum sees one averaged delta per period, never a single stale push."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(32, generator=g)
    reference = torch.nn.Parameter(theta.clone())
    opt = torch.optim.SGD([reference], lr=lr, momentum=mu, nesterov=True)
    ours, buf, share = theta.clone(), torch.zeros(32), 0.0
    c = 1.0 / learners
    for _ in range(periods):
        deltas = [torch.randn(32, generator=g) * 0.01 for _ in range(learners)]
        for delta in deltas:
            step = momentum_step("delayed-nesterov", mu, share, c)
            share = step.share
            ours -= nesterov_(buf, delta.clone() * c, lr, step.decay, step.look)
        reference.grad = sum(d * c for d in deltas)
        opt.step()
        torch.testing.assert_close(ours, reference.detach(), rtol=0, atol=1e-5)


def test_an_outer_setting_outside_its_range_is_refused_naming_the_flag():
    with pytest.raises(InvalidArgument, match="--outer-optimizer must be one of nesterov, delayed-nesterov, got 'adam'"):
        MergeConfig(outer_optimizer="adam")
    with pytest.raises(InvalidArgument, match=r"--outer-momentum must be in \[0, 1\)"):
        MergeConfig(outer_momentum=1.0)
    with pytest.raises(InvalidArgument, match="--outer-lr must be > 0, got 0"):
        MergeConfig(outer_lr=0.0)


def test_diloco_local_refuses_a_momentum_of_one_in_one_line_before_anything_starts(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "diloco", "local", "--outer-optimizer", "delayed-nesterov",
                           "--outer-momentum", "1.0", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("diloco: error: --outer-momentum must be in [0, 1)"), proc.stderr
    assert not out.exists()



def _rounds(shard, learners, rounds, fid=0, start=0.0):
    """``rounds`` single-push rounds of fragment ``fid``, the learners in turn, each applying
    its reply; returns each round's MomentumStep."""
    from tests.unit.test_syncer_shard import close

    steps = []
    for r in range(rounds):
        learner = learners[r % len(learners)]
        learner.push(fid, now=start + r)
        steps.append(close(shard, fid, start + r + 0.5).outer)
        learner.apply(shard.update_for(fid, learner.version[fid]))
    return steps


def test_a_shard_steps_the_momentum_once_per_period_and_a_restored_one_continues_the_period():
    """Three live learners, K = 1: the momentum step every third round. A shard restored
    from a snapshot taken mid-period continues the period as the shard that never stopped
    does (one restarted at the restore would decay the buffer at its next round instead),
    bit for bit."""
    from diloco.syncer.core.snapshot import capture, restore
    from tests.checks import assert_same_tensors
    from tests.unit.test_syncer_shard import Learner, make_shard

    merge = dict(outer_optimizer="delayed-nesterov", outer_lr=0.7, outer_momentum=0.9)
    (straight, initial), (stopped, _), (restored, _) = (make_shard(**merge) for _ in range(3))
    ours = [Learner(f"L{i}", straight, initial, seed=i) for i in range(3)]
    theirs = [Learner(f"L{i}", stopped, initial, seed=i) for i in range(3)]
    steps = _rounds(straight, ours, 2)
    assert _rounds(stopped, theirs, 2) == steps
    assert [(s.decay, s.look) for s in steps] == [(0.9, 0.0), (1.0, 0.0)]
    restore(restored, capture(stopped, snapshot_id=1, now=1.5), now=1.5)
    assert restored.fragments[0].outer_share == straight.fragments[0].outer_share == pytest.approx(2 / 3)
    for learner in theirs:
        learner.shard = restored
    later = _rounds(straight, ours[2:] + ours[:2], 4, start=2)
    assert _rounds(restored, theirs[2:] + theirs[:2], 4, start=2) == later
    assert [(s.decay, s.look) for s in later] == [(1.0, 0.9), (0.9, 0.0), (1.0, 0.0), (1.0, 0.9)]
    for name in ("params", "momentum", "residual"):
        assert_same_tensors(getattr(restored.fragments[0], name), getattr(straight.fragments[0], name), name)
