"""The shard's runtime: one event loop owns the ``ShardCore`` (no locks).

It re-decides a fragment's round whenever something changes (a push, a membership
event, a grace deadline), runs the merge and outer step in a worker thread, swaps the
result in, answers every push waiting on that round and writes the event tape.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from opentelemetry.trace import SpanContext

from diloco.clock import VectorClock
from diloco.config import RunConfig
from diloco.codec import encode, values_digest
from diloco.errors import DeadlineExceeded, DilocoError, FailedPrecondition, InvalidArgument
from diloco.fragments import FragmentPlan
from diloco.manifest import Manifest
from diloco.files import atomic_write
from diloco.tape import TapeWriter
from diloco.wire import PushMeta
from diloco.syncer import snapshot as snapshot_files
from diloco.syncer.core import snapshot
from diloco.syncer.ceiling import VersionCeiling, ceiling_name
from diloco.syncer.core.bounds import AnchorOffer, choose_anchor
from diloco.syncer.core.mirrors import base_of, exact
from diloco.syncer.core.rounds import Close
from diloco.syncer.core.shard import (
    DUPLICATE, Ack, FragmentUpdate, Pending, PushPayload, RoundJob, ShardCore, Segment, compute_round, condense,
    condense_replies,
)
from diloco.syncer.pushlog import PushLogWriter
from diloco.syncer.telemetry import ShardTelemetry

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
"""In a shard's data directory: the run's model manifest, as the shard adopted it."""


def initial_name(fragment_id: int) -> str:
    """In a shard's data directory: a fragment's version-0 values (``diloco.syncer.snapshot`` format)."""
    return f"initial-F{fragment_id}.npz"


@dataclass
class Counters:
    pushes: int = 0
    duplicates: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    rounds: int = 0


@dataclass(frozen=True)
class MarkerResult:
    snapshot_id: int
    clock: VectorClock
    """The shard's clock when it recorded: its part of the cut."""
    files: tuple[snapshot_files.WrittenFile, ...]


# Called once a snapshot's channel state is complete, with every file the shard wrote.
SnapshotReporter = Callable[[MarkerResult], Awaitable[None]]


def _push_key(pending) -> tuple[str, int, int]:
    return pending.meta.learner_id, pending.meta.fragment, pending.meta.seq


@dataclass(frozen=True)
class RunModel:
    """The model an Initialize is checked against."""

    manifest_json: str
    plan: FragmentPlan
    initial_values: tuple[bytes, ...]
    """Pinned ``values_digest`` of each fragment's initial values (empty: not pinned)."""


RunModelSource = Callable[[], Awaitable[tuple[str, tuple[bytes, ...]]]]
"""Asks the coordinator for the run's (manifest JSON, pinned initial values' digests)."""


ANCHORS_HELD = 8
"""The most anchors of one fragment whose values a shard holds while it collects offers."""


@dataclass
class _AnchorOffers:
    """Anchors offered for one fragment of a shard back without its state: one per
    learner (the authenticated caller), its latest."""

    taken: asyncio.Future
    """Resolved with the learner whose anchor became the fragment's state."""
    offered: dict[str, tuple[int, float]] = field(default_factory=dict)
    """learner -> (version, norm) of its latest offer."""
    values: dict[str, list[np.ndarray]] = field(default_factory=dict)
    """The values of at most ``ANCHORS_HELD`` offers, by learner: when more come, the
    highest version's are dropped (``choose_anchor`` takes the newest near the lower
    median, never the newest of all when there are many)."""
    timer: asyncio.TimerHandle | None = None
    closed: bool = False
    """The window closed: the offers are being compared; later ones are not taken."""


@dataclass
class _Waiter:
    target_version: int
    base_version: int
    future: asyncio.Future = field(repr=False)
    learner_id: str | None = None
    final: bool = False


class ShardRuntime:
    def __init__(
        self,
        core: ShardCore,
        tape: TapeWriter | None = None,
        push_log: PushLogWriter | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        telemetry: ShardTelemetry | None = None,
        num_fragments: int | None = None,
        data_dir: Path | None = None,
        max_model_bytes: int = RunConfig.max_model_bytes,
    ) -> None:
        """``num_fragments``: the run's P, to plan from a manifest a learner sends (None: the
        core's plan, which must then be given). ``data_dir``: where the run's manifest and
        each fragment's initial values are kept (``diloco replay`` starts from them).
        ``max_model_bytes``: the run's maximum model size, checked before planning."""
        self.core = core
        self.max_model_bytes = max_model_bytes
        self.run_model: RunModelSource | None = None
        """Asks the coordinator for the run's manifest and pinned initial values (set when
        the shard follows one): Initialize then plans from the coordinator's manifest, never
        the learner's, and takes fresh initial values only with the pinned digest."""
        self._run_model: RunModel | None = None
        """The coordinator's answer, once it had a model (a run's model never changes)."""
        self._asking: asyncio.Task | None = None
        self._planning = asyncio.Semaphore(1)
        """Learners' manifests (no coordinator) are parsed and planned one at a time."""
        self.incarnation = secrets.token_hex(8)
        """This process's id, sent when following the coordinator and in marker replies: a
        new one tells the coordinator the shard restarted (``WatchMembershipRequest``)."""
        self.num_fragments = num_fragments if num_fragments is not None else core.plan.num_fragments
        self.data_dir = data_dir
        self.anchors_only = False
        """Set by ``expect_anchors``: fresh initial values are refused."""
        self.recovered: dict[int, tuple[str, int]] = {}
        """Fragments that came back from a learner's anchor: (learner, version)."""
        self.initializing: collections.Counter[int] = collections.Counter()
        """Initialize uploads in flight, by fragment (Status lists them)."""
        self._initial_digests: dict[int, bytes] = {}
        """``values_digest`` of each fragment's initial values file, once read."""
        self._anchor_offers: dict[int, _AnchorOffers] = {}
        self._choosing: set[asyncio.Task] = set()
        self.ceiling = VersionCeiling(data_dir / ceiling_name(core.cfg.shard_id) if data_dir is not None else None)
        """Above every version published of each fragment, kept in the data directory: an
        anchor above it is refused."""
        self.anchor_reference: dict[int, list[np.ndarray]] = {}
        """Each fragment's values in the shard's latest snapshot, when it restarted without
        its state and a snapshot exists: what offered anchors are compared with."""
        self.tape = tape
        self.push_log = push_log
        self.counters = Counters()
        self.telemetry = telemetry or ShardTelemetry(core.cfg.shard_id)
        # The span of each push waiting in a round, by (learner, fragment, seq): the
        # round's span links to those it merged.
        self._push_spans: dict[tuple[str, int, int], SpanContext] = {}
        self._monotonic = monotonic
        self._wall = wall
        self._waiters: dict[int, list[_Waiter]] = {}
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._rounds: set[asyncio.Task] = set()
        # Set while no round of the fragment is being applied: its tensors may be read.
        self._idle: dict[int, asyncio.Event] = {}
        self._track()
        self.accepting = True
        # Snapshots: rounds are held while the state is recorded; the newest marker's id
        # stamps every reply; the recorder collects the channel state.
        self._held = 0
        self.snapshot_epoch = 0
        self.recorder: snapshot.ChannelRecorder | None = None
        self.on_snapshot_recorded: SnapshotReporter | None = None
        self._markers: dict[int, asyncio.Future] = {}
        self._snapshot_tasks: set[asyncio.Task] = set()
        self._recorded: dict[int, tuple[MarkerResult, str]] = {}
        self._record(
            "start", shard=core.cfg.shard_id, fragments=sorted(core.fragments),
            plan=core.plan.plan_hash if core.plan is not None else "", config=asdict(core.cfg),
        )

    def _track(self) -> None:
        """Round bookkeeping for fragments that got their values since."""
        for fragment_id in self.core.fragments:
            if fragment_id not in self._idle:
                self._waiters[fragment_id] = []
                self._idle[fragment_id] = asyncio.Event()
                self._idle[fragment_id].set()

    # --- initial values --------------------------------------------------------------

    def model_state(self) -> str:
        """Where this shard's model stands, for Status: serving, empty or recovering, and
        the fragments that came back from a learner's anchor."""
        core = self.core
        missing = sorted(f.id for f in core.owned if f.id not in core.fragments)
        if core.plan is None or (missing and not self.anchors_only):
            return "empty: waiting for the first learner's values" + (f" (fragments {missing})" if core.plan else "")
        if missing:
            return (f"recovering: restarted without its state; fragments {missing} wait for a learner's anchor "
                    "(or restart with --restore)")
        if self.recovered:
            return "serving; recovered from anchors: " + ", ".join(
                f"fragment {f} from {who} at version {v}" for f, (who, v) in sorted(self.recovered.items()))
        return "serving"

    def plan_from(self, manifest_json: str) -> FragmentPlan:
        """The run's fragment plan from a manifest (parsed, bounded by the run's maximum model
        size: it came over the wire). Slow for a large manifest: off the event loop."""
        core = self.core
        if core.plan is not None and manifest_json == core.manifest_json:
            return core.plan
        return Manifest.from_json(manifest_json).check_size(self.max_model_bytes).plan(self.num_fragments)

    async def model_for_initialize(self, offered_manifest_json: str) -> RunModel:
        """The run's model an Initialize is checked against: the coordinator's manifest and
        pinned initial values when this shard follows a coordinator (the manifest the learner
        sent is not even parsed), else the learner's manifest. Parsing and planning run in
        a worker thread, one at a time: a manifest of 100,000 tensors does not stall the
        event loop (Status, pushes, membership) while it is planned."""
        if self.run_model is None:
            async with self._planning:
                plan = await asyncio.to_thread(self.plan_from, offered_manifest_json)
            return RunModel(offered_manifest_json, plan, ())
        if self._run_model is not None:
            return self._run_model
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask_coordinator())
        return await asyncio.shield(self._asking)

    async def _ask_coordinator(self) -> RunModel:
        manifest_json, initial_values = await self.run_model()
        if not manifest_json:
            raise FailedPrecondition("the coordinator holds no model for this run yet: a learner registers its model "
                                     "(RegisterModel) before it offers values")
        async with self._planning:
            plan = await asyncio.to_thread(self.plan_from, manifest_json)
        if initial_values and len(initial_values) != plan.num_fragments:
            raise FailedPrecondition(f"the coordinator pins the initial values of {len(initial_values)} fragments, "
                                     f"the run has {plan.num_fragments}")
        self._run_model = RunModel(manifest_json, plan, tuple(initial_values))
        return self._run_model

    async def check_initial_values(self, learner_id: str, model: RunModel, fragment_id: int, tensors) -> None:
        """Fresh initial values (not an anchor) of a run whose coordinator pins them must be
        the pinned ones, bit for bit (``values_digest``); else FailedPrecondition and the
        shard is left as it was."""
        if not model.initial_values:
            return
        digest = await asyncio.to_thread(values_digest, tensors)
        pinned = model.initial_values[fragment_id]
        if digest != pinned:
            raise FailedPrecondition(
                f"{learner_id}'s initial values of fragment {fragment_id} are not the run's pinned ones (sha256 "
                f"{digest.hex()[:16]}..., pinned {pinned.hex()[:16]}...): the coordinator pins the model its run config "
                "builds; a learner whose task builds other values (another seed, --init, a device-dependent init) "
                "cannot initialise the run")

    def expect_anchors(self, manifest_json: str) -> None:
        """This shard held the run's model in an earlier life and came back without its
        state: it plans from the manifest it kept, and takes a fragment's values only from
        a learner's anchor (the global values it last received), never a learner's fresh
        initial values, which would silently reset 1/S of a trained model."""
        self.core.adopt_plan(Manifest.from_json(manifest_json).plan(self.num_fragments), manifest_json)
        self.anchors_only = True
        self._record("recovering", plan=self.core.plan.plan_hash)
        logger.warning("shard %d restarted without its state: its fragments come back from the learners' anchors "
                       "(restart it with --restore to start from a snapshot instead)", self.core.cfg.shard_id)

    def accept_initial_values(self, reason: str) -> list[int]:
        """An operator's decision for a shard that restarted without its state and waits
        for anchors that will not come (no learner holds one, no snapshot will do): the
        fragments it lacks take the next learner's fresh initial values. Returns them."""
        core = self.core
        missing = sorted(f.id for f in core.owned if f.id not in core.fragments)
        if not self.anchors_only or not missing:
            raise FailedPrecondition(f"shard {core.cfg.shard_id} is not waiting for anchors ({self.model_state()}): "
                                     "nothing to accept")
        self.anchors_only = False
        self._record("accept_initial_values", fragments=missing, reason=reason)
        logger.warning("shard %d: an operator accepted fresh initial values for fragments %s (%s): they restart from "
                       "a learner's initial model", core.cfg.shard_id, missing, reason or "no reason given")
        return missing

    async def offer_anchor(self, learner_id: str, manifest_json: str, plan: FragmentPlan, fragment_id: int, values,
                           version: int) -> bool:
        """A learner's anchor of a fragment this shard lacks: offers are collected for
        ``anchor_window_s`` after the first one, or until every live learner has offered,
        one per learner (a second offer from the same learner replaces its first), and the
        newest that agrees with the others and the reference values
        (``diloco.syncer.core.bounds.choose_anchor``) becomes the fragment's state (True
        for its learner). An anchor above the fragment's version ceiling is refused
        (InvalidArgument). A fragment that has values takes none (False)."""
        if fragment_id in self.core.fragments:
            return False
        ceiling = self.ceiling.of(fragment_id)
        if ceiling is not None and version > ceiling:
            raise InvalidArgument(
                f"anchor version {version} of fragment {fragment_id} is above every version shard "
                f"{self.core.cfg.shard_id} has published (its ceiling, kept in its data directory: {ceiling})")
        loop = asyncio.get_running_loop()
        offers = self._anchor_offers.get(fragment_id)
        if offers is None:
            offers = self._anchor_offers[fragment_id] = _AnchorOffers(loop.create_future())
            logger.info("shard %d: collecting anchors of fragment %d for %.1f s", self.core.cfg.shard_id, fragment_id,
                        self.core.cfg.anchor_window_s)
            offers.timer = loop.call_later(self.core.cfg.anchor_window_s, self._take_newest_anchor,
                                           fragment_id, manifest_json, plan)
        norm = await asyncio.to_thread(lambda: math.sqrt(sum(float(np.dot(v.reshape(-1), v.reshape(-1))) for v in values)))
        if fragment_id in self.core.fragments:
            return False
        if self._anchor_offers.get(fragment_id) is not offers or offers.closed:  # closed while the norm was computed
            return await asyncio.shield(offers.taken) == learner_id
        if learner_id in offers.offered:
            logger.warning("shard %d: %s offered fragment %d again (version %d): its earlier offer is replaced",
                           self.core.cfg.shard_id, learner_id, fragment_id, version)
        offers.offered.pop(learner_id, None)
        offers.values.pop(learner_id, None)
        offers.offered[learner_id] = (version, norm)
        offers.values[learner_id] = values
        if len(offers.values) > ANCHORS_HELD:
            del offers.values[max(offers.values, key=lambda learner: offers.offered[learner][0])]
        if self.core.live and self.core.live <= set(offers.offered):
            offers.timer.cancel()  # everyone who could offer has: no newer anchor is coming
            loop.call_soon(self._take_newest_anchor, fragment_id, manifest_json, plan)
        winner = await asyncio.shield(offers.taken)
        return winner == learner_id

    def _take_newest_anchor(self, fragment_id: int, manifest_json: str, plan: FragmentPlan) -> None:
        offers = self._anchor_offers.get(fragment_id)
        if offers is None or offers.closed:  # closed already (every live learner had offered)
            return
        offers.closed = True
        task = asyncio.get_running_loop().create_task(self._choose_anchor(fragment_id, offers, manifest_json, plan))
        self._choosing.add(task)
        task.add_done_callback(self._choosing.discard)

    async def _choose_anchor(self, fragment_id: int, offers: _AnchorOffers, manifest_json: str, plan: FragmentPlan) -> None:
        try:
            held = list(offers.values)
            reference = self.anchor_reference.get(fragment_id)
            distances, snapshot_norm = await asyncio.to_thread(_distances, [offers.values[h] for h in held], reference)
            chosen = choose_anchor([AnchorOffer(*offers.offered[h], d) for h, d in zip(held, distances)], snapshot_norm)
            if chosen is None:
                raise FailedPrecondition(
                    f"no anchor offered for fragment {fragment_id} agrees with the others' versions, norms and values "
                    f"(compared with {'the latest snapshot' if snapshot_norm is not None else 'their median'}): "
                    f"{[(h, offers.offered[h][0], round(offers.offered[h][1], 3), round(d, 3)) for h, d in zip(held, distances)]}")
            learner_id = held[chosen]
            self.initialize(learner_id, manifest_json, plan, fragment_id, offers.values[learner_id], offers.offered[learner_id][0],
                            offered=sorted(([learner, version] for learner, (version, _) in offers.offered.items()),
                                           key=lambda o: o[1]))
        except Exception as error:  # every offer of the window gets the reason
            offers.taken.set_exception(error)
            return
        finally:
            self._anchor_offers.pop(fragment_id, None)
        offers.taken.set_result(learner_id)

    def initialize(self, learner_id: str, manifest_json: str, plan: FragmentPlan, fragment_id: int, values,
                   anchor_version: int | None = None, offered: list[tuple[str, int]] | None = None) -> bool:
        """A learner's values of a fragment that has none become its state (True): its own
        initial values as version 0, or its anchor at ``anchor_version`` (``offered``: every
        anchor offered in the window, for the tape). False when the fragment already has
        values."""
        core = self.core
        if anchor_version is None and self.anchors_only and fragment_id not in core.fragments:
            raise FailedPrecondition(
                f"shard {core.cfg.shard_id} held this run's model and restarted without its state: it takes a "
                "learner's anchor (the global values it last received) or --restore, not fresh initial values"
            )
        first_plan = core.plan is None
        core.adopt_plan(plan, manifest_json)
        if first_plan and self.data_dir is not None:
            atomic_write(self.data_dir / MANIFEST_FILE, manifest_json.encode())
        if not core.add_fragment(fragment_id, values, anchor_version or 0):
            return False
        self.ceiling.advance(fragment_id, anchor_version or 0)
        self._track()
        self._initial_digests.pop(fragment_id, None)
        if self.data_dir is not None:
            atomic_write(self.data_dir / initial_name(fragment_id), snapshot_files.dumps({"pieces": core.fragments[fragment_id].params}))
        source = "initial values" if anchor_version is None else f"anchor at version {anchor_version}"
        if anchor_version is not None:
            self.recovered[fragment_id] = (learner_id, anchor_version)
        self._record("initialize", fragment=fragment_id, learner=learner_id, plan=plan.plan_hash,
                     version=anchor_version or 0, source=source,
                     **({"offered": [list(o) for o in offered]} if offered else {}))
        log = logger.info if anchor_version is None else logger.warning
        log("shard %d: fragment %d takes %s's %s", core.cfg.shard_id, fragment_id, learner_id, source)
        self.telemetry.fragment_values(fragment_id, anchor_version or 0, "initial" if anchor_version is None else "anchor",
                                       learner_id)
        return True

    def now(self) -> float:
        return self._monotonic()

    def _record(self, kind: str, **fields) -> None:
        if self.tape is not None:
            self.tape.append(kind, self._wall(), **fields)

    def sent(self, learner_id: str, what: str, fragment: int, size: int) -> None:
        """A reply or a bootstrap to ``learner_id`` went out whole, ``size`` payload bytes:
        on the tape, so a run's downlink is counted from the shards whatever becomes of
        the learner (a killed one writes no summary)."""
        self._record("sent", learner=learner_id, what=what, fragment=fragment, bytes=size)

    # --- pushes ----------------------------------------------------------------------

    def push(
        self, meta: PushMeta, payload: PushPayload, wire_bytes: int, span: SpanContext | None = None
    ) -> tuple[Ack, asyncio.Future]:
        """Accept a decoded push; returns its ack and a future resolved with the update
        once the round it joined has closed. ``span``: the push's span, linked from the
        round that merges it."""
        from diloco.errors import Unavailable

        if not self.accepting:
            raise Unavailable(f"shard {self.core.cfg.shard_id} is shutting down")
        self.core.check_pusher(meta.learner_id)
        now = self._monotonic()
        ack = self.core.accept(meta, payload, wire_bytes, now)
        self.counters.bytes_received += wire_bytes
        if ack.outcome == DUPLICATE:
            self.counters.duplicates += 1
        else:
            self.counters.pushes += 1
            if span is not None and span.is_valid:
                self._push_spans[(meta.learner_id, meta.fragment, meta.seq)] = span
        self.telemetry.push_received(ack.outcome, meta.fragment, wire_bytes)
        self._record(
            "push",
            learner=meta.learner_id,
            fragment=meta.fragment,
            base_version=meta.base_version,
            tokens=meta.tokens,
            steps=meta.inner_steps,
            step_time_s=meta.step_time_s,
            bytes=wire_bytes,
            clock=dict(meta.clock.entries),
            outcome=ack.outcome,
            target_version=ack.target_version,
        )
        if self.push_log is not None and ack.outcome != DUPLICATE:
            self.push_log.append(meta, payload, wire_bytes)
        if self.recorder is not None:
            decision = self.recorder.observe(meta, payload, ack.outcome)
            logger.debug("snapshot %d: push from %s: %s", self.recorder.snapshot_id, meta.learner_id, decision.reason)
            self._maybe_finish_snapshot()
        future = asyncio.get_running_loop().create_future()
        self._waiters[meta.fragment].append(_Waiter(ack.target_version, meta.base_version, future, meta.learner_id, meta.final))
        self._resolve(meta.fragment)
        self._evaluate(meta.fragment)
        return ack, future

    # --- rounds ----------------------------------------------------------------------

    def _evaluate(self, fragment_id: int) -> None:
        timer = self._timers.pop(fragment_id, None)
        if timer is not None:
            timer.cancel()
        if self._held:
            return  # re-decided when the hold ends
        decision = self.core.decide(fragment_id, self._monotonic())
        if isinstance(decision, Close):
            self._close(fragment_id, decision)
            return
        logger.debug("fragment %d: %s", fragment_id, decision.reason)
        if decision.deadline is not None:
            delay = max(0.0, decision.deadline - self._monotonic())
            self._timers[fragment_id] = asyncio.get_running_loop().call_later(delay, self._evaluate, fragment_id)

    def _close(self, fragment_id: int, decision: Close) -> None:
        job = self.core.begin_round(fragment_id, decision, self._monotonic())
        self._idle[fragment_id].clear()
        task = asyncio.get_running_loop().create_task(self._run_round(job))
        self._rounds.add(task)
        task.add_done_callback(self._rounds.discard)

    async def _run_round(self, job: RoundJob) -> None:
        """Compute and apply one round. Whatever happens, the fragment is idle again at
        the end and its waiters are answered: a round never leaves a fragment busy."""
        try:
            await self._apply_round(job)
        except Exception:  # a bug after the merge: log it, drop the round, keep serving
            logger.exception("fragment %d: applying round %d failed", job.fragment.id, job.version)
            if self.core.fragments[job.fragment.id].applying:
                self.core.fail_round(job, "internal error while applying", self._monotonic())
        finally:
            if self.tape is not None:  # the round is on disk before any learner reads its reply
                self.tape.write_through()
            self._idle[job.fragment.id].set()
            self._resolve(job.fragment.id)
            self._evaluate(job.fragment.id)

    async def _apply_round(self, job: RoundJob) -> None:
        started = time.perf_counter()
        try:
            def compute() -> tuple[Segment, tuple]:
                update = compute_round(job, self.core.cfg)
                return update, condense_replies(job, self.core.cfg)

            update, (condensed, base) = await asyncio.to_thread(compute)
        except Exception as error:  # a bug or an input nothing at the door foresaw: keep serving
            logger.exception("fragment %d: round %d failed; its deltas are dropped", job.fragment.id, job.version)
            self.core.fail_round(job, f"{type(error).__name__}: {error}"[:200], self._monotonic())
            self._record("round_failed", fragment=job.fragment.id, version=job.version,
                         participants=[p.meta.learner_id for p in job.pushes], error=f"{type(error).__name__}: {error}"[:500])
            return
        merge_s = time.perf_counter() - started
        self.ceiling.advance(job.fragment.id, job.version)  # on disk before any learner can hold the version
        self.core.finish_round(job, update, self._monotonic(), condensed, base)
        self.counters.rounds += 1
        self._trace_round(job, merge_s)
        participants = [p.meta.learner_id for p in job.pushes]
        clipped = ", ".join(f"{p.meta.learner_id} x{c * g:.3g}" for p, c, (_, g) in zip(job.pushes, job.clip or (1.0,) * len(job.pushes), job.measured)
                            if c * g < 1)
        logger.info(
            "fragment %d -> version %d: %d learners, %s (merge %.1f ms)%s",
            job.fragment.id, job.version, len(participants), job.reason, merge_s * 1e3,
            f"; deltas cut to the others' norm and direction: {clipped}" if clipped else "",
        )
        self._record(
            "round",
            fragment=job.fragment.id,
            version=job.version,
            participants=participants,
            weights=list(job.weights),  # exact: replay re-applies them, the clips and the gates
            clip=list(job.clip),
            gate=[g for _, g in job.measured],
            **({"trust": list(job.trust)} if any(t != 1.0 for t in job.trust) else {}),
            participation=job.participation,
            **({"outer": [job.outer.decay, job.outer.look, job.outer.share]} if job.outer is not None else {}),
            quorum_s=round(job.quorum_s, 6),
            grace_s=round(job.grace_s, 6),
            merge_s=round(merge_s, 6),
            reason=job.reason,
            opened_t=self._wall() - (self._monotonic() - job.opened_at),
            closed_t=self._wall() - (self._monotonic() - job.closed_at),  # its weights were decided then
            clock=dict(self.core.clock.entries),
        )

    def _trace_round(self, job: RoundJob, merge_s: float) -> None:
        links = [self._push_spans.pop(key) for key in map(_push_key, job.pushes) if key in self._push_spans]
        # Pushes superseded by a newer one from the same learner were never merged: forget them.
        state = self.core.fragments[job.fragment.id]
        waiting = {_push_key(p) for p in (*state.open.values(), *state.next.values())}
        for key in [k for k in self._push_spans if k[1] == job.fragment.id and k not in waiting]:
            del self._push_spans[key]
        now_wall, now = self._wall(), self._monotonic()
        opened_ns = int((now_wall - (now - job.opened_at)) * 1e9)
        self.telemetry.round_closed(job, merge_s, links, opened_ns, int(now_wall * 1e9))

    def _resolve(self, fragment_id: int) -> None:
        state = self.core.fragments[fragment_id]
        if state.applying:
            return  # resolved when the round in flight finishes
        version = state.version
        still = []
        for waiter in self._waiters[fragment_id]:
            if waiter.future.done():
                continue
            if waiter.target_version <= version:
                waiter.future.set_result(self.core.update_for(fragment_id, waiter.base_version, waiter.learner_id, waiter.final))
            else:
                still.append(waiter)
        self._waiters[fragment_id] = still

    async def full(self, fragment_id: int, timeout_s: float = 60.0) -> Segment:
        """The full fp32 fragment, read only between rounds (rounds update it in place).
        A round that is not applied within ``timeout_s`` is reported, not waited on forever."""
        self.core.state_of(fragment_id)
        try:
            await asyncio.wait_for(self._idle[fragment_id].wait(), timeout_s)
        except asyncio.TimeoutError:
            state = self.core.fragments[fragment_id]
            logger.error("fragment %d: a read waited %.0f s for round %d to be applied (held %d, rounds in flight %d)",
                         fragment_id, timeout_s, state.version + 1, self._held, len(self._rounds))
            raise DeadlineExceeded(f"fragment {fragment_id} of shard {self.core.cfg.shard_id} has been busy with a "
                                   f"round for more than {timeout_s:.0f} s") from None
        return self.core.full(fragment_id)

    async def full_and_digest(self, fragment_id: int) -> tuple[Segment, bytes]:
        """``full`` and the ``values_digest`` of those values, hashed in a worker thread
        once per version."""
        full = await self.full(fragment_id)
        state = self.core.fragments[fragment_id]
        cached = state.digest_cache
        if cached is None or cached[0] != full.version:
            cached = (full.version, await asyncio.to_thread(values_digest, full.tensors))
            state.digest_cache = cached
        return full, cached[1]

    async def bootstrap(self, fragment_id: int, learner_id: str | None, have: bytes | None) -> FragmentUpdate:
        """A fragment for a learner that starts (``learner_id``; None for an export), which
        holds values of digest ``have`` (``values_digest``), if any: the version alone when
        those are the fragment's values; with condensed replies, one int4 update when they
        are the fragment's initial values (a learner joining a run in progress builds the
        seed model as every learner does: an eighth of the full values' bytes); else the
        full values. The learner's anchor is mirrored, for condensed replies."""
        core = self.core
        if have is None:
            full = await self.full(fragment_id)
        else:
            full, digest = await self.full_and_digest(fragment_id)
            if digest == have:
                if learner_id is not None:
                    core.mirror(fragment_id, learner_id, full)
                return FragmentUpdate(fragment_id, full.version, full.version, ())
            if learner_id is not None and core.mirrors_for(learner_id):
                initial = await asyncio.to_thread(self._initial_values, fragment_id, have)
                if initial is not None:
                    fragment = core.state_of(fragment_id).fragment
                    base = core.base_for(fragment_id, full)
                    mirror = exact(base_of(0, initial, copy=False))
                    size = max(p.numel for p in fragment.pieces)
                    tensors = await asyncio.to_thread(condense, fragment, base.values, mirror, base, np.empty(size, np.float32),
                                                      np.empty(size, np.float32), core.cfg)
                    mirror.version = full.version
                    core.set_mirror(fragment_id, learner_id, mirror)
                    return FragmentUpdate(fragment_id, 0, full.version, (Segment(full.version, "delta", tensors),))
        if learner_id is not None:
            core.mirror(fragment_id, learner_id, full)
        return FragmentUpdate(fragment_id, 0, full.version, (full,))

    def _initial_values(self, fragment_id: int, digest: bytes) -> list[np.ndarray] | None:
        """The fragment's initial values (``initial_name``, in the data directory) if their
        ``values_digest`` is ``digest``, else None. The digest is kept (the file is written
        once per fragment, as it takes its values)."""
        if self.data_dir is None or not (self.data_dir / initial_name(fragment_id)).exists():
            return None
        known = self._initial_digests.get(fragment_id)
        if known is not None and known != digest:
            return None
        pieces = self.core.state_of(fragment_id).fragment.pieces
        values = snapshot_files.loads(self.data_dir / initial_name(fragment_id))["pieces"]
        if len(values) != len(pieces) or any(v.shape != p.shape or v.dtype != np.float32 for v, p in zip(values, pieces)):
            return None
        if known is None:
            known = self._initial_digests[fragment_id] = values_digest(
                [encode(p.name, v, encoding="fp32") for p, v in zip(pieces, values)])
        if known != digest:
            return None
        return [np.array(v, dtype=np.float32) for v in values]

    def evaluate_all(self) -> None:
        for fragment_id in self.core.fragments:
            self._evaluate(fragment_id)

    # --- snapshots -------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def held(self):
        """Hold new rounds and wait for those in flight: inside, no fragment is being
        applied, so the whole shard can be read in one consistent step."""
        self._held += 1
        try:
            for event in self._idle.values():
                await event.wait()
            yield
        finally:
            self._held -= 1
            if not self._held:
                self.evaluate_all()

    async def marker(self, snapshot_id: int, directory: str, learners: list[str], clock: VectorClock) -> MarkerResult:
        """Record the shard's state for snapshot ``snapshot_id`` and start recording its
        channel state. A repeated marker (a retried RPC) gets the same answer."""
        if snapshot_id in self._markers:
            return await asyncio.shield(self._markers[snapshot_id])
        if snapshot_id <= self.snapshot_epoch:
            raise FailedPrecondition(f"marker for snapshot {snapshot_id} arrived after snapshot {self.snapshot_epoch}'s")
        future = self._markers[snapshot_id] = asyncio.get_running_loop().create_future()
        try:
            async with self.held():
                if snapshot_id <= self.snapshot_epoch:
                    raise FailedPrecondition(f"marker for snapshot {snapshot_id} arrived after snapshot {self.snapshot_epoch}'s")
                core = self.core
                core.receive(clock)
                state = snapshot.capture(core, snapshot_id, self._monotonic())
                cut = {f: s.version for f, s in core.fragments.items()}
                recorder = self.recorder = snapshot.ChannelRecorder(snapshot_id, cut, set(learners) - core.failed)
                self.snapshot_epoch = snapshot_id
                # An older snapshot still recording has failed at the coordinator: forget it.
                self._recorded = {i: r for i, r in self._recorded.items() if i == snapshot_id}
                self._markers = {i: f for i, f in self._markers.items() if i == snapshot_id}
                cut_clock = core.clock
                self._record("marker", snapshot=snapshot_id, clock=dict(cut_clock.entries), versions=cut, learners=sorted(learners))
            name = snapshot_files.state_name(core.cfg.shard_id)
            written = await asyncio.to_thread(snapshot_files.write, directory, name, state)
        except BaseException:
            if self.recorder is not None and self.recorder.snapshot_id == snapshot_id:
                self.recorder = None
            self._markers.pop(snapshot_id, None)
            future.cancel()  # a repeated marker waiting on this one fails too; the coordinator retries
            raise
        result = MarkerResult(snapshot_id, cut_clock, (written,))
        if self.snapshot_epoch == snapshot_id:  # not overtaken by a newer marker meanwhile
            self._recorded[snapshot_id] = (result, directory)
        future.set_result(result)
        logger.info("snapshot %d: state recorded at %s; channels open: %s", snapshot_id, cut_clock, sorted(recorder.open_channels))
        self._maybe_finish_snapshot()
        return result

    def _maybe_finish_snapshot(self) -> None:
        recorder = self.recorder
        if recorder is None or not recorder.done or recorder.snapshot_id not in self._recorded:
            return
        self.recorder = None
        task = asyncio.get_running_loop().create_task(self._finish_snapshot(recorder))
        self._snapshot_tasks.add(task)
        task.add_done_callback(self._snapshot_tasks.discard)

    async def _finish_snapshot(self, recorder: snapshot.ChannelRecorder) -> None:
        """Write the channel state and report. A failure here is only logged: the
        coordinator times the snapshot out and says so to the operator."""
        result, directory = self._recorded.pop(recorder.snapshot_id)
        shard_id = self.core.cfg.shard_id
        try:
            written = await asyncio.to_thread(
                snapshot_files.write_channel, directory, shard_id, recorder.snapshot_id, recorder.recorded
            )
            self._record("snapshot", snapshot=recorder.snapshot_id, channel_pushes=len(recorder.recorded), excluded=recorder.excluded)
            logger.info("snapshot %d: %d in-flight pushes recorded", recorder.snapshot_id, len(recorder.recorded))
            if self.on_snapshot_recorded is not None:
                await self.on_snapshot_recorded(MarkerResult(result.snapshot_id, result.clock, (*result.files, written)))
        except DilocoError as error:
            logger.warning("snapshot %d: cannot finish this shard's part: %s", recorder.snapshot_id, error)

    def restore(self, snapshot_id: int, state: dict, pushes: list[tuple[PushMeta, PushPayload, int]]) -> None:
        """Load a recorded state, then accept the pushes that were in flight at the cut."""
        now = self._monotonic()
        snapshot.restore(self.core, state, now)
        # The pushes the recorded state held in open rounds: this life merges them, as the
        # one that recorded the state would have (the checker counts them with the channel's).
        pending = [{"learner": learner, "fragment": f} for f, s in sorted(self.core.fragments.items()) for learner in s.open]
        self.anchors_only = False
        self._track()
        self.snapshot_epoch = snapshot_id
        acks = [(meta, self.core.accept(meta, payload, wire_bytes, now)) for meta, payload, wire_bytes in pushes]
        versions = {f: s.version for f, s in self.core.fragments.items()}
        for fragment_id, version in versions.items():
            self.ceiling.advance(fragment_id, version)
        self._record("restore", snapshot=snapshot_id, versions=versions, pending=pending,
                     channel=[{"learner": m.learner_id, "fragment": m.fragment, "outcome": a.outcome,
                               "target_version": a.target_version} for m, a in acks])
        for fragment_id, version in sorted(versions.items()):
            self.telemetry.fragment_values(fragment_id, version, "snapshot", str(snapshot_id))

    # --- membership ------------------------------------------------------------------

    def samples(self, fragments: list[int]) -> list[tuple[int, int, Pending]]:
        """The validator's samples (``ShardCore.sampled``); FAILED_PRECONDITION where the
        shard keeps none."""
        if not self.core.cfg.validator:
            raise FailedPrecondition(f"shard {self.core.cfg.shard_id} runs without a validator (SyncerConfig.validator)")
        return self.core.sampled(fragments)

    def score(self, scores: list[tuple[str, int, int, float | None, float]]) -> int:
        """The validator's (learner, fragment, seq, score, trust) judgements, each on the
        tape before it counts (replay re-applies the weights and clips they made). Returns
        how many named a fragment this shard holds."""
        if not self.core.cfg.validator:
            raise FailedPrecondition(f"shard {self.core.cfg.shard_id} runs without a validator (SyncerConfig.validator)")
        for learner_id, _, _, _, trust in scores:  # all or none
            if not (math.isfinite(trust) and 0.0 <= trust <= 1.0):
                raise InvalidArgument(f"trust of {learner_id!r} must be in [0, 1], got {trust}")
        applied = 0
        for learner_id, fragment_id, seq, score, trust in scores:
            if self.core.set_trust(learner_id, fragment_id, trust):
                applied += 1
                self._record("trust", learner=learner_id, fragment=fragment_id, seq=seq, score=score, trust=trust)
        if applied:
            logger.info("validator: %s", ", ".join(f"{l} f{f} x{t:.2f}" for l, f, _, _, t in scores if t < 1) or "all trusted")
        return applied

    def membership(self, event: str, learner_id: str) -> None:
        """event: joined | failed | left | draining. Re-decides every round: a failure can
        complete a round (every remaining live learner has pushed)."""
        if event == "joined":
            self.core.learner_joined(learner_id)
        elif event == "failed":
            self.core.learner_failed(learner_id)
        elif event == "draining":  # it may still push its last progress
            self.core.learner_draining(learner_id)
        elif event == "left":
            self.core.learner_left(learner_id)
        if self.recorder is not None and event in ("failed", "left"):
            self.recorder.learner_gone(learner_id)
            self._maybe_finish_snapshot()
        self._record("membership", learner=learner_id, event=event)
        for fragment_id in self.core.fragments:
            self._evaluate(fragment_id)

    def set_membership(self, live: set[str], failed: set[str], draining: set[str] = frozenset(),
                       left: set[str] = frozenset()) -> None:
        self.core.set_membership(live, failed, draining, left)
        if self.recorder is not None:
            for learner_id in self.recorder.open_channels - live:
                self.recorder.learner_gone(learner_id)
            self._maybe_finish_snapshot()
        self._record("membership", event="snapshot", live=sorted(live), failed=sorted(failed),
                     draining=sorted(self.core.draining))
        for fragment_id in self.core.fragments:
            self._evaluate(fragment_id)

    # --- shutdown --------------------------------------------------------------------

    async def drain(self) -> None:
        """Stop accepting, close every open round so its pushers get their replies, wait
        for rounds in flight, flush the tape."""
        self.accepting = False
        for task in self._snapshot_tasks:
            task.cancel()  # an unfinished snapshot fails at the coordinator's timeout
        await asyncio.gather(*list(self._choosing), return_exceptions=True)  # an anchor being chosen
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        while True:
            for fragment_id, state in self.core.fragments.items():
                if state.open and not state.applying:
                    self._close(fragment_id, Close("shard shutting down", 0.0))
            if not self._rounds:
                break
            await asyncio.gather(*list(self._rounds), return_exceptions=True)
        for timer in self._timers.values():
            timer.cancel()
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.future.done():
                    waiter.future.cancel()
        self._record("stop", rounds=self.counters.rounds, pushes=self.counters.pushes,
                     bytes_received=self.counters.bytes_received, bytes_sent=self.counters.bytes_sent,
                     drift_resets=self.core.drift_resets, drift_peak=round(self.core.drift_peak, 4))
        if self.tape is not None:
            self.tape.close()
            self.tape = None  # "stop" is its last record: replies still going out are not taped
        if self.push_log is not None:
            self.push_log.close()


def _distances(held: list[list[np.ndarray]], reference: list[np.ndarray] | None) -> tuple[list[float], float | None]:
    """Each offered anchor's distance from the reference values (a snapshot's, else the
    elementwise median of the offers), and the snapshot's norm (None: no snapshot)."""
    if reference is not None and [r.shape for r in reference] != [v.shape for v in held[0]]:
        logger.warning("the snapshot's values do not have the shapes of the anchors offered: compared with their median")
        reference = None
    snapshot_norm = None
    if reference is None:
        reference = [np.median(np.stack([v[k] for v in held]), axis=0) for k in range(len(held[0]))]
    else:
        snapshot_norm = math.sqrt(sum(float(np.dot(r.reshape(-1), r.reshape(-1))) for r in reference))

    def distance(values: list[np.ndarray]) -> float:
        return math.sqrt(sum(float(np.dot(d, d)) for d in ((v - r).reshape(-1) for v, r in zip(values, reference))))

    return [distance(values) for values in held], snapshot_norm
