"""The learner worker: inner AdamW steps on its own data, fragments streamed to their
shards every H steps, replies applied tau steps later. The loop reads like its schedule:
apply due replies, train one step, send the fragments due, evaluate, report."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from diloco.clock import VectorClock
from diloco.codec import encode
from diloco.config import RunConfig
from diloco.model import GPT
from diloco.snapshots import atomic_write
from diloco.tape import TapeWriter
from learner.config import LearnerConfig
from learner.core.schedule import fragments_due, inner_lr, send_offsets
from learner.core.sync import FragmentSync, Reply, SyncBook, delta, merge_into, rebase_into
from learner.data import load_corpus
from learner.device import Device
from learner.streamer import PushJob, Streamer
from learner.telemetry import LearnerTelemetry, SyncTrace
from syncer.core.shard import PushMeta

logger = logging.getLogger(__name__)

LN2 = math.log(2)


@dataclass
class Summary:
    learner_id: str
    inner_steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    train_s: float = 0.0
    """Seconds inside the inner-step loop (the wall time minus bootstrap and draining)."""
    tokens_per_s: float = 0.0
    """Tokens per second of the inner-step loop."""
    eval_bpb_start: float | None = None
    eval_bpb_final: float | None = None
    eval_history: list[tuple[int, int, float]] = field(default_factory=list)
    """(inner step, tokens, eval bits per byte)."""
    pushes_sent: int = 0
    pushes_acked: int = 0
    pushes_dropped: int = 0
    replies_applied: int = 0
    replies_late: int = 0
    sends_deferred: int = 0
    """Sends skipped because the fragment's previous push still awaited its reply."""
    bytes_up: int = 0
    bytes_down: int = 0
    mean_staleness: float = 0.0
    blocked_s: float = 0.0
    """Time the training loop spent on the network (submitting, never waiting): ~0."""
    sync_latency_s_p50: float | None = None


class Learner:
    def __init__(
        self,
        run: RunConfig,
        cfg: LearnerConfig,
        learner_id: str,
        credential: str,
        shards: dict[int, str],
        data: str | None = None,
        sync: bool = True,
    ) -> None:
        self.run, self.cfg, self.learner_id = run, cfg, learner_id
        self.sync = sync
        torch.manual_seed(cfg.seed)
        self.device = Device(cfg.device)
        self.model = GPT(run.model).to(self.device.torch)
        self.params = dict(self.model.named_parameters())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.corpus = load_corpus(data, cfg.data_shard, cfg.data_shards)
        self.plan = run.plan()
        self.num_shards = len(shards)
        self.offsets = send_offsets(self.plan.num_fragments, run.sync_every_steps)
        self.clock = VectorClock()
        self.stop = threading.Event()
        # Chandy-Lamport: markers from the coordinator, recorded at the next step boundary.
        self.markers: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self.snapshot_epoch = 0
        self.on_recorded = lambda snapshot_id, clock, files: None
        self._step = 0
        self.summary = Summary(learner_id)
        self._staleness: list[int] = []
        self.book = SyncBook({}, run.overlap_steps)
        self.telemetry = LearnerTelemetry(learner_id)
        # Each push's trace until its reply is merged (or superseded), by (fragment, send step).
        self._syncs: dict[tuple[int, int], SyncTrace] = {}
        self.streamer = None
        if sync:
            owned = {s: [f.id for f in self.plan.owned_by(s, self.num_shards)] for s in shards}
            self.streamer = Streamer(shards, learner_id, credential, cfg.push_timeout_s, cfg.max_inflight_pushes, owned,
                                     wire_delay_s=cfg.wire_delay_ms / 1000)
        # The learner's own event tape (state changes, evaluations) for diloco timeline.
        self.events: TapeWriter | None = None

    # --- the loop --------------------------------------------------------------------

    def event(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.append(kind, time.time(), **fields)

    def train(self) -> Summary:
        self.event("state", state="bootstrapping")
        if self.streamer is not None:
            self._bootstrap()
        self._evaluate(0)
        self.event("state", state="computing", step=0)
        started = time.monotonic()
        for step in range(self.cfg.steps):
            if self.stop.is_set():
                logger.info("%s: stopping at inner step %d", self.learner_id, step)
                break
            self._step = step
            self._record_snapshots()
            self._apply_due(step)
            self._train_step(step)
            self._send_due(step)
            if (step + 1) % self.cfg.eval_every_steps == 0:
                self._evaluate(step + 1)
            self.summary.wall_s = time.monotonic() - started
        self.summary.train_s = self.summary.wall_s
        self.event("state", state="draining", step=self.summary.inner_steps)
        if self.streamer is not None:
            self.streamer.close(timeout_s=min(self.cfg.push_timeout_s, 30.0))
            self._apply_due(None)
            for sync in self._syncs.values():
                sync.unfinished()
            self._syncs.clear()
        if not self.summary.eval_history or self.summary.eval_history[-1][0] != self.summary.inner_steps:
            self._evaluate(self.summary.inner_steps)
        return self._finish(time.monotonic() - started)

    def _bootstrap(self) -> None:
        """Start from the global state the shards hold, never from a private init."""
        by_shard = {s: [f.id for f in self.plan.owned_by(s, self.num_shards)] for s in range(self.num_shards)}
        updates = self.streamer.bootstrap(by_shard)
        fragments = {}
        for update in updates:
            values = update.segments[-1].tensors
            merge_into(self.plan.gather(update.fragment, self.params), values, 0.0)
            fragments[update.fragment] = FragmentSync([v.clone() for v in values], update.version)
        missing = set(range(self.plan.num_fragments)) - set(fragments)
        if missing:
            raise RuntimeError(f"bootstrap returned no state for fragments {sorted(missing)}")
        self.book = SyncBook(fragments, self.run.overlap_steps)
        logger.info("%s bootstrapped %d fragments at versions %s", self.learner_id, len(fragments),
                    {f: s.base_version for f, s in sorted(fragments.items())})

    def _train_step(self, step: int) -> None:
        lr = inner_lr(step, self.cfg.lr, self.cfg.warmup_steps, self.cfg.steps, self.cfg.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        started = time.perf_counter()
        x, y = self.corpus.train.batch(step, self.cfg.batch_size, self.run.model.context, self.cfg.seed)
        _, loss = self.model(x.to(self.device.torch), y.to(self.device.torch))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.device.step_done()
        # Simulated slow accelerator (chaos, benchmarks), not synchronisation.
        delay = self.cfg.step_delay_s + (self.cfg.slow_factor - 1.0) * (time.perf_counter() - started)
        if delay > 0:
            time.sleep(delay)
        tokens = x.numel()
        self.summary.inner_steps += 1
        self.summary.tokens += tokens
        self.book.count_step(tokens)
        s = self.summary
        self.telemetry.step(tokens, self.plan.num_fragments, s.tokens / s.wall_s if s.wall_s else 0.0)

    def _send_due(self, step: int) -> None:
        if self.streamer is None:
            return
        for fragment_id in fragments_due(step, self.offsets, self.run.sync_every_steps):
            started = time.perf_counter()
            state = self.book.fragments[fragment_id]
            host = [self.device.to_host(t) for t in self.plan.gather(fragment_id, self.params)]
            keep = [t.detach().clone() for t in host] if self.run.reply_rule == "rebase" else None
            if not self.book.sending(fragment_id, step, keep):
                continue  # its previous push is still out; the next send carries both
            shard = self.plan.fragments[fragment_id].owner(self.num_shards)
            sync = self.telemetry.start_sync(fragment_id, shard, state.base_version, step)
            pieces = self.plan.fragments[fragment_id].pieces
            encoded = [
                encode(piece.name, d, encoding=self.cfg.delta_codec, block_size=self.cfg.block_size)
                for piece, d in zip(pieces, delta(state.anchor, host))
            ]
            self.clock = self.clock.tick(self.learner_id)
            meta = PushMeta(
                self.learner_id, fragment_id, state.base_version, state.tokens, state.steps,
                self.summary.wall_s / max(self.summary.inner_steps, 1), self.clock, tuple(e.spec for e in encoded),
                snapshot_epoch=self.snapshot_epoch,
            )
            sync.phase("encode", time.perf_counter() - started)
            if self.streamer.submit(PushJob(shard, meta, encoded, state.anchor, step, sync)):
                self._syncs[(fragment_id, step)] = sync
            else:
                self.book.receive(Reply(fragment_id, -1, [], step, 0, failed=True))
            self.summary.blocked_s += time.perf_counter() - started

    def _apply_due(self, step: int | None) -> None:
        """Apply replies due at ``step`` (None: whatever has arrived, at the end)."""
        if self.streamer is None:
            return
        while True:
            try:
                reply = self.streamer.replies.get_nowait()
            except queue.Empty:
                break
            self.book.receive(reply)
            if (sync := self._syncs.get((reply.fragment, reply.sent_step))) is not None:
                sync.received = True
        due = self.book.due(step if step is not None else 1 << 62)
        for reply in due:
            started = time.perf_counter()
            views = self.plan.gather(reply.fragment, self.params)
            sent = self.book.rebase_from(reply) if self.run.reply_rule == "rebase" else None
            if sent is not None:
                rebase_into(views, reply.values, sent)
            else:
                merge_into(views, reply.values, self.run.merge_alpha)
            self.book.applied_reply(reply, rebased=sent is not None)
            self._staleness.append(reply.staleness)
            if (sync := self._syncs.pop((reply.fragment, reply.sent_step), None)) is not None:
                sync.applied(time.perf_counter() - started, reply.staleness)
        self._retire_syncs()

    def _retire_syncs(self) -> None:
        """Forget traces that ended in the streamer (dropped, failed); end those whose reply
        the book dropped for a newer one."""
        waiting = {(r.fragment, r.sent_step) for r in self.book.waiting}
        for key, sync in list(self._syncs.items()):
            if sync.received and key not in waiting:
                sync.superseded()
            if sync.ended:
                del self._syncs[key]

    def _record_snapshots(self) -> None:
        """Record local state for each new marker: model, AdamW, the data cursor (the step),
        the per-fragment sync books and the clock. Pushes sent from now on carry the
        snapshot's epoch, so a shard can tell in-flight pushes (channel state) from later ones."""
        while True:
            try:
                snapshot_id, directory = self.markers.get_nowait()
            except queue.Empty:
                return
            if snapshot_id <= self.snapshot_epoch:
                continue  # the coordinator repeats a marker until it hears our report
            self.clock = self.clock.tick(self.learner_id)
            state = {
                "learner_id": self.learner_id,
                "step": self._step,
                "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(),
                "fragments": {
                    f: {"anchor": s.anchor, "base_version": s.base_version, "tokens": s.tokens, "steps": s.steps}
                    for f, s in self.book.fragments.items()
                },
                "clock": dict(self.clock.entries),
            }
            name = f"{self.learner_id}.pt"
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = buffer.getvalue()
            atomic_write(Path(directory) / name, data)
            self.snapshot_epoch = snapshot_id
            self.on_recorded(snapshot_id, self.clock, [(name, len(data), hashlib.sha256(data).hexdigest())])
            logger.info("%s recorded snapshot %d at inner step %d", self.learner_id, snapshot_id, self._step)

    @torch.no_grad()
    def _evaluate(self, step: int) -> float:
        self.model.eval()
        losses = []
        for i in range(self.cfg.eval_batches):
            x, y = self.corpus.eval.batch(i, self.cfg.batch_size, self.run.model.context, seed=12345)
            _, loss = self.model(x.to(self.device.torch), y.to(self.device.torch))
            losses.append(float(loss))
        self.model.train()
        bpb = sum(losses) / len(losses) / LN2
        if self.summary.eval_bpb_start is None:
            self.summary.eval_bpb_start = bpb
        self.summary.eval_bpb_final = bpb
        self.summary.eval_history.append((step, self.summary.tokens, round(bpb, 5)))
        self.event("eval", step=step, tokens=self.summary.tokens, bpb=round(bpb, 5))
        logger.info("%s step %d tokens %d eval %.4f bits/byte", self.learner_id, step, self.summary.tokens, bpb)
        return bpb

    def _finish(self, wall_s: float) -> Summary:
        s = self.summary
        s.wall_s = wall_s
        s.tokens_per_s = s.tokens / s.train_s if s.train_s > 0 else 0.0
        if self.streamer is not None:
            st = self.streamer.stats
            s.pushes_sent, s.pushes_acked, s.pushes_dropped = st.pushes_sent, st.pushes_acked, st.pushes_dropped
            s.bytes_up, s.bytes_down = st.bytes_up, st.bytes_down
            if st.latency_s:
                s.sync_latency_s_p50 = sorted(st.latency_s)[len(st.latency_s) // 2]
        s.replies_applied, s.replies_late, s.sends_deferred = self.book.applied, self.book.late, self.book.deferred
        s.mean_staleness = sum(self._staleness) / len(self._staleness) if self._staleness else 0.0
        return s

    def version_lag(self) -> int:
        """Staleness of the last merged reply: versions the global had moved past its push's base."""
        return self._staleness[-1] if self._staleness else 0

    def anchors(self) -> dict[int, list[torch.Tensor]]:
        return {f: s.anchor for f, s in self.book.fragments.items()}


def write_summary(summary: Summary, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(summary), indent=1))
    tmp.replace(path)
