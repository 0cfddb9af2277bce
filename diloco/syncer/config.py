"""Configuration of one syncer shard."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from diloco.config import BLOCK_SIZE, check_density
from diloco.errors import InvalidArgument

GRACE_MODES = ("auto", "fixed", "off")
SCALE_MODES = ("live", "round")
MERGE_MODES = ("rda", "mean")
DOWNLINKS = ("condensed", "chain")
REPLY_CODECS = ("int4", "sparse")
OUTER_OPTIMIZERS = ("nesterov", "delayed-nesterov")
"""``diloco.syncer.core.outer.momentum_step``'s optimizers."""
MAX_SHARDS = 1024
"""More shards than this split no model usefully (each owns whole fragments); the bound
keeps a typo from planning a million-entry shard table."""


@dataclass(frozen=True)
class RoundConfig:
    """When a round closes: quorum K, then an adaptive grace window for stragglers
    (``diloco.syncer.core.rounds``)."""

    quorum: int = 1
    """Minimum learners (K) whose pushes must be in before the grace window starts."""
    grace_mode: str = "off"
    """The grace window for stragglers once the quorum is in: auto, clamp(gamma * (tau *
    step_time - (quorum_time + sync_time)), 0, grace_max_s); fixed, always grace_fixed_s;
    off, close as soon as the quorum is in.

    Off by default: a round then merges the first push (K = 1) at the outer lr times its
    share of the live learners, and the others follow in rounds of their own. Measured (H = 8, 4 learners x
    120 steps, 3 runs per cell, docs/results/sweep-grace/): final eval 3.366 ± 0.051
    bits/byte without grace against 3.465 ± 0.136 with the adaptive window on nofault,
    3.338 ± 0.025 against 3.428 ± 0.176 under learner kills, 3.341 against 3.339 with
    stragglers, at the same goodput and bytes: a window that gathers every learner in
    lockstep makes each round a synchronous average, and some runs land far worse."""
    grace_gamma: float = 0.5
    """Fraction of the estimated slack granted to stragglers (gamma < 1)."""
    grace_max_s: float = 5.0
    """Upper bound of the adaptive grace window."""
    grace_fixed_s: float = 0.5
    """Grace window in fixed mode."""
    overlap_steps: int = 2
    """tau: inner steps a learner trains before it needs the reply."""
    ema_factor: float = 0.2
    """Weight of the newest sample in the step, quorum and sync time averages."""

    def __post_init__(self) -> None:
        if self.quorum < 1:
            raise InvalidArgument(f"quorum must be >= 1, got {self.quorum}")
        if self.grace_mode not in GRACE_MODES:
            raise InvalidArgument(f"grace mode must be one of {GRACE_MODES}, got {self.grace_mode!r}")
        if not 0 < self.grace_gamma < 1:
            raise InvalidArgument(f"grace gamma must be in (0, 1), got {self.grace_gamma}")
        for name in ("grace_max_s", "grace_fixed_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidArgument(f"{name} must be a finite number >= 0, got {value}")
        if self.overlap_steps < 1:
            raise InvalidArgument(f"overlap steps (tau) must be >= 1, got {self.overlap_steps}")
        if not 0 < self.ema_factor <= 1:
            raise InvalidArgument(f"EMA factor must be in (0, 1], got {self.ema_factor}")


@dataclass(frozen=True)
class MergeConfig:
    """How a round's deltas become one outer step."""

    merge: str = "rda"
    """rda: radial-directional averaging for non-embedding pieces; mean: weighted mean everywhere."""
    staleness_lambda: float = 0.0
    """Staleness discount 1 / (1 + lambda * (version - base_version)); 0 disables it."""
    outer_lr: float = 1.0
    """The outer learning rate: a round moves the fragment by this times its merged delta
    (times the round's share of the live learners, ``scale_by`` live); 1 without momentum
    averages the learners' deltas.

    Every larger step measured broke training at H = 8 (docs/results/outer/): per-push
    steps form a delayed-feedback loop whose gain the stability bound holds near 1."""
    outer_momentum: float = 0.0
    """Outer Nesterov momentum (0: none), applied every round (``outer_optimizer``
    nesterov) or once per period of the live learners' pushes (delayed-nesterov).

    The paper's outer Nesterov (lr 0.7, momentum 0.9) suits sync periods of hundreds of
    steps; at H = 4 to 16 it re-applies overlapping progress and barely learns. Measured at
    the default H = 8, 4 learners x 120 steps, 3 runs each (docs/results/sweep-outer/):
    eval 3.470 ± 0.166 bits/byte with 1.0 / 0, 3.618 with 1.3 / 0, 3.502 with 0.6 / 0.5,
    8.265 with 0.7 / 0.9."""
    outer_optimizer: str = "nesterov"
    """nesterov: every round takes a Nesterov step with ``outer_momentum``; delayed-nesterov:
    the momentum is applied once per period of rounds that make up one share of every live
    learner, the plain step every round (``diloco.syncer.core.outer.momentum_step``)."""
    scale_by: str = "live"
    """live: the outer lr is scaled by the round's share of the live learners
    (merged pushes / live learners), so a round merging 1 of M learners moves the global
    model by 1/M of that learner's progress, as averaging all M would; round: the merged
    deltas count in full whatever their number (the synchronous DiLoCo rule)."""
    block_size: int = BLOCK_SIZE
    """int4 block size of the downlink updates (and the expected block size of pushes)."""
    scale_dtype: str = "float16"
    """dtype of each int4 block's scale in the downlink updates: float16 or float32."""
    update_chain_length: int = 4
    """Quantized updates kept per fragment; older learners get the full fp32 fragment."""
    downlink: str = "condensed"
    """What a reply carries. chain: every int4 update since the learner's base version,
    which leaves it bit-identical to the shard (a learner that misses R rounds downloads
    R updates). condensed: one int4 update, the global values minus the learner's anchor
    as the shard mirrors it; the mirror advances by exactly what the learner adds, so the
    rounding error is sent with the next reply (error feedback) and a learner stays within
    one int4 step of the global values. Costs the shard about a byte per parameter per
    learner (``diloco.syncer.core.mirrors``: an int8 difference from a shared base, its drift
    accounted). Measured in docs/results/compare-condensed/ and docs/results/scale/."""
    reply_codec: str = "sparse"
    """Encoding of condensed replies: int4, or sparse (of each block the ``reply_density``
    largest values at 2 bits, ``diloco.codec.sparse``; what a reply leaves out stays in the
    learner's difference from the global values and goes with a later reply). A chain
    downlink's replies are its int4 updates whatever this says: they are shared by every
    learner, and only a condensed reply can send what the last one left out."""
    reply_density: float = 1.0
    """With ``reply_codec`` sparse: the fraction of each block's values a reply keeps, (0, 1]
    (1: every value at 2 bits, no indices; fewer lost quality, docs/results/sparse/)."""

    def __post_init__(self) -> None:
        if self.merge not in MERGE_MODES:
            raise InvalidArgument(f"merge must be one of {MERGE_MODES}, got {self.merge!r}")
        if not (math.isfinite(self.staleness_lambda) and self.staleness_lambda >= 0):
            raise InvalidArgument(f"staleness lambda must be >= 0, got {self.staleness_lambda}")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise InvalidArgument(f"--outer-lr must be > 0, got {self.outer_lr}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise InvalidArgument(f"--outer-optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, "
                                  f"got {self.outer_optimizer!r}")
        if self.scale_by not in SCALE_MODES:
            raise InvalidArgument(f"scale by must be one of {SCALE_MODES}, got {self.scale_by!r}")
        if not 0 <= self.outer_momentum < 1:
            raise InvalidArgument(f"--outer-momentum must be in [0, 1) (a momentum of 1 or more never decays: the steps grow without bound), got {self.outer_momentum}")
        if self.block_size < 2 or self.block_size % 2:
            raise InvalidArgument(f"block size must be an even number >= 2, got {self.block_size}")
        if self.scale_dtype not in ("float16", "float32"):
            raise InvalidArgument(f"scale dtype must be float16 or float32, got {self.scale_dtype!r}")
        if self.downlink not in DOWNLINKS:
            raise InvalidArgument(f"downlink must be one of {DOWNLINKS}, got {self.downlink!r}")
        if self.reply_codec not in REPLY_CODECS:
            raise InvalidArgument(f"reply codec must be one of {REPLY_CODECS}, got {self.reply_codec!r}")
        check_density("--reply-density", self.reply_density)
        if self.update_chain_length < 1:
            raise InvalidArgument(f"update chain length must be >= 1, got {self.update_chain_length}")


@dataclass(frozen=True)
class SyncerConfig:
    shard_id: int = 0
    """This shard's id m: it owns the fragments p with p mod S == m."""
    num_shards: int = 1
    """S: the run's number of shards."""
    rounds: RoundConfig = field(default_factory=RoundConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    max_push_bytes: int = 512 * 1024 * 1024
    """Largest accepted push payload (uncompressed); bigger pushes get RESOURCE_EXHAUSTED."""
    max_tokens_per_push: int = 10**12
    max_steps_per_push: int = 10**7
    stream_idle_timeout_s: float = 60.0
    """A push or initialize stream that sends nothing for this long is closed."""
    anchor_window_s: float = 5.0
    """A shard back without its state collects learners' anchors of a fragment for this
    long after the first offer and takes the newest (a learner probes a down shard at
    least every 5 s): fewer rounds lost than taking the first."""
    max_delta_ratio: float = 10.0
    """A push whose delta norm exceeds this many times its fragment's norm (taken as at
    least 1) is refused: an honest outer gradient is a fraction of the parameters, and a
    crafted one must not be able to move (or overflow) the global model."""
    robust_multiple: float = 3.0
    """A push's delta norm is clipped to this many times the median of the other learners'
    latest deltas to its fragment (per unit of time), and its tokens count for at most this
    many times theirs (``diloco.syncer.core.bounds``): one learner, however it misbehaves, moves
    the model at most as much as this many honest ones. Measured on the honest default
    run (4 learners, 240 steps): 6 of 496 pushes clipped at 3, 12 at 2, 53 at 1.5
    (docs/results/influence/). ``inf``: no bounds at all, neither relative nor the lone
    learner's (ablations: what the bounds cost or prevent)."""

    validator: bool = False
    """A validator scores this run's learners (``diloco validator``): the shard keeps each
    recent learner's latest push of each fragment for it (at most ``SAMPLES_KEPT`` per
    fragment, as they arrived: int4, an eighth of the fragment's fp32 size each) and takes
    its scores, which lower the merge weight of a learner whose pushes raise the
    validator's held-out loss (``diloco.validator``)."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_shards <= MAX_SHARDS:
            raise InvalidArgument(f"shard count must be in [1, {MAX_SHARDS}], got {self.num_shards}")
        if not 0 <= self.shard_id < self.num_shards:
            raise InvalidArgument(f"shard id must be in [0, {self.num_shards}), got {self.shard_id}")
        if self.max_push_bytes <= 0:
            raise InvalidArgument(f"max push bytes must be positive, got {self.max_push_bytes}")
        if not (math.isfinite(self.stream_idle_timeout_s) and self.stream_idle_timeout_s > 0):
            raise InvalidArgument(f"stream idle timeout must be a positive number, got {self.stream_idle_timeout_s}")
        if not (math.isfinite(self.anchor_window_s) and self.anchor_window_s >= 0):
            raise InvalidArgument(f"anchor window must be a finite number of seconds >= 0, got {self.anchor_window_s}")
        if not (math.isfinite(self.max_delta_ratio) and self.max_delta_ratio > 0):
            raise InvalidArgument(f"max delta ratio must be a positive number, got {self.max_delta_ratio}")
        if not self.robust_multiple >= 1:
            raise InvalidArgument(f"robust multiple must be a number >= 1 (inf: no bounds), got {self.robust_multiple}")


@dataclass(frozen=True)
class ShardServerConfig:
    secret: str
    host: str = "127.0.0.1"
    """Address the shard's gRPC server binds."""
    port: int = 0
    """Port of the shard's gRPC server (0: any free port, written to the port file)."""
    health_port: int | None = None
    """Also answer grpc.health.v1 in plaintext on this port (probes that cannot do mutual
    TLS); None: only on the main port."""
    reflection: bool = False
    """Serve gRPC reflection (off: it lists every method to anyone who connects)."""
    data_dir: Path | None = None
    """Where the event tape (and, later, snapshots) go; None keeps no tape."""
    static_learners: tuple[str, ...] = ()
    """Live learners when running without a coordinator (tests, benchmarks)."""
    coordinator: str | None = None
    snapshot_dir: str | None = None
    """Where snapshots live, a directory or an fsspec URL (the coordinator's); needed by
    restore by id or "latest"."""
    restore: str | None = None
    """Start from a complete snapshot: "latest", an id, a snapshot directory or manifest."""
    report_timeout_s: float = 30.0
    max_message_bytes: int = 8 * 1024 * 1024
    tape_fsync_every: int = 64
    push_log: bool = False
    """Also log every accepted push's payload (``diloco replay`` re-runs the rounds from it)."""
    shutdown_grace_s: float = 10.0
