"""adamw-pooled: AdamW exactly at one learner, the mean of M learners' second moment
from the batch's two halves, and the runner's half-batch step."""

import collections

import pytest
import torch

from diloco.errors import InvalidArgument
from diloco.learner.config import LearnerConfig
from diloco.learner.core.pooled import PooledAdamW
from diloco.learner.runner import inner_optimizer, inner_step, split_batch
from diloco.task import Task, TaskError


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    a = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    b = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    b.load_state_dict(a.state_dict())
    return a, b


@pytest.mark.parametrize("with_noise", [False, True])
def test_one_learner_is_adamw(with_noise):
    """At M = 1 nothing is pooled: the steps are torch's AdamW's, whatever the noise says."""
    ref, model = _pair()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    pooled = PooledAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, learners=1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        x = torch.randn(8, 6, generator=gen)
        for net, opt in ((ref, torch_opt), (model, pooled)):
            opt.zero_grad()
            net(x).square().mean().backward()
        if with_noise:
            pooled.observe_noise({p: p.grad.square() * 3 for p in model.parameters()})
        torch_opt.step()
        pooled.step()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)


def test_denominator_is_the_mean_gradients_second_moment():
    """Gradients s + noise of variance σ² per coordinate, the halves' noise samples drawn as
    the runner takes them: the pooled denominator converges to s² + σ²/M (what DP's AdamW
    on M learners' mean gradient divides by), not to the learner's own s² + σ²."""
    M, sigma = 4, 0.5
    signal = torch.tensor([0.0, 0.1, 0.3, 1.0])
    p = torch.nn.Parameter(torch.zeros(4))
    opt = PooledAdamW([p], lr=0.0, weight_decay=0.0, learners=M)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20000):
        g_a = signal + sigma * (2 ** 0.5) * torch.randn(4, generator=gen)  # each half: twice the variance
        g_b = signal + sigma * (2 ** 0.5) * torch.randn(4, generator=gen)
        p.grad = (g_a + g_b) / 2
        opt.observe_noise({p: (g_a - g_b).square() / 4})
        opt.step()
    state = opt.state[p]
    t = float(state["step"])
    v = state["exp_avg_sq"] / (1 - 0.999 ** t)
    n = state["noise_sq"] / (1 - 0.999 ** t)
    pooled = torch.maximum(v - (1 - 1 / M) * n, v / M)
    torch.testing.assert_close(n, torch.full((4,), sigma ** 2), rtol=0.15, atol=0.0)
    torch.testing.assert_close(pooled, signal ** 2 + sigma ** 2 / M, rtol=0.2, atol=0.01)
    assert (v > pooled * 1.5)[:2].all()  # where noise dominates, the learner's own is far larger


def test_floor_is_what_averaging_can_remove():
    """A noise estimate larger than the second moment itself is held at v/M."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = PooledAdamW([p], lr=1.0, weight_decay=0.0, learners=4)
    p.grad = torch.tensor([1.0, -1.0])
    opt.observe_noise({p: torch.tensor([100.0, 100.0])})
    opt.step()
    # step 1: m̂ = g, v̂ = g², pooled = v̂/4: the step is lr·g/(|g|/2) = ±2
    torch.testing.assert_close(p.detach(), torch.tensor([-2.0, 2.0]), rtol=1e-6, atol=1e-6)


def test_refuses_no_learners_and_a_closure():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="learners must be >= 1"):
        PooledAdamW([p], lr=1.0, weight_decay=0.0, learners=0)
    with pytest.raises(ValueError, match="no closure"):
        PooledAdamW([p], lr=1.0, weight_decay=0.0, learners=2).step(lambda: 0.0)


def _task(model):
    def loss(net, batch):
        x, y = batch
        return (net(x) - y).square().mean()

    return Task(model=model, batches=(), loss=loss, tokens=lambda batch: batch[0].shape[0])


def test_inner_step_takes_the_whole_batch_gradient_from_its_halves():
    """The runner's half-batch step: the same gradient as one backward pass of the whole
    batch (clipping included), so at M = 1 the step is AdamW's on the full batch; the noise
    sample is (g_a − g_b)²/4, scaled by the clip's factor squared."""
    ref, model = _pair()
    cfg = LearnerConfig(lr=1e-2, warmup_steps=0, steps=10, inner_optimizer="adamw")
    ref_opt, ref_sched = inner_optimizer(_task(ref), cfg)
    opt, sched = inner_optimizer(_task(model), LearnerConfig(lr=1e-2, warmup_steps=0, steps=10,
                                                             inner_optimizer="adamw-pooled"), 1)
    assert isinstance(opt, PooledAdamW) and type(ref_opt) is torch.optim.AdamW
    seen = []
    original = opt.observe_noise
    opt.observe_noise = lambda samples: (seen.append({k: v.clone() for k, v in samples.items()}), original(samples))
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        batch = (torch.randn(10, 6, generator=gen), torch.randn(10, 3, generator=gen))
        loss_ref = inner_step("t", _task(ref), batch, ref_opt, ref_sched, 0.05)
        loss = inner_step("t", _task(model), batch, opt, sched, 0.05)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-7)
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)
    assert len(seen) == 5 and all(s.min() >= 0 for s in seen[-1].values())


@pytest.mark.parametrize("clip", [0.0, 0.01])
def test_noise_sample_by_hand(clip):
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    model.zero_grad()
    (model(x) - y).square().mean().backward()
    norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    scale = min(1.0, clip / float(norm)) ** 2 if clip else 1.0
    assert scale < 0.5 or not clip  # the clip binds
    halves = []
    for half in (slice(0, 3), slice(3, 6)):
        model.zero_grad()
        (model(x[half]) - y[half]).square().mean().backward()
        halves.append([p.grad.clone() for p in model.parameters()])
    want = [(a - b).square() / 4 * scale for a, b in zip(*halves)]
    opt = PooledAdamW(model.parameters(), lr=0.0, weight_decay=0.0, learners=2)
    got = {}
    opt.observe_noise = got.update
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    inner_step("t", _task(model), (x, y), opt, sched, clip)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(got[p], w, rtol=1e-4, atol=1e-9)


def test_split_batch():
    x, y = torch.arange(8).view(4, 2), torch.arange(4)
    first, second = split_batch("t", {"x": x, "y": (y, "keep"), "n": torch.tensor(3)})
    assert first["x"].tolist() == [[0, 1], [2, 3]] and second["y"][0].tolist() == [2, 3]
    assert first["y"][1] == "keep" and int(second["n"]) == 3
    Pair = collections.namedtuple("Pair", "x y")
    first, second = split_batch("t", Pair(x, y))
    assert isinstance(first, Pair) and first.x.tolist() == [[0, 1], [2, 3]] and second.y.tolist() == [2, 3]
    with pytest.raises(TaskError, match=r"first dimensions \[1\].*--inner-optimizer adamw"):
        split_batch("t", (torch.zeros(1, 3),))
    with pytest.raises(TaskError, match=r"first dimensions \[3, 4\]"):
        split_batch("t", (torch.zeros(4), torch.zeros(3)))
    with pytest.raises(TaskError, match="first dimensions none"):
        split_batch("t", "text")


def test_config_refuses_an_unknown_optimizer():
    with pytest.raises(InvalidArgument, match="inner optimizer must be one of"):
        LearnerConfig(inner_optimizer="sgd")
