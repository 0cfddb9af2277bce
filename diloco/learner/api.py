"""Decoupled DiLoCo around the user's own training loop: wrap the model, call ``step``
after each optimizer step (docs/own-loop.md walks through a run and is the reference).

    learner = diloco.Learner.join(model, coordinator="HOST:PORT", join_token=TOKEN, optimizer=opt,
                                  tls_dir="tls")
    with learner:
        for batch in my_batches(learner.index):
            loss = my_loss(model, batch); loss.backward(); opt.step(); opt.zero_grad()
            learner.step(tokens=batch.numel())
            if learner.should_stop:
                break

What it does: registers the model's manifest with the coordinator (the first learner's
fixes the run's model), offers the model's values to shards that hold none yet, starts
from the global values the shards hold (so learners need not initialise identically),
then at each ``step`` applies the replies that are due (tau steps after their push, or
as soon as they arrive after that) and sends the fragments due (every H steps each,
int4 deltas against the last global values received), never waiting on the network. It
heartbeats, records its state on snapshot markers, and on ``close`` finishes in-flight
pushes and leaves. The ``--task`` runner (``diloco.learner.runner``) is built on this class.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import queue
import socket
import threading
import time

import torch

from diloco import rpc
from diloco import snapshots as snapshot_store
from diloco.clock import VectorClock
from diloco.codec import EncodedTensor, encode, values_digest
from diloco.codec.sparse import kept_for
from diloco.config import RunConfig
from diloco.errors import DilocoError, FailedPrecondition, InvalidArgument
from diloco.manifest import Manifest, manifest_of, synced_tensors
from diloco.tape import TapeWriter
from diloco.wire import PushMeta
from diloco.learner.config import LearnerConfig
from diloco.learner.core.schedule import fragments_due, send_offsets
from diloco.learner.core.sync import FragmentSync, Reply, SyncBook, Write, encode_push, write_into
from diloco.learner.device import Device
from diloco.learner.membership import Heartbeats, Membership, join, register_model
from diloco.learner.slice import SliceLink, SliceStep, host_state
from diloco.learner.summary import LossReports, Pace, Summary
from diloco.learner.streamer import SEED_WAIT_S, PushJob, Streamer
from diloco.learner.telemetry import LearnerTelemetry, SyncTrace

FINAL_PUSH_WAIT_S = 5.0
"""How long a leaving learner waits for its in-flight pushes before its final pushes."""

logger = logging.getLogger(__name__)


def learner_number(learner_id: str) -> int:
    digits = "".join(ch for ch in learner_id if ch.isdigit())
    return int(digits) if digits else 0


class Learner(LossReports):
    """One learner of a run, around a model the caller trains. Use ``Learner.join`` to
    join a coordinator; the constructor takes a membership already obtained (a static
    topology in tests and benchmarks, or ``diloco.learner.membership.join``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        member: Membership,
        config: LearnerConfig | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        coordinator: str | None = None,
        device: Device | None = None,
        events: TapeWriter | None = None,
        heartbeats: Heartbeats | None = None,
        sync: bool = True,
        stop: threading.Event | None = None,
        slice_link: SliceLink | None = None,
    ) -> None:
        """``optimizer``: recorded in snapshots with the model. ``coordinator``: heartbeat
        to it and register the model's manifest with it (``heartbeats``: already beating,
        started before the model was built). ``sync`` False: train alone (the benchmark's
        no-sync baseline). ``stop``: the event that asks this learner to leave (a signal
        handler's), honoured from the start: set while bootstrapping, it ends the wait.
        ``slice_link``: this learner leads a multi-host slice (``diloco.learner.slice``): what it
        writes into the model, and when it stops, is broadcast to the other hosts."""
        self.model, self.member, self.cfg = model, member, config or LearnerConfig()
        self.run: RunConfig = member.run
        self.learner_id = member.learner_id
        self.optimizer = optimizer
        self.device = device or Device(self.cfg.device, self.cfg.precision)
        self.events = events
        self.stop = stop or threading.Event()
        self.stop_reason = ""
        self._drain_at: tuple[int, str] | None = None
        """A drain that waits for this token count (the run's budget, ``_drain``)."""
        self.summary = Summary(self.learner_id)
        self.pace = Pace()
        """Tokens per second over the last few seconds of steps: the heartbeats' rate."""
        self.telemetry = LearnerTelemetry(self.learner_id)
        self.clock = VectorClock()
        # Chandy-Lamport: markers from the coordinator, recorded at the next step boundary.
        self.markers: queue.SimpleQueue[tuple[int, str]] = queue.SimpleQueue()
        self.snapshot_epoch = 0
        self.on_recorded = lambda snapshot_id, clock, files: None
        self._step = 0
        self._started = time.monotonic()
        self._staleness: list[int] = []
        self._syncs: dict[tuple[int, int], SyncTrace] = {}
        self._closed = False
        self.slice = slice_link
        self._writes: list[Write] = []
        self._state_reads = 0
        self._stopping = False
        """The stop decided at the last step boundary (a slice stops on the same step everywhere)."""
        self._bootstrapped = False
        self._seed_wait_s = 0.0
        """How long to wait for the coordinator's seed of an empty shard (it seeds them)."""
        self.joined_in_progress = False
        """Bootstrapped a model other learners have trained (a replacement or a scavenged
        learner), on its own: its runner then skips the evaluation at step 0, which would
        delay its first step (a slice's hosts evaluate in step, so a slice never skips)."""
        self.heartbeats = heartbeats
        self.streamer = None
        try:
            if coordinator:
                if self.heartbeats is None:
                    self.heartbeats = Heartbeats(coordinator, member, self.cfg.heartbeat_interval_s, self._stats, self._drain,
                                                 loss_timeout_s=self.cfg.coordinator_loss_timeout_s)
                    self.heartbeats.start()
                self.heartbeats.stats, self.heartbeats.on_drain = self._stats, self._drain
                self.heartbeats.on_snapshot = lambda snapshot_id, directory: self.markers.put((snapshot_id, directory))
                self.on_recorded = self.heartbeats.report
            self.manifest = manifest_of(model)
            self.manifest_json = self.manifest.to_json()
            if coordinator:
                topology = register_model(coordinator, member, self.manifest_json)
                self._seed_wait_s = SEED_WAIT_S if topology.seeds_shards else 0.0
                if topology.manifest_json != self.manifest_json:  # the run's model: check we train the same
                    difference = self.manifest.first_difference(Manifest.from_json(topology.manifest_json))
                    if difference is not None:
                        raise FailedPrecondition(f"{self.learner_id}'s model differs from the run's: {difference}")
            self.plan = self.manifest.plan(self.run.fragments)
            self.tensors = synced_tensors(model, self.manifest)
            self.num_shards = len(member.shards)
            self.offsets = send_offsets(self.plan.num_fragments, self.run.sync_every_steps)
            self.book = SyncBook({}, self.run.overlap_steps)
            if sync:
                owned = {s: [f.id for f in self.plan.owned_by(s, self.num_shards)] for s in member.shards}
                self.streamer = Streamer(member.shards, member.credential, self.cfg.push_timeout_s,
                                         self.cfg.max_inflight_pushes, owned, wire_delay_s=self.cfg.wire_delay_ms / 1000)
                self.event("state", state="bootstrapping")
                self._bootstrap()
                self._share_with_slice()
                self._bootstrapped = True
        except BaseException as error:
            self.close(f"failed to start: {error}")
            raise
        self._started = time.monotonic()  # the inner-step loop starts now

    @classmethod
    def join(cls, model: torch.nn.Module, coordinator: str, join_token: str, config: LearnerConfig | None = None, *,
             tls_dir: str | os.PathLike | None = None, insecure: bool = False, pool: str = "default",
             launch_id: str = "", optimizer: torch.optim.Optimizer | None = None,
             events: TapeWriter | None = None) -> Learner:
        """Join the run of the coordinator at ``coordinator`` with the model to train.

        ``tls_dir``: mutual TLS with the run's certificates (a directory holding ca.crt,
        tls.crt and tls.key, as ``diloco certs --out DIR`` writes them); ``insecure``:
        plaintext, for a run started with ``--insecure``. With neither, the environment
        decides as it does for the ``diloco`` command: ``$DILOCO_TLS_DIR``, else
        ``$DILOCO_INSECURE=1``; with none of these, a process that already chose TLS
        (``diloco.rpc.use_tls``) keeps it, and any other is refused. The choice is the
        process's from then on (``rpc.use_tls``): the learner's pushes and heartbeats
        open their channels later, and every learner of a process talks to one run."""
        # The library's one read of the process environment: the CLI's two transport variables.
        transport = rpc.choose_transport(tls_dir, insecure, os.environ)
        if transport is not None:
            rpc.use_tls(transport.tls)
            if transport.tls is None:
                logger.warning("insecure: plaintext gRPC, tokens and credentials cross the network in clear")
        elif not rpc.tls_enabled():
            raise InvalidArgument(
                "Learner.join refuses plaintext gRPC: give tls_dir=DIR (the run's ca.crt, tls.crt and tls.key; "
                "`diloco certs --out DIR` makes them) or insecure=True for a run started with --insecure, "
                "or set $DILOCO_TLS_DIR or $DILOCO_INSECURE=1")
        member = join(coordinator, join_token, pool, launch_id, f"{socket.gethostname()}:{os.getpid()}")
        return cls(model, member, config, optimizer=optimizer, coordinator=coordinator, events=events)

    # --- what the training loop calls --------------------------------------------------

    @property
    def index(self) -> int:
        """This learner's number (``L3`` is 3): pick its share of the data with it."""
        return learner_number(self.learner_id)

    @property
    def should_stop(self) -> bool:
        """The coordinator asked this learner to leave (drain), or ``close`` was called. A
        slice's leader answers what it decided, and told its hosts, at the last step."""
        return self._stopping if self.slice is not None else self.stop.is_set()

    @property
    def version_lag(self) -> int:
        """Staleness of the last merged reply: versions the global had moved past its push's base."""
        return self._staleness[-1] if self._staleness else 0

    def step(self, tokens: int) -> None:
        """Call once after each optimizer step, with the tokens that step trained on: sends
        the fragments due at this step, then applies the replies due before the next."""
        step = self._step
        s = self.summary
        s.inner_steps += 1
        s.tokens += tokens
        s.wall_s = s.train_s = time.monotonic() - self._started
        if self._drain_at is not None and s.tokens >= self._drain_at[0]:
            self._drain(self._drain_at[1])
        self.book.count_step(tokens)
        self.telemetry.step(tokens, self.plan.num_fragments, self.pace.add(s.wall_s, s.tokens))
        self._send_due(step)
        self._step = step + 1
        self._record_snapshots()
        self._apply_due(self._step)
        self._share_with_slice()

    def event(self, kind: str, **fields) -> None:
        if self.events is not None:
            self.events.append(kind, time.time(), **fields)

    def begin_training(self) -> None:
        """The inner-step loop starts now: its state event, and the clock the step time
        pushes report is taken on (the slot a run's goodput counts starts at that event;
        a clock started earlier counts set-up time as steps)."""
        self.event("state", state="computing", step=0)
        self._started = time.monotonic()

    def close(self, reason: str = "finished", *, failed: bool = False) -> Summary:
        """Finish in-flight pushes (bounded), apply what arrived, leave. Idempotent.
        ``failed``: the training loop raised (a slice's hosts are not sent the last writes:
        their link closes and they fail too)."""
        if self._closed:
            return self.summary
        self._closed = True
        self.stop.set()
        self.event("state", state="draining", step=self.summary.inner_steps)
        try:
            if self.streamer is not None:
                if self._bootstrapped and not failed:
                    self._final_pushes(timeout_s=min(self.cfg.push_timeout_s, FINAL_PUSH_WAIT_S))
                self.streamer.close(timeout_s=min(self.cfg.push_timeout_s, 30.0))
                if hasattr(self, "book"):
                    self._apply_due(None)
                for sync in self._syncs.values():
                    sync.unfinished()
                self._syncs.clear()
                if self.slice is not None and self._bootstrapped and not failed:
                    self._share_with_slice()
        finally:
            if self.slice is not None:
                self.slice.close()
            if self.heartbeats is not None:
                self.heartbeats.stop_and_leave(reason, failed=failed)
        self._finish()
        return self.summary

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        self.close("finished" if error is None else f"stopped: {type(error).__name__}: {error}", failed=error is not None)

    # --- inside ------------------------------------------------------------------------

    def _stats(self) -> dict:
        s = self.summary
        return {"tokens": s.tokens, "inner_steps": s.inner_steps,
                "tokens_per_s": self.pace.rate, "version_lag": self.version_lag,
                "train_loss": s.train_loss, "eval_loss": s.eval_loss_final, "loss_unit": s.eval_unit,
                "counted_unix_ms": int(time.time() * 1000)}

    def _drain(self, reason: str, after_tokens: int = 0) -> None:
        """Leave (the training loop sees ``should_stop``), or with ``after_tokens`` once this
        learner's own token count reaches it: the step that reaches it is its last."""
        if after_tokens > self.summary.tokens:
            # The directive repeats on every heartbeat; a token budget may move its count.
            if self._drain_at is None or after_tokens != self._drain_at[0]:
                logger.warning("%s: will leave at %s tokens: %s", self.learner_id, f"{after_tokens:,}", reason)
                self._drain_at = (after_tokens, reason)
            return
        if self.stop.is_set():
            return
        logger.warning("%s: leaving: %s", self.learner_id, reason)
        self.stop_reason = reason
        self.stop.set()

    def _write(self, write: Write) -> None:
        """A global fragment into the model (and, leading a slice, into the next message)."""
        write_into(self.plan.gather(write.fragment, self.tensors), write)
        if self.slice is not None:
            self._writes.append(write)

    def _share_with_slice(self) -> None:
        """Leading a slice: the step's writes, state reads and stop, to the other hosts."""
        if self.slice is None:
            return
        self._stopping = self.stop.is_set()
        self.slice.share(SliceStep(self._writes, self._state_reads, self._stopping))
        self._writes, self._state_reads = [], 0

    def _host(self, fragment_id: int) -> list[torch.Tensor]:
        """The fragment's current values as fp32 host tensors (whatever the model's dtype)."""
        return self.device.fragment_to_host(self.plan, fragment_id, self.tensors)

    def _fp32(self, fragment_id: int, values: list[torch.Tensor]):
        """A fragment's values, encoded raw fp32 (what Initialize carries)."""
        return [encode(p.name, t, encoding="fp32") for p, t in zip(self.plan.fragments[fragment_id].pieces, values)]

    def _bootstrap(self) -> None:
        """Offer our values to shards that hold none yet, then start from the global state
        the shards hold, never from a private init."""
        by_shard = {s: [f.id for f in self.plan.owned_by(s, self.num_shards)] for s in range(self.num_shards)}

        # Every fragment read once, in order, whichever the shards turn out to need: on a
        # multi-host slice a read is a step every host takes (learner.slice).
        own = {f: self._host(f) for f in range(self.plan.num_fragments)}

        def encode_own(fragment_id: int):
            return self._fp32(fragment_id, own[fragment_id])

        for shard, fragments in by_shard.items():
            taken = self.streamer.initialize(shard, self.manifest_json, self.plan.plan_hash, fragments, encode_own,
                                             stop=self.stop, seed_wait_s=self._seed_wait_s)
            self.summary.initialized_fragments += taken
        # A shard still at values we hold (the run's seed, which every learner builds alike)
        # sends their version alone; one that has moved on from them, one int4 update (with
        # condensed replies): the full values stay off the wire.
        have = {f: values_digest(encode_own(f)) for f in own}
        updates = self.streamer.bootstrap(by_shard, have, stop=self.stop)
        fragments = {}
        for update in updates:
            values = update.apply_to(own[update.fragment])
            self._write(Write(update.fragment, values))
            fragments[update.fragment] = FragmentSync([v.clone() for v in values], update.version)
        self.device.reshard()
        missing = set(range(self.plan.num_fragments)) - set(fragments)
        if missing:
            raise FailedPrecondition(f"bootstrap returned no state for fragments {sorted(missing)}")
        self.book = SyncBook(fragments, self.run.overlap_steps)
        self.joined_in_progress = self.slice is None and any(s.base_version > 0 for s in fragments.values())
        self.event("bootstrapped", versions={str(f): s.base_version for f, s in sorted(fragments.items())})

        def encode_anchor(fragment_id: int):
            state = self.book.fragments[fragment_id]  # replaced, never mutated, by the training thread
            anchor, version = state.anchor, state.base_version
            return self._fp32(fragment_id, anchor), version

        self.streamer.reoffer = (self.manifest_json, self.plan.plan_hash, encode_anchor)
        logger.info("%s bootstrapped %d fragments at versions %s%s", self.learner_id, len(fragments),
                    {f: s.base_version for f, s in sorted(fragments.items())},
                    f" (initialised fragments {self.summary.initialized_fragments})" if self.summary.initialized_fragments else "")

    def _send_due(self, step: int) -> None:
        if self.streamer is None:
            return
        for fragment_id in fragments_due(step, self.offsets, self.run.sync_every_steps):
            self._send(fragment_id, step)

    def _final_pushes(self, timeout_s: float) -> None:
        """Leaving (a drain, the last step, SIGTERM): let the pushes in flight return, apply
        their replies (``rebase`` keeps what was trained since), then push each fragment
        trained since its last reply once more, so that no step is lost to the model. Not
        on a multi-host slice (reading a fragment there is a step every host takes), nor
        while a shard is down or in flight pushes do not return within ``timeout_s``: a
        leaving learner then offers its anchors instead (``Streamer.close``)."""
        if self.slice is not None or self.streamer.any_down() or not self.streamer.wait(timeout_s):
            return
        self._apply_due(None)
        if self.streamer.any_down():
            return
        for fragment_id, state in sorted(self.book.fragments.items()):
            if state.steps > 0 and state.sent is None:
                self._send(fragment_id, self._step, final=True)

    def _send(self, fragment_id: int, step: int, final: bool = False) -> None:
        started = time.perf_counter()
        state = self.book.fragments[fragment_id]
        host = self._host(fragment_id)
        keep = [t.detach().clone() for t in host] if self.run.reply_rule == "rebase" else None
        if not self.book.sending(fragment_id, step, keep):
            return  # its previous push is still out; the next send carries both
        shard = self.plan.fragments[fragment_id].owner(self.num_shards)
        sync = self.telemetry.start_sync(fragment_id, shard, state.base_version, step)
        encoded = self._encode_push(fragment_id, host)
        self.clock = self.clock.tick(self.learner_id)
        meta = PushMeta(
            self.learner_id, fragment_id, state.base_version, state.tokens, state.steps,
            self.summary.wall_s / max(self.summary.inner_steps, 1), self.clock, tuple(e.spec for e in encoded),
            snapshot_epoch=self.snapshot_epoch, final=final,
        )
        sync.phase("encode", time.perf_counter() - started)
        if self.streamer.submit(PushJob(shard, meta, encoded, state.anchor, step, sync)):
            self._syncs[(fragment_id, step)] = sync
        else:
            self.book.receive(Reply(fragment_id, -1, [], step, 0, failed=True))
        self.summary.blocked_s += time.perf_counter() - started

    def _encode_push(self, fragment_id: int, host: list[torch.Tensor]) -> list[EncodedTensor]:
        state = self.book.fragments[fragment_id]
        feedback = self.cfg.error_feedback and self.cfg.delta_codec != "fp32"
        encoded, left_out = encode_push(
            self.plan.fragments[fragment_id].pieces, host, state.anchor, state.residual,
            self.cfg.delta_codec, self.cfg.block_size, feedback, kept_for(self.cfg.delta_density, self.cfg.block_size),
        )
        if left_out is not None:  # only ever set with feedback on: the residual above is too
            self.book.quantized(fragment_id, left_out)
        return encoded

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
            sent = self.book.rebase_from(reply) if self.run.reply_rule == "rebase" else None
            self._write(Write(reply.fragment, reply.values, sent, self.run.merge_alpha))
            self.book.applied_reply(reply, rebased=sent is not None)
            self._staleness.append(reply.staleness)
            if (sync := self._syncs.pop((reply.fragment, reply.sent_step), None)) is not None:
                sync.applied(time.perf_counter() - started, reply.staleness)
        if due:
            self.device.reshard()
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
        """Record local state for each new marker: model, optimizer, the data cursor (the
        step), the per-fragment sync books and the clock. Pushes sent from now on carry
        the snapshot's epoch, so a shard can tell in-flight pushes (channel state) from
        later ones."""
        while True:
            try:
                snapshot_id, directory = self.markers.get_nowait()
            except queue.Empty:
                return
            if snapshot_id <= self.snapshot_epoch:
                continue  # the coordinator repeats a marker until it hears our report
            self.clock = self.clock.tick(self.learner_id)
            model_state, optimizer_state = host_state(self.model, self.optimizer)
            self._state_reads += 1
            state = {
                "learner_id": self.learner_id,
                "step": self._step,
                "model": model_state,
                "optimizer": optimizer_state,
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
            try:
                snapshot_store.write_file(snapshot_store.join(directory, name), data)
            except DilocoError as error:  # the snapshot fails (we never report); training goes on
                logger.error("%s could not record snapshot %d: %s", self.learner_id, snapshot_id, error)
                continue
            self.snapshot_epoch = snapshot_id
            self.on_recorded(snapshot_id, self.clock, [(name, len(data), hashlib.sha256(data).hexdigest())])
            logger.info("%s recorded snapshot %d at inner step %d", self.learner_id, snapshot_id, self._step)

    def _finish(self) -> None:
        s = self.summary
        s.wall_s = time.monotonic() - self._started
        s.tokens_per_s = s.tokens / s.train_s if s.train_s > 0 else 0.0
        if self.streamer is not None:
            st = self.streamer.stats
            s.pushes_sent, s.pushes_acked, s.pushes_dropped = st.pushes_sent, st.pushes_acked, st.pushes_dropped
            s.bytes_up, s.bytes_down, s.bytes_initialize = st.bytes_up, st.bytes_down, st.bytes_initialize
            if st.latency_s:
                s.sync_latency_s_p50 = sorted(st.latency_s)[len(st.latency_s) // 2]
        if hasattr(self, "book"):
            s.replies_applied, s.replies_late, s.sends_deferred = self.book.applied, self.book.late, self.book.deferred
        s.mean_staleness = sum(self._staleness) / len(self._staleness) if self._staleness else 0.0

    def anchors(self) -> dict[int, list[torch.Tensor]]:
        return {f: s.anchor for f, s in self.book.fragments.items()}
