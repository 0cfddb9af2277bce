"""One data-parallel worker process (started by ``diloco.lab.baseline.dp.Supervisor``).

It builds the run's task as learner L<rank> would (``common.worker_task``), loads the
last checkpoint if there is one (and skips the batches trained before it), joins the gloo
group through the supervisor's store, and trains in lock step: the task's loss and
backward on its own batch, one all-reduce of a single flat buffer holding every gradient
(the parameters' ``.grad`` are views into it, as DDP's bucket views are) plus the loss,
clip, inner optimizer step. A fresh start takes rank 0's initial parameters, as DDP does.
Rank 0 writes the timeline and the checkpoints.

Usage: ``python -m diloco.lab.baseline.dp_worker --run-dir DIR --rank R --attempt A [--store-host H] --store-port P
[--address A]`` (H: the supervisor's store; A: this worker's own address, on an emulated site)
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from diloco.lab.baseline.common import (
    JsonlWriter, advance_schedule, grad_dtype, run_worker, save_torch, skip_batches, worker_steps,
)
from diloco.lab.baseline.dp import DPConfig
from diloco.task import TaskError, checked_tokens
from diloco.cli.metrics import curve_marks, curve_path
from diloco.learner.runner import inner_optimizer, inner_step

logger = logging.getLogger(__name__)


def _group(store: tuple[str, int], address: str, attempt: int, rank: int, world: int,
           timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group bound to ``address`` (127.0.0.1, or the worker's emulated site); each
    attempt rendezvouses under its own prefix of the supervisor's store, so keys left by a
    killed attempt never collide."""
    timeout = timedelta(seconds=timeout_s)
    client = dist.TCPStore(store[0], store[1], None, False, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore(f"attempt-{attempt}", client), rank, world, options)


@torch.no_grad()
def _broadcast_model(group: dist.ProcessGroupGloo, model: torch.nn.Module) -> None:
    """Every worker starts from rank 0's model, as DDP broadcasts it: a task whose
    initialisation is not fixed by the seed still trains one model."""
    for tensor in model.state_dict().values():
        wire = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor.contiguous()
        group.broadcast(wire, 0).wait()
        if wire is not tensor:
            tensor.copy_(wire)



def train(run_dir: Path, rank: int, attempt: int, store: tuple[str, int], address: str) -> None:
    cfg, task = DPConfig.for_worker(run_dir, rank)
    inner = cfg.inner()
    spec = cfg.run.task
    model = task.model
    params = [p for p in model.parameters() if p.requires_grad]
    # One buffer for every gradient and the loss: the step's single all-reduce.
    flat = torch.zeros(sum(p.numel() for p in params) + 1, dtype=grad_dtype(spec, params))
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    optimizer, schedule = inner_optimizer(task, inner)
    start = 0
    checkpoint = run_dir / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        advance_schedule(schedule, start)
    batches = skip_batches(spec, task.batches, start)
    group = _group(store, address, attempt, rank, cfg.workers, cfg.collective_timeout_s)
    if start == 0:
        _broadcast_model(group, model)
    group.barrier().wait()  # every worker loaded and connected: training starts now
    timeline = JsonlWriter(run_dir / "timeline" / f"attempt-{attempt}.jsonl") if rank == 0 else None
    if timeline is not None:
        timeline.write(kind="ready", step=start, t=time.time())
    logger.info("worker %d attempt %d training from step %d", rank, attempt, start)
    slow = cfg.slow_factor(rank)
    curve_steps = set(curve_marks(cfg.steps, cfg.curve_points))
    for step, t0, batch in worker_steps(cfg, f"worker {rank}", batches, start):
        def all_reduce(loss: torch.Tensor) -> None:
            if slow > 1.0:
                time.sleep((slow - 1.0) * (time.time() - t0))  # a simulated slower accelerator
            flat[-1] = loss.detach()
            group.allreduce([flat]).wait()
            flat.div_(cfg.workers)
            if not math.isfinite(float(flat[-1])):
                raise TaskError(f"task {spec!r}: the loss is {float(flat[-1])} at step {step}")

        # Gradients are views of the one all-reduce buffer: zeroed in place, never replaced.
        inner_step(spec, task, batch, optimizer, schedule, inner.grad_clip, set_to_none=False, before_update=all_reduce)
        tokens = checked_tokens(spec, task.tokens(batch))
        mean_loss = float(flat[-1])
        t1 = time.time()
        done = step + 1
        if timeline is None:
            continue
        timeline.write(kind="step", step=done, t0=t0, t1=t1, loss=round(mean_loss, 5), tokens=tokens)
        if done in curve_steps:  # the global model as training passes each share of the budget
            save_torch(curve_path(run_dir, done * cfg.workers * tokens, ".pt"), model.state_dict())
        if done % cfg.checkpoint_every_steps == 0 or done == cfg.steps:
            c0 = time.time()
            save_torch(checkpoint, {"step": done, "model": model.state_dict(), "optimizer": optimizer.state_dict()})
            timeline.write(kind="checkpoint", step=done, t0=c0, t1=time.time())
    if timeline is not None:
        save_torch(run_dir / "model.pt", model.state_dict())
        timeline.write(kind="done", t=time.time())
        timeline.close()
    group.barrier().wait()  # nobody exits before rank 0 has written the final model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco.lab.baseline.dp_worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--store-host", default="127.0.0.1")
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--address", default="127.0.0.1", help="the address this worker binds and gives its peers")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_worker(train, args.run_dir, args.rank, args.attempt, (args.store_host, args.store_port), args.address)


if __name__ == "__main__":
    sys.exit(main())
