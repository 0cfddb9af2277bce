"""Configuration of one learner: its inner loop (steps, default optimizer, schedule) and its syncing."""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco.config import BLOCK_SIZE, check_density
from diloco.errors import InvalidArgument

DEVICES = ("cpu", "cuda", "xla")
PRECISIONS = ("fp32", "bf16")
DELTA_CODECS = ("int4", "sparse", "fp32")
INNER_OPTIMIZERS = ("adamw", "adamw-pooled")


@dataclass(frozen=True)
class LearnerConfig:
    device: str = "cpu"
    """cpu | cuda | xla (torch_xla is imported only when chosen; xla uses every device of
    the host through SPMD, see diloco.learner.device)."""
    precision: str = "fp32"
    """fp32 | bf16: the forward pass and loss under bfloat16 autocast (parameters,
    optimizer state and deltas stay fp32)."""
    steps: int = 300
    """Inner steps to train (the learner then leaves)."""
    lr: float = 3e-3
    """Peak inner AdamW learning rate."""
    inner_optimizer: str = "adamw-pooled"
    """adamw | adamw-pooled (``diloco.learner.core.pooled``): AdamW normalised by the
    second moment the mean gradient of the run's planned learners would have, its noise
    estimated from each batch's two halves (two backward passes of half a batch per step).
    A task's own optimizer replaces either."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Inner steps of the linear warmup before the cosine schedule."""
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every_steps: int = 50
    """Inner steps between two evaluations of the learner's own model."""
    train_loss_every_steps: int = 10
    """The training loss is recorded as its mean over each this many inner steps: a
    ``train`` event (the run's curves), the heartbeat's value (the status page) and the
    ``diloco.learner.train_loss`` gauge. On XLA the loss is read once per window (a host sync)."""
    skip_start_eval: bool = False
    """No evaluation before the first inner step (it would delay the first step). A learner
    joining a model others have trained never evaluates there; ``diloco local`` skips it
    for all, its supervisor evaluating the seed model once for the run."""
    delta_codec: str = "sparse"
    """Encoding of outgoing deltas: sparse (of each block the ``delta_density`` largest
    values at 2 bits, ``diloco.codec.sparse``; with error feedback what it drops goes with
    the next push), int4 or fp32 (ablations)."""
    delta_density: float = 0.125
    """With ``delta_codec`` sparse: the fraction of each block's values a push keeps, (0, 1]."""
    block_size: int = BLOCK_SIZE
    """int4 block size of pushes; must be the shards' (``MergeConfig.block_size``)."""
    error_feedback: bool = True
    """Add what int4 quantization left out of a fragment's last push to its next one
    (costs a host copy of the model): every part of an update reaches the shard in the
    end, as the shards' condensed replies already do for the downlink. On the long
    workload (docs/results/long/) it was within run-to-run noise of no feedback and of
    fp32 pushes."""
    step_delay_s: float = 0.0
    """Extra seconds per inner step: simulates a slower accelerator (chaos, benchmarks)."""
    slow_factor: float = 1.0
    """Each inner step takes this many times its compute time (chaos: a slower chip)."""
    wire_delay_ms: float = 0.0
    """Added to each push before sending and to each reply before use (chaos: a slow network)."""
    push_timeout_s: float = 120.0
    """Deadline of one push RPC (upload + waiting for the round to close)."""
    max_inflight_pushes: int = 16
    """Pushes queued or in flight; beyond it a send is dropped and counted, never waited for."""
    heartbeat_interval_s: float | None = None
    """Seconds between two heartbeats to the coordinator (its own small channel, never
    behind bulk traffic). Default: a fifth of the lease the coordinator announces (1 s at
    its default 5 s), so a run of thousands of learners lengthens its lease
    (``--lease-s``) and their heartbeats follow. At most half the lease."""
    slice_timeout_s: float = 900.0
    """A host of a multi-host slice waits this long for the others at any step (the leader's
    bootstrap included) before it fails (diloco.learner.slice)."""
    coordinator_loss_timeout_s: float = 300.0
    """A learner whose heartbeats have all failed (coordinator unreachable) for this long
    leaves: nothing is left running when a run's coordinator is gone for good. Shorter
    outages (a restart) it trains through."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise InvalidArgument(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.precision not in PRECISIONS:
            raise InvalidArgument(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.inner_optimizer not in INNER_OPTIMIZERS:
            raise InvalidArgument(f"inner optimizer must be one of {INNER_OPTIMIZERS}, got {self.inner_optimizer!r}")
        if self.delta_codec not in DELTA_CODECS:
            raise InvalidArgument(f"delta codec must be one of {DELTA_CODECS}, got {self.delta_codec!r}")
        check_density("--delta-density", self.delta_density)
        for name in ("steps", "eval_every_steps", "train_loss_every_steps", "max_inflight_pushes"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name.replace('_', ' ')} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "push_timeout_s", "heartbeat_interval_s", "coordinator_loss_timeout_s", "slice_timeout_s"):
            value = getattr(self, name)
            if name == "heartbeat_interval_s" and value is None:
                continue
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{name} must be a positive number, got {value}")
        if not (math.isfinite(self.slow_factor) and self.slow_factor >= 1):
            raise InvalidArgument(f"slow factor must be a finite number >= 1, got {self.slow_factor}")
        for name in ("weight_decay", "grad_clip", "step_delay_s", "min_lr_ratio", "wire_delay_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{name} must be a finite number >= 0, got {value}")
        if self.warmup_steps < 0:
            raise InvalidArgument(f"warmup steps must be >= 0, got {self.warmup_steps}")
