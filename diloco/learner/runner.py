"""The ``--task`` runner: a task's model, batches and loss trained by a plain loop on the
public ``Learner`` API (the same code path a user with their own loop takes). The loop
reads like its schedule: one batch, its loss, backward, optimizer step, ``learner.step``,
an evaluation now and then."""

from __future__ import annotations

import logging
import math
import threading
import time

import torch

from collections.abc import Callable

from diloco.config import RunConfig
from diloco.tape import TapeWriter
from diloco.task import Task, TaskContext, TaskError, build_task, checked_loss, checked_tokens, evaluate
from diloco.learner.api import Learner, learner_number
from diloco.learner.summary import Summary
from diloco.learner.config import LearnerConfig
from diloco.learner.core.pooled import PooledAdamW
from diloco.learner.core.schedule import inner_lr
from diloco.learner.device import Device
from diloco.learner.membership import Heartbeats, Membership
from diloco.learner.slice import SliceFollower, SliceLink

logger = logging.getLogger(__name__)


def inner_optimizer(task: Task, cfg: LearnerConfig, learners: int = 1
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The task's optimizer (default: ``cfg.inner_optimizer`` with the learner's lr and
    weight decay; ``adamw-pooled`` pools the noise of ``learners`` learners) under the
    learner's warmup + cosine schedule, as a factor of each group's own lr."""
    params = [p for p in task.model.parameters() if p.requires_grad]
    if task.optimizer is not None:
        optimizer = task.optimizer(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TaskError(f"the task's optimizer function returned {type(optimizer).__name__}, not a torch optimizer")
    elif cfg.inner_optimizer == "adamw-pooled":
        optimizer = PooledAdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, learners=max(learners, 1))
    else:
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: inner_lr(step, 1.0, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    )
    return optimizer, schedule


def inner_step(spec: str, task: Task, batch, optimizer: torch.optim.Optimizer, schedule, grad_clip: float, *,
               device: Device | None = None, set_to_none: bool = True,
               before_update: Callable[[torch.Tensor], None] = lambda loss: None) -> torch.Tensor:
    """One inner step, the same for a learner and the baselines it is compared with (they
    must train alike for the comparison to be fair): the task's loss on ``batch`` (placed
    on ``device``, default the CPU, and under its autocast), backward, ``before_update(loss)`` (a
    baseline's gradient all-reduce or simulated slowness), gradient clipping, the optimizer's step
    and the schedule's. Returns the loss. ``set_to_none`` False keeps the gradient
    tensors (a baseline whose gradients are views of one all-reduce buffer)."""
    device = device or Device("cpu")
    optimizer.zero_grad(set_to_none=set_to_none)
    params = [p for p in task.model.parameters() if p.requires_grad]
    if isinstance(optimizer, PooledAdamW):
        loss, noise = _halves_backward(spec, task, device.place_batch(batch), params, device)
    else:
        with device.autocast():
            loss = checked_loss(spec, task.loss(task.model, device.place_batch(batch)))
        loss.backward()
        noise = None
    before_update(loss)
    if grad_clip:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        if noise is not None:  # the noise of the gradient as clipped
            scale = torch.clamp(grad_clip / (norm + 1e-6), max=1.0) ** 2
            for sample in noise.values():
                sample.mul_(scale)
    if noise is not None:
        optimizer.observe_noise(noise)
    optimizer.step()
    schedule.step()
    device.step_done()
    return loss


def _halves_backward(spec: str, task: Task, batch, params: list[torch.nn.Parameter], device: Device
                     ) -> tuple[torch.Tensor, dict[torch.Tensor, torch.Tensor]]:
    """The batch's gradient as the mean of its two halves' (in ``.grad``), the loss, and
    each parameter's noise sample ``(g_a − g_b)²/4`` (``PooledAdamW``)."""
    first, second = split_batch(spec, batch)
    with device.autocast():
        loss_a = checked_loss(spec, task.loss(task.model, first))
    (loss_a / 2).backward()
    half_a = {p: p.grad.detach().clone() for p in params if p.grad is not None}
    with device.autocast():
        loss_b = checked_loss(spec, task.loss(task.model, second))
    (loss_b / 2).backward()
    # .grad = (g_a + g_b)/2 and half_a = g_a/2, so 2·half_a − .grad = (g_a − g_b)/2
    noise = {p: (2 * half_a[p] - p.grad).square_() for p in params if p in half_a}
    return (loss_a.detach() + loss_b.detach()) / 2, noise


def split_batch(spec: str, batch):
    """``batch`` cut in two along the first dimension of every tensor in it (any pytree of
    tensors, as ``Device.place_batch`` takes; anything else goes to both halves unchanged)."""
    rows = lambda t: isinstance(t, torch.Tensor) and t.dim() > 0  # noqa: E731
    sizes = {t.shape[0] for t in torch.utils._pytree.tree_leaves(batch) if rows(t)}
    if not sizes or min(sizes) < 2 or len(sizes) > 1:
        raise TaskError(f"task {spec!r}: inner optimizer adamw-pooled cuts each batch in two along its first "
                        f"dimension, and this task's batch has first dimensions {sorted(sizes) or 'none'} "
                        f"(it needs one size, at least 2); use --inner-optimizer adamw")
    n = sizes.pop() // 2
    return tuple(torch.utils._pytree.tree_map(lambda t: t[part] if rows(t) else t, batch)
                 for part in (slice(None, n), slice(n, None)))


class TrainLoss:
    """The training loss over windows of ``every`` inner steps: each window's mean, times
    the task's ``eval_scale`` (in its ``eval_unit``, as its evals: bits/byte for the byte
    GPT), is recorded (``train`` event, the summary's ``train_loss`` the heartbeat carries,
    the gauge) once its last step is done. Off XLA each step's loss is read at once (a
    non-finite one stops the learner there); on XLA, where a read is a host sync, the
    losses stay on the device until the window ends."""

    def __init__(self, spec: str, learner, every: int, task: Task) -> None:
        self.spec, self.learner, self.every = spec, learner, every
        self.scale, self.unit = task.eval_scale, task.eval_unit
        self.host = learner.device.kind != "xla"
        self.losses: list = []

    def add(self, loss: torch.Tensor, step: int) -> None:
        loss = loss.detach()
        if self.host:
            loss = float(loss)
            if not math.isfinite(loss):
                raise TaskError(f"task {self.spec!r}: the loss is {loss} at inner step {step}")
        self.losses.append(loss)

    def maybe_record(self, step: int) -> None:
        """After ``learner.step``: the window's mean, if ``step`` ends one."""
        if len(self.losses) < self.every:
            return
        mean = sum(self.losses) / len(self.losses) if self.host else float(torch.stack(self.losses).mean())
        self.losses = []
        if not math.isfinite(mean):
            raise TaskError(f"task {self.spec!r}: the mean loss of inner steps {step + 1 - self.every}..{step} is {mean}")
        # In the unit of the task's evals, to be read beside them.
        self.learner.report_loss(train=mean * self.scale, unit=self.unit, step=step + 1)


class TaskRunner:
    """Trains ``task`` for ``cfg.steps`` inner steps (or until the learner is asked to
    stop), syncing through ``learner``."""

    def __init__(self, spec: str, task: Task, learner: Learner, optimizer: torch.optim.Optimizer, schedule) -> None:
        self.spec, self.task, self.learner = spec, task, learner
        self.cfg = learner.cfg
        self.optimizer, self.schedule = optimizer, schedule
        self.summary: Summary = learner.summary
        self.summary.eval_unit = task.eval_unit
        self.summary.planned_steps = self.cfg.steps
        self.step = 0
        """The inner step the loop is at (0-based): where a failure happened."""

    def train(self) -> Summary:
        learner, cfg, task = self.learner, self.cfg, self.task
        if not (cfg.skip_start_eval or learner.joined_in_progress):  # else the first step comes at once
            self._evaluate(0)
        learner.begin_training()
        batches = iter(task.batches)
        window = TrainLoss(self.spec, learner, cfg.train_loss_every_steps, task)
        for step in range(cfg.steps):
            self.step = step
            if learner.should_stop:
                logger.info("%s: stopping at inner step %d", learner.learner_id, step)
                break
            started = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                raise TaskError(
                    f"task {self.spec!r}: its batches ended after {step} batches; this learner trains {cfg.steps} inner steps"
                ) from None
            loss = inner_step(self.spec, task, batch, self.optimizer, self.schedule, cfg.grad_clip, device=learner.device)
            window.add(loss, step)
            # Simulated slow accelerator (chaos, benchmarks), not synchronisation.
            delay = cfg.step_delay_s + (cfg.slow_factor - 1.0) * (time.perf_counter() - started)
            if delay > 0:
                time.sleep(delay)
            learner.step(checked_tokens(self.spec, task.tokens(batch)))
            window.maybe_record(step)
            if (step + 1) % cfg.eval_every_steps == 0:
                self._evaluate(step + 1)
        return self.summary

    def finish(self) -> None:
        """After ``learner.close``: the final evaluation, with every reply applied."""
        s = self.summary
        if not s.eval_history or s.eval_history[-1][0] != s.inner_steps:
            self._evaluate(s.inner_steps)

    def _evaluate(self, step: int) -> float | None:
        value = evaluate(self.spec, self.task)
        if value is None:
            return None
        s = self.summary
        self.learner.report_loss(eval=value, unit=self.task.eval_unit, step=step)
        logger.info("%s step %d tokens %d eval %.4f %s", self.learner.learner_id, step, s.tokens, value, self.task.eval_unit)
        return value


def _build(run: RunConfig, learner_id: str, num_learners: int, cfg: LearnerConfig):
    """This learner's device, task (its model placed there), optimizer and schedule."""
    device = Device(cfg.device, cfg.precision)
    ctx = TaskContext(learner_number(learner_id), num_learners, run.seed, device.torch, dict(run.task_options))
    task = build_task(run.task, ctx, run.init)
    device.place_model(task.model)
    return device, task, *inner_optimizer(task, cfg, num_learners)


def run_task(member: Membership, cfg: LearnerConfig, *, coordinator: str | None = None, num_learners: int = 1,
             events: TapeWriter | None = None, heartbeats: Heartbeats | None = None, sync: bool = True,
             on_learner: Callable[[Learner], None] = lambda learner: None,
             stop: threading.Event | None = None, slice_link: SliceLink | None = None) -> Learner:
    """Build the run's task for this learner, train it to the end (or a stop), close the
    learner and evaluate once more. Returns the closed learner (``.summary``).
    ``slice_link``: this learner leads a multi-host slice (``follow_slice`` on the others)."""
    run = member.run
    if slice_link is not None:  # the followers build the same task from it
        slice_link.share((run.to_json(), member.learner_id, num_learners))
    device, task, optimizer, schedule = _build(run, member.learner_id, num_learners, cfg)
    learner = Learner(task.model, member, cfg, optimizer=optimizer, coordinator=coordinator, device=device,
                      events=events, heartbeats=heartbeats, sync=sync, stop=stop, slice_link=slice_link)
    layout = device.layout()
    learner.event("device", **layout)
    logger.info("%s trains on %s", learner.learner_id, ", ".join(f"{k} {v}" for k, v in layout.items()))
    on_learner(learner)
    return _train(TaskRunner(run.task, task, learner, optimizer, schedule))


def follow_slice(cfg: LearnerConfig, link: SliceLink) -> SliceFollower:
    """A follower host of a multi-host slice (``diloco.learner.slice``): the leader's task, trained
    in step with it. Returns the closed follower (``.summary``: steps and tokens)."""
    run_json, learner_id, num_learners = link.share()
    run = RunConfig.from_json(run_json)
    device, task, optimizer, schedule = _build(run, learner_id, num_learners, cfg)
    follower = SliceFollower(task.model, run, learner_id, cfg, link, device, optimizer)
    logger.info("%s follows the slice's leader %s", follower.learner_id, learner_id)
    return _train(TaskRunner(run.task, task, follower, optimizer, schedule))


def _train(runner: TaskRunner):
    learner = runner.learner
    try:
        runner.train()
    except BaseException as error:  # the reason the run shows: what was raised, where, and what it said
        learner.close(f"{type(error).__name__} at inner step {runner.step}" + (f": {error}" if str(error) else ""),
                      failed=True)
        raise
    learner.close("finished" if not learner.stop.is_set() else "stopped")
    runner.finish()
    graphs, seconds = learner.device.compiles()
    if graphs:
        learner.event("compiled", graphs=graphs, seconds=round(seconds, 2))
        logger.info("%s: XLA compiled %d graphs in %.1f s", learner.learner_id, graphs, seconds)
    return learner
