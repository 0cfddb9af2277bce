"""One data-parallel worker process (started by ``diloco.baseline.dp.Supervisor``).

It loads the last checkpoint if there is one, joins the gloo group through the
supervisor's store, and trains in lock step: forward and backward on its own batch, one
all-reduce of a single flat buffer holding every gradient (the parameters' ``.grad`` are
views into it, as DDP's bucket views are) plus the loss, clip, AdamW step. Rank 0 writes
the timeline and the checkpoints.

Usage: ``python -m diloco.baseline.dp_worker --run-dir DIR --rank R --attempt A --store-port P``
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from diloco.baseline.common import JsonlWriter
from diloco.baseline.dp import DPConfig
from diloco.model import GPT
from diloco.snapshots import atomic_write
from learner.core.schedule import inner_lr
from learner.data import load_corpus

logger = logging.getLogger(__name__)


def _group(store_port: int, attempt: int, rank: int, world: int, timeout_s: float) -> dist.ProcessGroupGloo:
    """A gloo group bound to 127.0.0.1; each attempt rendezvouses under its own prefix of
    the supervisor's store, so keys left by a killed attempt never collide."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, None, False, timeout=timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return dist.ProcessGroupGloo(dist.PrefixStore(f"attempt-{attempt}", store), rank, world, options)


def _save(path: Path, value: object) -> None:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    atomic_write(path, buffer.getvalue())


def train(run_dir: Path, rank: int, attempt: int, store_port: int) -> None:
    cfg = DPConfig.from_json((run_dir / "config.json").read_text())
    inner = cfg.inner(rank)
    torch.set_num_threads(cfg.threads_per_worker)
    torch.manual_seed(inner.seed)
    model = GPT(cfg.run.model)
    params = [p for p in model.parameters() if p.requires_grad]
    # One buffer for every gradient and the loss: the step's single all-reduce.
    flat = torch.zeros(sum(p.numel() for p in params) + 1)
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    optimizer = torch.optim.AdamW(params, lr=inner.lr, weight_decay=inner.weight_decay)
    corpus = load_corpus(None, inner.data_shard, inner.data_shards)
    start = 0
    checkpoint = run_dir / "checkpoint.pt"
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    group = _group(store_port, attempt, rank, cfg.workers, cfg.collective_timeout_s)
    group.barrier().wait()  # every worker loaded and connected: training starts now
    timeline = JsonlWriter(run_dir / "timeline" / f"attempt-{attempt}.jsonl") if rank == 0 else None
    if timeline is not None:
        timeline.write(kind="ready", step=start, t=time.time())
    logger.info("worker %d attempt %d training from step %d", rank, attempt, start)
    slow = cfg.slow_factor(rank)
    context = cfg.run.model.context
    supervisor = os.getppid()
    for step in range(start, cfg.steps):
        if os.getppid() != supervisor:
            raise SystemExit(f"worker {rank}: the supervisor is gone; stopping")
        t0 = time.time()
        lr = inner_lr(step, inner.lr, inner.warmup_steps, inner.steps, inner.min_lr_ratio)
        for group_ in optimizer.param_groups:
            group_["lr"] = lr
        x, y = corpus.train.batch(step, inner.batch_size, context, inner.seed)
        optimizer.zero_grad(set_to_none=False)  # zeroes the views in place
        _, loss = model(x, y)
        loss.backward()
        if slow > 1.0:
            time.sleep((slow - 1.0) * (time.time() - t0))  # a simulated slower accelerator
        flat[-1] = loss.detach()
        group.allreduce([flat]).wait()
        flat.div_(cfg.workers)
        if inner.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, inner.grad_clip)
        optimizer.step()
        t1 = time.time()
        done = step + 1
        if timeline is None:
            continue
        timeline.write(kind="step", step=done, t0=t0, t1=t1, loss=round(float(flat[-1]), 5))
        if done % cfg.checkpoint_every_steps == 0 or done == cfg.steps:
            c0 = time.time()
            _save(checkpoint, {"step": done, "model": model.state_dict(), "optimizer": optimizer.state_dict()})
            timeline.write(kind="checkpoint", step=done, t0=c0, t1=time.time())
    if timeline is not None:
        _save(run_dir / "model.pt", model.state_dict())
        timeline.write(kind="done", t=time.time())
        timeline.close()
    group.barrier().wait()  # nobody exits before rank 0 has written the final model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diloco.baseline.dp_worker")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(args.run_dir, args.rank, args.attempt, args.store_port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
