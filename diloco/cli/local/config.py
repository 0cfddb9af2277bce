"""The configuration of ``diloco local`` (``diloco.cli.local.run``), importable without torch:
the command line builds its flags from it."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from diloco.coordinator.config import CoordinatorConfig, LocalLauncherConfig
from diloco.cli.chaos import ChaosConfig
from diloco.cli.metrics import check_curve_points
from diloco.config import RunConfig
from diloco.errors import InvalidArgument
from diloco.coordinator.sites import check_mbit
from diloco.learner.config import LearnerConfig
from diloco.syncer.config import MergeConfig, RoundConfig, SyncerConfig

TOKEN_BUDGET_SLACK = 1.5
"""On a token budget, learners are launched for this many times their share of it."""
PROMETHEUS_TARGETS = "prometheus-targets.json"
"""With ``--prometheus``: the run's live processes as Prometheus file_sd target groups, in RUN_DIR."""


@dataclass(frozen=True)
class LocalConfig:
    run: RunConfig = field(default_factory=RunConfig)
    learners: int = 3
    """M: learners launched at the start (replacements and scavenged learners come on top)."""
    shards: int = 2
    """S: syncer shards the fragments are spread over."""
    quorum: int = RoundConfig.quorum
    grace: str = RoundConfig.grace_mode
    """The shards' grace window for stragglers once the quorum is in: auto (adaptive),
    off, or a fixed number of seconds (``RoundConfig.grace_mode``)."""
    steps: int = 150
    """Inner steps per learner."""
    tokens: int | None = None
    """Token budget of the whole run: learners are launched for 1.5x their share and
    drained once they together have trained it (replacements and scavenged included)."""
    # The shards' and learners' own defaults (syncer.config, learner.config), not copies.
    outer_lr: float = MergeConfig.outer_lr
    outer_momentum: float = MergeConfig.outer_momentum
    outer_optimizer: str = MergeConfig.outer_optimizer
    merge: str = MergeConfig.merge
    """The shards' merge: rda or mean (ablations)."""
    scale_by: str = MergeConfig.scale_by
    """The shards' outer lr scaling: live or round (ablations)."""
    downlink: str = MergeConfig.downlink
    """What the shards' replies carry: condensed or chain (ablations)."""
    reply_codec: str = MergeConfig.reply_codec
    """The shards' condensed replies: int4, or sparse (``MergeConfig.reply_codec``)."""
    reply_density: float = MergeConfig.reply_density
    """With ``--reply-codec sparse``: the fraction of each block a reply keeps."""
    delta_codec: str = LearnerConfig.delta_codec
    """The learners' delta encoding: int4, sparse (``LearnerConfig.delta_codec``) or fp32 (ablations)."""
    delta_density: float = LearnerConfig.delta_density
    """With ``--delta-codec sparse``: the fraction of each block a push keeps."""
    lr: float = LearnerConfig.lr
    """The learners' peak inner learning rate (``LearnerConfig.lr``)."""
    inner_optimizer: str = LearnerConfig.inner_optimizer
    """The learners' inner optimizer (``LearnerConfig.inner_optimizer``)."""
    error_feedback: bool = LearnerConfig.error_feedback
    """The learners carry what quantization left out of a push into the next (ablations)."""
    block_size: int = MergeConfig.block_size
    """int4 block size of pushes and replies."""
    robust_multiple: float = SyncerConfig.robust_multiple
    validator: bool = False
    """Run a validator beside the shards (``diloco validator``, ``SyncerConfig.validator``):
    it scores the learners' pushes on the task's own batches and lowers the merge weight of
    a learner whose pushes raise the loss. It takes CPU from the learners."""
    out: Path | None = None
    startup_timeout_s: float = 120.0
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    slow_learners: tuple[tuple[int, float], ...] = ()
    """(launch index, factor): that learner's steps take factor x their compute time."""
    learner_devices: tuple[tuple[int, str], ...] = ()
    """(launch index, device): that learner trains on that device (cpu, cuda, xla); the
    others on the CPU."""
    delay_ms: float = 0.0
    """Added by every learner to each push and each reply."""
    child_env: Mapping[str, str] | None = None
    """Environment of every process (None: this one's). The CLI puts ``--otlp-endpoint``
    there as OTEL_EXPORTER_OTLP_ENDPOINT."""
    learner_threads: int | None = None
    """torch threads per learner (None: the cores shared out among learners, at least 1)."""
    snapshot_dir: str | None = None
    """Where the run's snapshots go, a directory or fsspec URL (None: RUN_DIR/coordinator/snapshots)."""
    snapshot_every_s: float = CoordinatorConfig.snapshot_every_s
    """The coordinator takes a snapshot this often (0: only on demand and for --restart-shard-at)."""
    snapshot_keep: int = CoordinatorConfig.snapshot_keep
    """The coordinator keeps the newest this many complete snapshots (0: all)."""
    learner_evals: int = 6
    """Evaluations each learner makes while it trains (for the live table and the eval
    plot); 0: none, only the supervisor's of the seed and the final model (``diloco
    compare``: the baselines evaluate nothing while they train either)."""
    curve_points: int = 8
    """Export the global model as the learners pass each of this many equal shares of the
    budget and evaluate it after the run: the global model's eval in ``curves.jsonl``,
    ``loss.png`` and ``summary.json``'s ``curve`` (``diloco.cli.local.curves``; 0 or 1: only the
    seed and the final model)."""
    tensorboard: Path | None = None
    """Also write the run's curves (``curves.jsonl``) as TensorBoard event files in this
    directory as the run ends (the ``tensorboard`` extra)."""
    status_page: bool = True
    """The coordinator serves its status page on 127.0.0.1 (a free port; the run prints the
    URL and lists it in endpoints.json)."""
    fork_server: bool = LocalLauncherConfig.fork_server
    """The coordinator forks learners from a fork server that loaded their code once."""
    tls: bool = True
    """Mutual TLS between every process of the run, with a CA and certificate made for it in
    RUN_DIR/tls; ``--insecure`` turns it off (plaintext gRPC on 127.0.0.1)."""
    link_mbit: float | None = None
    """Emulated sites (``diloco.coordinator.sites``, needs root): every learner runs in a network
    namespace of its own behind a link shaped to this rate each way, Mbit/s; the shards
    and the coordinator listen on the hub. None: every process on 127.0.0.1."""
    links: tuple[tuple[int, float], ...] = ()
    """(launch index, Mbit/s): that learner's own link rate (sites on; the others at
    ``link_mbit``, or the launcher's default)."""
    time_limit_s: float | None = None
    """Stop the learners this long after the start, the budget trained or not (the summary
    says ``time_limited``); ``diloco compare --bandwidth-sweep`` bounds its cells so."""
    prometheus: bool = False
    """Every process (coordinator, shards, learners, replacements too) serves Prometheus
    metrics on the run's host at a port the OS chooses; RUN_DIR/prometheus-targets.json lists
    the live ones for a Prometheus ``file_sd_configs`` (``PROMETHEUS_TARGETS``)."""
    resume: bool = False
    """Continue the stopped run in ``out`` from its newest complete snapshot (``resume_config``)."""

    def __post_init__(self) -> None:
        if self.learners < 1 or self.shards < 1 or self.steps < 1 or self.quorum < 1:
            raise InvalidArgument("learners, shards, steps and quorum must all be >= 1")
        if self.tokens is not None and self.tokens < 1:
            raise InvalidArgument(f"--tokens must be >= 1, got {self.tokens}")
        check_curve_points(self.curve_points)
        if self.learner_evals < 0:
            raise InvalidArgument(f"learner evaluations must be >= 0, got {self.learner_evals}")
        if self.time_limit_s is not None and not (math.isfinite(self.time_limit_s) and self.time_limit_s > 0):
            raise InvalidArgument(f"time limit must be a positive number of seconds, got {self.time_limit_s}")
        if self.delay_ms < 0:
            raise InvalidArgument(f"--delay-ms must be >= 0, got {self.delay_ms}")
        for _, mbit in self.links:
            check_mbit(mbit, "--link")
        if self.link_mbit is not None:
            check_mbit(self.link_mbit)
        for flag, pairs in (("--slow-learner", self.slow_learners), ("--learner-device", self.learner_devices),
                            ("--link", self.links)):
            for index, _ in pairs:
                if index >= self.learners:
                    raise InvalidArgument(f"{flag} L{index}: there are only {self.learners} learners (L0..L{self.learners - 1})")
        self.chaos.check_targets(self.learners, self.shards)
        if self.prometheus and self.sites:
            raise InvalidArgument("--prometheus with emulated sites: each learner's endpoint would be inside its own "
                                  "network namespace, out of a scraper's reach; drop --link-mbit/--link or --prometheus")
        if self.chaos.network and not self.sites:
            kinds = ", ".join(sorted({f.kind for f in self.chaos.faults if f.network}))
            raise InvalidArgument(f"--chaos {kinds}: network faults act on emulated sites: add --link-mbit R")
        MergeConfig(outer_lr=self.outer_lr, outer_momentum=self.outer_momentum, outer_optimizer=self.outer_optimizer,
                    merge=self.merge, scale_by=self.scale_by, downlink=self.downlink,
                    block_size=self.block_size, reply_codec=self.reply_codec,
                    reply_density=self.reply_density)  # the shards' own checks, before any process starts
        LearnerConfig(lr=self.lr, delta_density=self.delta_density)  # and the learners'
        # Shards against fragments: checked with the model's own limit (check_cut), in one line.

    def check_cut(self, tensors: int, most: int) -> None:
        """The model (``tensors`` synced tensors, ``most`` fragments at most: one row each)
        can be cut into ``--fragments`` and each of the ``--shards`` owns one or more:
        else one line with everything wrong and values of both flags that work."""
        fragments, shards = self.run.fragments, self.shards
        fits = min(fragments, most)
        problems, fixes = [], []
        if fragments > most:
            problems.append(f"the model cannot be cut into {fragments} fragments: a fragment holds whole rows (dim 0) "
                            f"of tensors and the model's {tensors} tensors have {most} rows in all")
            fixes.append(f"--fragments {most} or fewer")
        if shards > fits:
            problems.append(f"{shards} shards for {fragments if fragments <= most else f'at most {most}'} fragments: "
                            "some shard would own none")
            fixes.append(f"--shards {fits} or fewer")
        if problems:
            raise InvalidArgument(f"{'; '.join(problems)}: give {' and '.join(fixes)} (a shard owns one fragment or more)")


    @property
    def sites(self) -> bool:
        """Learners run on emulated sites."""
        return self.link_mbit is not None or bool(self.links)

    @property
    def threads_per_learner(self) -> int:
        return self.learner_threads or max((os.cpu_count() or 1) // self.learners, 1)

    def learner_steps(self, tokens_per_step: int) -> int:
        """Inner steps each learner is launched with. On a token budget, 1.5x its share:
        the learners keep training while a replacement or a scavenged learner starts (or
        a slow one lags), and all of them are drained once the budget is trained."""
        if self.tokens is None:
            return self.steps
        share = self.tokens / (self.learners * max(tokens_per_step, 1))
        return max(math.ceil(TOKEN_BUDGET_SLACK * share), 1)
