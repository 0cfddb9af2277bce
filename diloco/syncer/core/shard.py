"""The state of one shard and every rule that changes it.

Pure: tensors and numbers in, results out; time is an argument. The async runtime
(``diloco.syncer.runtime``) owns one ``ShardCore`` on its event loop, runs ``compute_round`` in a
worker thread and swaps the result in with ``finish_round``; while a round is being
computed its fragment is ``applying`` and new pushes join the next round.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from diloco import auth
from diloco.clock import VectorClock
from diloco.codec import (
    EncodedTensor,
    TensorSpec,
    accumulate,
    check_payload,
    dot_and_sumsq,
    encode,
    dequantize_payload,
    encode_quantized,
    expected_byte_length,
    int4_scales,
    norm_of,
    sparse_tensor,
)
from diloco.codec.int4 import native
from diloco.codec.sparse import kept_for
from diloco.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from diloco.fragments import Fragment, FragmentPlan
from diloco.wire import MAX_VERSION, PushMeta
from diloco.syncer.config import SyncerConfig
from diloco.syncer.core.bounds import REFERENCE_DECAY, Influence, Push, gate
from diloco.syncer.core.merge import Contribution, merge_piece, raw_weight, token_weights
from diloco.syncer.core.mirrors import Base, Mirror, base_of, condense_sparse, exact, int4_rounding_sq, rebase, store
from diloco.syncer.core.outer import MomentumStep, momentum_step, outer_step_
from diloco.syncer.core.rounds import Close, RoundView, Timings, Wait, decide_round

ACCEPTED = "accepted"
ACCEPTED_NEXT_ROUND = "accepted_next_round"
DUPLICATE = "duplicate"
SAMPLES_KEPT = 16
"""With a validator, each fragment keeps the latest push of this many learners (the most
recent pushers): what the validator scores."""
PROBATION_TRUST = 0.0
"""What a learner's pushes of a fragment count for, in a run with a validator, before the
validator judged one of them (``ShardCore.trust_of``)."""
NEGLIGIBLE_RATIO = 1e-2
"""A learner whose latest push to a fragment, as merged (clipped and gated), is under this x
the largest push of a round (as clipped) is not among the live learners that round's step is
shared with: next to it, it moves nothing (a peer pushing zeros would halve a lone honest
learner's steps; one gated out cut three honest learners' steps to a quarter). Relative to the
round, so that honest deltas that all shrink late in a run keep their share."""
MAX_LEFT_KEPT = 4096
"""Learners that left, remembered (newest) so that their credentials, still valid until
they expire, no longer read the model; older ones are forgotten."""


@dataclass(frozen=True)
class PushPayload:
    """A push's deltas kept in their compact wire encoding (int4: 0.53 bytes/param), plus
    the per-piece norms RDA needs. A round decodes each delta once more while merging, so
    a shard never holds a round's worth of fp32 deltas."""

    tensors: tuple[EncodedTensor, ...]
    norms: tuple[float, ...]


def inspect_payload(specs: Sequence[TensorSpec], payload: bytes | memoryview) -> PushPayload:
    """Validate every piece of an unframed push (length, checksum, scales, finite values;
    see ``diloco.codec.decode``) and measure its norm. Heavy: call it off the event loop."""
    view, offset = memoryview(payload), 0
    tensors, norms = [], []
    for spec in specs:
        piece = view[offset : offset + spec.byte_length]
        offset += spec.byte_length
        check_payload(spec, piece)
        norms.append(norm_of(spec, piece))
        tensors.append(EncodedTensor(spec, piece))
    if offset != view.nbytes:
        raise InvalidArgument(f"push payload is {view.nbytes} bytes, its header announces {offset}")
    return PushPayload(tuple(tensors), tuple(norms))


@dataclass
class Pending:
    meta: PushMeta
    payload: PushPayload
    received_at: float
    wire_bytes: int


@dataclass(frozen=True)
class Ack:
    outcome: str
    target_version: int


@dataclass(frozen=True)
class Segment:
    version: int
    kind: str  # "delta" | "full"
    tensors: tuple[EncodedTensor, ...]


@dataclass(frozen=True)
class FragmentUpdate:
    """Brings a learner at ``base_version`` to ``version``: bit-identical to the shard's
    values (a chain, full values) or to the shard's mirror of its anchor (condensed)."""

    fragment: int
    base_version: int
    version: int
    segments: tuple[Segment, ...]
    close_reason: str = ""
    participants: int = 0


@dataclass
class FragmentState:
    fragment: Fragment
    params: list[np.ndarray]
    momentum: list[np.ndarray]
    residual: list[np.ndarray]
    chain: deque[Segment]
    version: int = 0
    open: dict[str, Pending] = field(default_factory=dict)
    next: dict[str, Pending] = field(default_factory=dict)
    opened_at: float | None = None
    quorum_at: float | None = None
    applying: bool = False
    last_seq: dict[str, int] = field(default_factory=dict)
    last_target: dict[str, int] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    last_reason: str = ""
    last_participants: int = 0
    last_round_at: float | None = None
    """When its last round was merged (the runtime's clock)."""
    full_cache: Segment | None = None
    digest_cache: tuple[int, bytes] | None = None
    """(version, ``values_digest`` of the fragment at it)."""
    norm_cache: tuple[int, float] | None = None
    """(version, the fragment's L2 norm at it): the bound a push's delta is held to."""
    merge_buffer: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))
    """The round's fp32 merge buffer, as large as the fragment's largest piece, kept across
    rounds: a fresh one per round cost a page fault per 4 KiB, a fifth of the shard's CPU."""
    mirrors: dict[str, Mirror] = field(default_factory=dict)
    """Each learner's anchor, for condensed replies (``diloco.syncer.core.mirrors``)."""
    base: Base | None = None
    """The newest base the mirrors are stored against, and the one before (which mirrors
    not answered since still use)."""
    previous_base: Base | None = None
    answers: int = 0
    """Condensed replies stored against the newest base."""
    scratch: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))
    """A second float32 buffer like ``merge_buffer``: a learner's anchor while its
    condensed reply is computed."""
    condensed: dict[str, tuple[int, Segment]] = field(default_factory=dict)
    """Condensed replies the last round made: learner -> (its base version, the update to
    ``version``)."""
    influence: Influence = field(default_factory=Influence)
    """The other learners' latest pushes, which bound a new push's delta and weight."""
    departed: dict[str, int] = field(default_factory=dict)
    """Learners whose final push was merged -> the version until which they still count
    among the live learners of this fragment's rounds: a round for each learner that had
    not pushed in it, the rest of the cycle their last push belonged to."""
    outer_share: float = 0.0
    """The participation the fragment's current momentum period has gathered
    (``diloco.syncer.core.outer.momentum_step``; delayed Nesterov only)."""
    reference: list[np.ndarray] = field(default_factory=list)
    """Where the fragment has been going: an average of the recent merged updates every
    pusher agreed with (``diloco.syncer.core.bounds``; zeros until the first round). 4 bytes per
    parameter."""
    samples: OrderedDict[str, Pending] = field(default_factory=OrderedDict)
    """With a validator (``SyncerConfig.validator``): the latest push of each of the
    ``SAMPLES_KEPT`` learners that pushed most recently, as it arrived."""
    trust: dict[str, float] = field(default_factory=dict)
    """The validator's latest judgement of each learner's pushes of this fragment: the
    factor its merge weight and delta are taken at (``ShardCore.trust_of``)."""


@dataclass(frozen=True)
class RoundJob:
    """Everything ``compute_round`` needs, captured on the event loop. The tensors are the
    fragment's own state, updated in place."""

    fragment: Fragment
    version: int
    pushes: tuple[Pending, ...]
    weights: tuple[float, ...]
    params: tuple[np.ndarray, ...]
    momentum: tuple[np.ndarray, ...]
    residual: tuple[np.ndarray, ...]
    merge_buffer: np.ndarray
    reason: str
    grace_s: float
    quorum_s: float
    opened_at: float
    closed_at: float
    participation: float = 1.0
    """Pushes merged with weight > 0 over the live learners (at most 1): the outer lr's
    factor when ``MergeConfig.scale_by`` is live."""
    outer: MomentumStep | None = None
    """How the round treats the momentum buffer (None: a Nesterov step, ``outer_momentum``)."""
    mirrors: tuple[tuple[str, int, Mirror], ...] = ()
    """(learner, its push's base version, its mirror) for each pusher whose anchor the
    shard mirrors at that base: ``condense_replies`` answers them."""
    base: Base | None = None
    """The base the round's mirrors are stored against; None: a fresh one of the round's
    values (``diloco.syncer.core.mirrors``)."""
    stale: tuple[Mirror, ...] = ()
    """Mirrors on a base older than the two kept: ``condense_replies`` moves them."""
    scratch: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.float32))
    clip: tuple[float, ...] = ()
    """The factor each push's delta is scaled by for its norm (``diloco.syncer.core.bounds``);
    empty: all 1."""
    agreement: tuple[float | None, ...] = ()
    """Per push, the others' median agreement its own is gated against (empty: none)."""
    reference: tuple[np.ndarray, ...] = ()
    """The fragment's reference direction, updated in place by ``compute_round``."""
    vouched: tuple[bool, ...] = ()
    """Per push, whether the reference was turned by another learner too
    (``Influence.vouches``): a push's cosine with a reference only its own learner turned is
    not measured. Empty: all."""
    gate: tuple[float, ...] = ()
    """Given (a replay): each push's gate, instead of measuring it."""
    trust: tuple[float, ...] = ()
    """Each push's validator trust (empty: all 1), already in ``weights`` and ``clip``: a
    round whose merged pushes are not all trusted in full does not turn the reference."""
    measured: list[tuple[float | None, float]] = field(default_factory=list)
    """Filled by ``compute_round``: each push's (agreement, gate)."""


def compute_round(job: RoundJob, cfg: SyncerConfig) -> Segment:
    """Merge, outer Nesterov step and int4 downlink update, in place on the fragment's
    state (the runtime keeps every reader away while the fragment is ``applying``).

    Memory: the state (params, momentum, residual: 12 bytes/param) plus the fragment's
    merge buffer, one piece at a time; deltas are accumulated straight from their int4 bytes. Returns the update segment: the int4 encoding
    of exactly what was added to the parameters."""
    m = cfg.merge
    gates = _gates(job)
    clip = tuple(c * g for c, g in zip(job.clip or (1.0,) * len(job.pushes), gates))
    follow = follows(job, gates)
    encoded = []
    for index, piece in enumerate(job.fragment.pieces):
        if piece.buffer:
            encoded.append(_merge_buffer_values(job, index, piece))
            continue
        delta = job.merge_buffer[: piece.numel]
        scale = 1.0
        if sum(job.weights) > 0:
            tensors = [p.payload.tensors[index] for p in job.pushes]

            def add(terms: list[tuple[int, float]], out: np.ndarray) -> float:
                return accumulate([(tensors[i], alpha * clip[i]) for i, alpha in terms], out, overwrite=True)

            norms = [p.payload.norms[index] * clip[i] for i, p in enumerate(job.pushes)]
            rda = m.merge == "rda" and not piece.embedding and not piece.buffer
            scale = merge_piece(add, norms, job.weights, rda, delta)
            momentum = job.momentum[index].reshape(-1)
        else:
            # Nothing with weight arrived (every pusher failed): no step, momentum untouched.
            delta.fill(0)
            momentum = np.zeros_like(delta)
        if follow:
            reference = job.reference[index].reshape(-1)
            follow_(reference, delta, np.float32((1 - REFERENCE_DECAY) * scale))
        lr = m.outer_lr * (job.participation if m.scale_by == "live" else 1.0)
        outer = job.outer or MomentumStep(m.outer_momentum, m.outer_momentum)
        packed, scales = outer_step_(
            delta, momentum, job.residual[index].reshape(-1), job.params[index].reshape(-1),
            scale, lr, outer.decay, outer.look, m.block_size, m.scale_dtype,
        )
        encoded.append(encode_quantized(piece.name, piece.shape, packed, scales, m.block_size, m.scale_dtype))
    return Segment(job.version, "delta", tuple(encoded))


def follows(job: RoundJob, gates: Sequence[float]) -> bool:
    """Whether the round turns the reference direction: when every push it merged counted
    in full (gate and trust), so that a learner whose pushes are cut cannot turn it towards
    its own direction."""
    trust = job.trust or (1.0,) * len(job.pushes)
    return bool(job.reference) and all(g == 1.0 and t == 1.0 for g, t, w in zip(gates, trust, job.weights) if w > 0)


def follow_(reference: np.ndarray, delta: np.ndarray, weight: np.float32) -> None:
    """``reference = reference * REFERENCE_DECAY + delta * weight`` in place (float32), in one
    pass in the C kernel (``scale_add``: the same float32 products and sum as numpy's)."""
    kernel = native()
    if kernel is not None:
        kernel.scale_add(reference, REFERENCE_DECAY, delta, weight)
        return
    reference *= REFERENCE_DECAY
    reference += weight * delta


def _gates(job: RoundJob) -> tuple[float, ...]:
    """Each push's gate (``diloco.syncer.core.bounds.gate``): given (a replay), or from its delta's
    cosine with the fragment's reference direction, measured here (one more decoding pass
    over each push with weight > 0), recorded in ``job.measured``."""
    if job.gate:
        job.measured[:] = [(None, g) for g in job.gate]
        return job.gate
    cosines: list[float | None] = [None] * len(job.pushes)
    pieces = [(i, p) for i, p in enumerate(job.fragment.pieces) if not p.buffer]
    reference_sq = sum(float(np.dot(job.reference[i].reshape(-1), job.reference[i].reshape(-1))) for i, _ in pieces) \
        if job.reference else 0.0
    if reference_sq > 0:
        for k, (push, weight) in enumerate(zip(job.pushes, job.weights)):
            if weight <= 0 or (job.vouched and not job.vouched[k]):
                continue
            dot = norm_sq = 0.0
            for i, piece in pieces:
                d, n = dot_and_sumsq(push.payload.tensors[i], job.reference[i].reshape(-1),
                                     job.merge_buffer[: piece.numel])
                dot, norm_sq = dot + d, norm_sq + n
            if norm_sq > 0:
                cosines[k] = dot / math.sqrt(norm_sq * reference_sq)
    agreement = job.agreement or (None,) * len(job.pushes)
    gates = tuple(gate(c, a) for c, a in zip(cosines, agreement))
    job.measured[:] = list(zip(cosines, gates))
    return gates


def condense_replies(job: RoundJob, cfg: SyncerConfig) -> tuple[dict[str, tuple[int, Segment]], Base | None]:
    """After ``compute_round``, in the same worker thread: for each mirrored pusher, one
    update from its anchor to the new global values (``condense``), its mirror stored
    against the round's base (``job.base``, or a fresh one of the new values), then the
    stale mirrors moved onto it. Returns (learner -> (base version, segment), that base)."""
    if not job.mirrors and not job.stale:
        return {}, None
    base = job.base or base_of(job.version, job.params, copy=True)
    replies = {}
    for learner, version, mirror in job.mirrors:
        tensors = condense(job.fragment, job.params, mirror, base, job.merge_buffer, job.scratch, cfg)
        mirror.version = job.version
        replies[learner] = (version, Segment(job.version, "delta", tensors))
    for mirror in job.stale:
        rebase(mirror, base, job.scratch)
    return replies, base


def condense(fragment: Fragment, target: Sequence[np.ndarray], mirror: Mirror, base: Base, scratch: np.ndarray,
             anchor: np.ndarray, cfg: SyncerConfig) -> tuple[EncodedTensor, ...]:
    """One update taking a learner's anchor (as ``mirror`` holds it) to the ``target``
    values (``MergeConfig.reply_codec``; buffers fp32), and ``mirror`` advanced by exactly
    what the learner will add (the codec's decode is the learner's; both add in float32),
    stored against ``base``. What the codec leaves out stays in the difference the next
    update sends (``mirror.rounding_sq``: int4's expected rounding, or exactly what a sparse
    reply left out). ``scratch``, ``anchor``: float32, as large as the largest piece."""
    m = cfg.merge
    kept = kept_for(m.reply_density, m.block_size)
    tensors = []
    rounding_sq = 0.0
    for index, piece in enumerate(fragment.pieces):
        goal = np.asarray(target[index]).reshape(-1)
        if m.reply_codec == "sparse" and not piece.buffer:
            payload, left_sq = condense_sparse(mirror, index, goal, base, anchor, block_size=m.block_size, kept=kept,
                                               scale_dtype=m.scale_dtype, name=piece.name)
            tensors.append(sparse_tensor(piece.name, piece.shape, payload, block_size=m.block_size,
                                         scale_dtype=m.scale_dtype, kept=kept))
            rounding_sq += left_sq
        else:
            values = mirror.anchor_into(index, anchor[: piece.numel])
            update = scratch[: piece.numel]
            np.subtract(goal, values, out=update)
            if piece.buffer:
                encoded = encode(piece.name, update.reshape(piece.shape), encoding="fp32")
            else:
                encoded = encode(piece.name, update.reshape(piece.shape), encoding="int4", block_size=m.block_size,
                                 scale_dtype=m.scale_dtype)
                dequantize_payload(encoded.payload, piece.numel, m.block_size, m.scale_dtype, out=update)
                rounding_sq += int4_rounding_sq(int4_scales(encoded.payload, piece.numel, m.block_size,
                                                            m.scale_dtype), piece.numel, m.block_size)
            np.add(values, update, out=values)
            store(mirror, index, values, base)
            tensors.append(encoded)
    mirror.base, mirror.rounding_sq = base, rounding_sq
    return tuple(tensors)


def _merge_buffer_values(job: RoundJob, index: int, piece) -> EncodedTensor:
    """A buffer piece (running statistics): learners push their values, not deltas, and
    the global value becomes their weighted mean, a convex combination (a variance stays
    non-negative; deltas against stale anchors, or int4 rounding, could cross zero). The
    update is sent in fp32 and added exactly as the learners add it: bit-identical."""
    params = job.params[index].reshape(-1)
    update = job.merge_buffer[: piece.numel]
    total = sum(job.weights)
    if total > 0:
        tensors = [p.payload.tensors[index] for p in job.pushes]
        accumulate([(tensors[i], w / total) for i, w in enumerate(job.weights) if w], update, overwrite=True)
        np.subtract(update, params, out=update)
    else:
        update.fill(0)
    np.add(params, update, out=params)
    return encode(piece.name, update.reshape(piece.shape), encoding="fp32")


def _owned_copy(values) -> np.ndarray:
    """A float32 C-contiguous copy the shard owns, of a numpy array or a CPU tensor."""
    if not isinstance(values, np.ndarray):
        values = values.detach().cpu().numpy()
    return np.array(values, dtype=np.float32, order="C", copy=True)


class ShardCore:
    def __init__(
        self, cfg: SyncerConfig, plan: FragmentPlan | None = None,
        initial: Mapping[int, Sequence[np.ndarray]] | None = None, manifest_json: str = "",
    ) -> None:
        """``plan`` None: the shard holds no model yet, until a learner initialises it
        (``initialize``) or a snapshot is restored. ``initial``: each owned fragment's
        pieces (numpy arrays, or CPU tensors, which are copied into numpy arrays: the
        shard's state is numpy, and torch never has to be loaded in a shard process)."""
        self.cfg = cfg
        self.plan: FragmentPlan | None = None
        self.manifest_json = ""
        self.process = f"S{cfg.shard_id}"
        self.clock = VectorClock()
        self.live: set[str] = set()
        self.failed: set[str] = set()
        self.draining: set[str] = set()
        """Learners the coordinator is draining: they may still push (their last progress
        is merged), but no round waits for them."""
        self.left: dict[str, None] = {}
        """The newest ``MAX_LEFT_KEPT`` learners that left, oldest first."""
        self.fragments: dict[int, FragmentState] = {}
        self.pushes_received = 0
        self.rounds_closed = 0
        self.drift_resets = 0
        """Pushes answered with full values because their mirror had drifted."""
        self.drift_peak = 0.0
        """The largest drift a mirror reached after a reply, over that reply's int4
        rounding (squared norms; 1 sends the full values next)."""
        if plan is not None:
            self.adopt_plan(plan, manifest_json)
            for fragment in self.owned:
                if initial is None or fragment.id not in initial:
                    raise InvalidArgument(f"no initial parameters for fragment {fragment.id}")
                self.add_fragment(fragment.id, initial[fragment.id])

    @property
    def owned(self) -> list[Fragment]:
        return self.plan.owned_by(self.cfg.shard_id, self.cfg.num_shards) if self.plan is not None else []

    def adopt_plan(self, plan: FragmentPlan, manifest_json: str) -> None:
        """Fix the shard's plan (from the run's manifest); a different one is refused."""
        if self.plan is not None:
            if plan.plan_hash != self.plan.plan_hash:
                raise FailedPrecondition(
                    f"shard {self.cfg.shard_id} plans from another model (plan {self.plan.plan_hash[:12]}, "
                    f"this one {plan.plan_hash[:12]}): every learner of a run trains the same model"
                )
            return
        self.plan, self.manifest_json = plan, manifest_json

    def add_fragment(self, fragment_id: int, values: Sequence[np.ndarray], version: int = 0) -> bool:
        """Give an owned fragment its values at ``version`` (0 for a run's initial values; a
        learner's anchor version when the shard came back without its state); False if the
        fragment already has values."""
        if self.plan is None:
            raise FailedPrecondition(f"shard {self.cfg.shard_id} has no fragment plan yet")
        if not 0 <= version < MAX_VERSION:
            raise InvalidArgument(f"version {version} of fragment {fragment_id} is out of range (< 2**53)")
        if not 0 <= fragment_id < self.plan.num_fragments:
            raise InvalidArgument(f"fragment {fragment_id} is not in the plan ({self.plan.num_fragments} fragments)")
        fragment = self.plan.fragments[fragment_id]
        if fragment.owner(self.cfg.num_shards) != self.cfg.shard_id:
            raise FailedPrecondition(f"fragment {fragment_id} is owned by shard {fragment.owner(self.cfg.num_shards)}")
        if fragment_id in self.fragments:
            return False
        params = [_owned_copy(t) for t in values]
        shapes = [tuple(t.shape) for t in params]
        if shapes != [p.shape for p in fragment.pieces]:
            raise InvalidArgument(f"initial values of fragment {fragment_id} have shapes {shapes}, the plan {[p.shape for p in fragment.pieces]}")
        if not all(np.isfinite(t).all() for t in params):
            raise InvalidArgument(f"initial values of fragment {fragment_id} are not all finite")
        self.fragments[fragment_id] = FragmentState(
            fragment=fragment,
            params=params,
            momentum=[np.zeros_like(p) for p in params],
            residual=[np.zeros_like(p) for p in params],
            chain=deque(maxlen=self.cfg.merge.update_chain_length),
            merge_buffer=np.empty(max(p.numel for p in fragment.pieces), dtype=np.float32),
            version=version,
            reference=[np.zeros(0 if piece.buffer else p.size, dtype=np.float32)  # buffers carry values, not deltas
                       for piece, p in zip(fragment.pieces, params)],
        )
        return True

    # --- validation -------------------------------------------------------------------

    def state_of(self, fragment_id: int) -> FragmentState:
        if self.plan is None:
            raise FailedPrecondition(f"shard {self.cfg.shard_id} holds no model yet: the first learner initialises it")
        if not 0 <= fragment_id < self.plan.num_fragments:
            raise InvalidArgument(f"fragment {fragment_id} is not in the plan ({self.plan.num_fragments} fragments)")
        state = self.fragments.get(fragment_id)
        if state is None:
            owner = self.plan.fragments[fragment_id].owner(self.cfg.num_shards)
            if owner == self.cfg.shard_id:
                raise FailedPrecondition(f"fragment {fragment_id} has no value yet: the first learner initialises it")
            raise FailedPrecondition(f"fragment {fragment_id} is owned by shard {owner}, not shard {self.cfg.shard_id}")
        return state

    def check_pusher(self, learner_id: str) -> None:
        """A learner marked failed may no longer push: checked before its payload is read,
        and again once it has arrived (an upload can outlast its learner's lease across a
        cut link)."""
        if learner_id in self.failed:
            raise PermissionDenied(f"{learner_id} was marked failed or removed: it may no longer push")

    def check_header(self, meta: PushMeta) -> None:
        """Reject a push before reading its payload. Raises; changes nothing."""
        state = self.state_of(meta.fragment)
        cfg = self.cfg
        self.check_pusher(meta.learner_id)
        if meta.learner_id not in self.live and meta.learner_id not in self.draining:
            raise FailedPrecondition(
                f"{meta.learner_id} is not a live member of the run as this shard knows it "
                f"({len(self.live)} live learners): join the coordinator first"
            )
        if meta.seq < 1:
            raise InvalidArgument(f"push clock lacks the learner's own entry {meta.learner_id!r}")
        if not (math.isfinite(meta.step_time_s) and meta.step_time_s >= 0):
            raise InvalidArgument(f"step time must be a finite number >= 0, got {meta.step_time_s}")
        if meta.tokens > cfg.max_tokens_per_push or meta.inner_steps > cfg.max_steps_per_push:
            raise InvalidArgument(
                f"absurd counters: {meta.tokens} tokens in {meta.inner_steps} inner steps "
                f"(limits {cfg.max_tokens_per_push} tokens, {cfg.max_steps_per_push} steps)"
            )
        if meta.tokens < meta.inner_steps:
            raise InvalidArgument(f"{meta.tokens} tokens cannot come from {meta.inner_steps} inner steps")
        if meta.base_version > state.version:
            raise FailedPrecondition(
                f"base version {meta.base_version} is in the future: fragment {meta.fragment} is at version {state.version}"
            )
        pieces = state.fragment.pieces
        if len(meta.specs) != len(pieces):
            raise InvalidArgument(f"fragment {meta.fragment} has {len(pieces)} tensors, the push has {len(meta.specs)}")
        for spec, piece in zip(meta.specs, pieces):
            if spec.name != piece.name:
                raise InvalidArgument(f"expected tensor {piece.name!r}, got {spec.name!r}")
            if tuple(spec.shape) != piece.shape:
                raise InvalidArgument(f"tensor {piece.name!r}: shape {list(spec.shape)} != plan {list(piece.shape)}")
            if spec.dtype != "float32":
                raise InvalidArgument(f"tensor {piece.name!r}: dtype {spec.dtype!r}, expected 'float32'")
            if piece.buffer and spec.encoding != "fp32":
                raise InvalidArgument(f"tensor {piece.name!r} is a buffer: its values travel in fp32, not {spec.encoding}")
            if spec.encoding != "fp32" and spec.block_size != cfg.merge.block_size:
                raise InvalidArgument(
                    f"tensor {piece.name!r}: block size {spec.block_size} != shard's {cfg.merge.block_size}"
                )
            if spec.encoding == "sparse" and not 1 <= spec.kept <= spec.block_size:
                raise InvalidArgument(f"tensor {piece.name!r}: {spec.kept} values kept per block of {spec.block_size}")
            expected = expected_byte_length(spec.shape, spec.encoding, spec.block_size, spec.scale_dtype, spec.kept)
            if spec.byte_length != expected:
                raise InvalidArgument(
                    f"tensor {piece.name!r}: byte length {spec.byte_length} != {expected} for its shape and encoding"
                )
        if meta.payload_bytes > cfg.max_push_bytes:
            raise ResourceExhausted(f"push of {meta.payload_bytes} bytes exceeds the limit of {cfg.max_push_bytes}")

    # --- pushes and rounds -----------------------------------------------------------

    def accept(self, meta: PushMeta, payload: PushPayload, wire_bytes: int, now: float) -> Ack:
        """Add a validated push (``check_header``, then ``inspect_payload``) to its round.
        Idempotent on (learner, fragment, seq)."""
        state = self.state_of(meta.fragment)
        if len(payload.tensors) != len(state.fragment.pieces):
            raise InvalidArgument(f"push carries {len(payload.tensors)} tensors, fragment {meta.fragment} has {len(state.fragment.pieces)}")
        if not all(math.isfinite(n) for n in payload.norms):
            raise InvalidArgument(f"push from {meta.learner_id} has a non-finite norm")
        delta_norm = math.sqrt(sum(n * n for n in payload.norms))
        bound = self.cfg.max_delta_ratio * max(self.fragment_norm(state), 1.0)
        if not delta_norm <= bound:
            raise InvalidArgument(
                f"push from {meta.learner_id}: delta norm {delta_norm:.3g} exceeds {self.cfg.max_delta_ratio:g} x the "
                f"fragment's norm ({bound:.3g}); refused"
            )
        self.receive(meta.clock)
        if meta.seq <= state.last_seq.get(meta.learner_id, 0):
            return Ack(DUPLICATE, state.last_target.get(meta.learner_id, state.version))
        state.timings.observe("step_time_s", meta.step_time_s, self.cfg.rounds.ema_factor)
        pending = Pending(meta, payload, now, wire_bytes)
        self.pushes_received += 1
        if self.cfg.validator:
            state.samples.pop(meta.learner_id, None)
            state.samples[meta.learner_id] = pending
            while len(state.samples) > SAMPLES_KEPT:
                state.samples.popitem(last=False)
        state.last_seq[meta.learner_id] = meta.seq
        if state.applying:
            # A newer push from the same learner supersedes its older one: deltas are
            # cumulative since the anchor.
            state.next[meta.learner_id] = pending
            target, outcome = state.version + 2, ACCEPTED_NEXT_ROUND
        else:
            self._join_open(state, pending, now)
            target, outcome = state.version + 1, ACCEPTED
        state.last_target[meta.learner_id] = target
        return Ack(outcome, target)

    @staticmethod
    def _measure(state: FragmentState, pending: Pending) -> Push:
        """What ``Influence`` weighs of a push: its delta's norm (buffers, which carry values
        rather than deltas, left out), its raw weight and when it arrived."""
        norm = math.sqrt(sum(n * n for piece, n in zip(state.fragment.pieces, pending.payload.norms) if not piece.buffer))
        meta = pending.meta
        return Push(meta.learner_id, norm, raw_weight(meta.tokens, meta.inner_steps), pending.received_at)

    def fragment_norm(self, state: FragmentState) -> float:
        """The fragment's L2 norm, computed once per version (while a round is applying,
        the last computed one)."""
        if state.norm_cache is None or (state.norm_cache[0] != state.version and not state.applying):
            norm = math.sqrt(sum(float(np.dot(p.reshape(-1), p.reshape(-1))) for p in state.params))
            state.norm_cache = (state.version, norm)
        return state.norm_cache[1]

    def _join_open(self, state: FragmentState, pending: Pending, now: float) -> None:
        if not state.open:
            state.opened_at = pending.received_at
        state.open[pending.meta.learner_id] = pending
        if state.quorum_at is None and len(state.open) >= self.cfg.rounds.quorum:
            state.quorum_at = now
            state.timings.observe("quorum_time_s", now - (state.opened_at or now), self.cfg.rounds.ema_factor)

    def view(self, fragment_id: int) -> RoundView:
        state = self.state_of(fragment_id)
        return RoundView(
            pushed=frozenset(state.open),
            live=frozenset(self.live - self.failed),
            opened_at=state.opened_at or 0.0,
            quorum_at=state.quorum_at,
            grace_s=state.timings.grace_s(self.cfg.rounds),
            draining=frozenset(self.draining - self.failed),
        )

    def decide(self, fragment_id: int, now: float) -> Close | Wait:
        state = self.state_of(fragment_id)
        if state.applying:
            return Wait("a round is being applied", None)
        return decide_round(self.view(fragment_id), now, self.cfg.rounds)

    def begin_round(self, fragment_id: int, decision: Close, now: float) -> RoundJob:
        state = self.state_of(fragment_id)
        if state.applying or not state.open:
            raise FailedPrecondition(f"fragment {fragment_id} has no round to close")
        pushes = tuple(state.open[k] for k in sorted(state.open))
        counted = [p for p in pushes if p.meta.learner_id not in self.failed]
        measured = [self._measure(state, p) for p in counted]
        bounds = {} if math.isinf(self.cfg.robust_multiple) else dict(zip(
            (p.meta.learner_id for p in counted),
            state.influence.bounds(measured, self.cfg.robust_multiple, lambda: self.fragment_norm(state),
                                   frozenset((self.live | self.draining) - self.failed))))
        trust = tuple(self.trust_of(state, p.meta.learner_id) for p in pushes)
        # A learner the validator doubts vouches for no one: only trusted pushes are references.
        state.influence.record([m for m in measured if self.trust_of(state, m.learner) == 1.0],
                               unvouched={learner for learner, bound in bounds.items() if bound.unvouched})
        contributions = [
            Contribution(
                p.meta.learner_id,
                p.meta.tokens,
                p.meta.inner_steps,
                state.version - p.meta.base_version,
                failed=p.meta.learner_id in self.failed,
                weight_cap=bounds[p.meta.learner_id].weight_cap if p.meta.learner_id in bounds else math.inf,
            )
            for p in pushes
        ]
        weights = [w * t for w, t in zip(token_weights(contributions, self.cfg.merge.staleness_lambda), trust)]
        merged = sum(1 for w in weights if w > 0)
        # Draining learners still count: their last pushes arrive one round at a time, each
        # a learner's share of the run's progress, not all of it. So does a learner whose
        # final push was merged, for the rest of that cycle (a round per learner that stays):
        # at the end of a run the last learner's final push was merged at 4x its share once
        # the others had left, and the final eval came out worse than an eighth before it.
        # At a run's end every member is draining (a met token budget, an operator draining
        # them all) and they leave one by one, each after its own allotment: those gone keep
        # their share until the last has left, or it trains on alone at the whole step
        # (measured: a longer run's final eval 2.005 against 1.930 an eighth before, its last
        # learner merged alone at participation 1 for its final 0.8 s).
        ending = bool(self.draining - self.failed) and not (self.live - self.failed)
        if not ending:
            state.departed = {d: until for d, until in state.departed.items() if until > state.version}
        # Members whose pushes count for nothing (distrusted, gated out, or pushing nothing) are not among
        # the live learners a round's step is shared with: three Sybils, or one peer pushing
        # zeros, would otherwise cut every honest round's step to a fifth or a half.
        largest = max((m.norm * (bounds[m.learner].clip if m.learner in bounds else 1.0) for m in measured), default=0.0)
        idle = state.influence.negligible(NEGLIGIBLE_RATIO * largest) \
            | {learner for learner in self.live | self.draining if self.trust_of(state, learner) == 0.0}
        members = (((self.live | self.draining) - self.failed) | set(state.departed)) - idle
        pushed = {p.meta.learner_id for p, w in zip(pushes, weights) if w > 0} - idle
        live = len(members | pushed)
        for p, w in zip(pushes, weights):
            if p.meta.final and w > 0:
                state.departed[p.meta.learner_id] = state.version + len(members - pushed) + 1
        opened = state.opened_at if state.opened_at is not None else now
        quorum_s = (state.quorum_at - opened) if state.quorum_at is not None else now - opened
        # A drifted mirror is not answered: its learner gets the full values (``_condensed``).
        answerable = [(p.meta.learner_id, p.meta.base_version, mirror) for p in pushes
                      if not p.meta.final and (mirror := state.mirrors.get(p.meta.learner_id)) is not None
                      and mirror.version == p.meta.base_version]
        mirrored = tuple(a for a in answerable if not a[2].drifted)
        self.drift_resets += len(answerable) - len(mirrored)
        # A fresh base once as many replies as there are mirrors were stored against the
        # newest (``syncer.core.mirrors``).
        fresh = state.base is None or state.answers >= len(state.mirrors)
        base = None if fresh else state.base
        kept = [state.base] if fresh else [state.base, state.previous_base]
        if state.scratch.size < state.merge_buffer.size:
            state.scratch = np.empty_like(state.merge_buffer)
        job = RoundJob(
            fragment=state.fragment,
            version=state.version + 1,
            pushes=pushes,
            weights=tuple(weights),
            params=tuple(state.params),
            momentum=tuple(state.momentum),
            residual=tuple(state.residual),
            merge_buffer=state.merge_buffer,
            reason=decision.reason,
            grace_s=decision.grace_s,
            quorum_s=max(quorum_s, 0.0),
            opened_at=opened,
            closed_at=now,
            participation=merged / live if live else 1.0,
            outer=momentum_step(self.cfg.merge.outer_optimizer, self.cfg.merge.outer_momentum, state.outer_share,
                                merged / live if live else 1.0),
            clip=tuple((bounds[p.meta.learner_id].clip if p.meta.learner_id in bounds else 1.0) * t
                       for p, t in zip(pushes, trust)),
            trust=trust,
            agreement=tuple(bounds[p.meta.learner_id].agreement if p.meta.learner_id in bounds else None for p in pushes),
            reference=tuple(state.reference),
            vouched=tuple(state.influence.vouches(p.meta.learner_id) for p in pushes),
            mirrors=mirrored,
            base=base,
            stale=tuple(m for m in state.mirrors.values() if m.base is not base and m.base not in kept
                        and all(m is not n for _, _, n in mirrored)),
            scratch=state.scratch,
        )
        state.applying = True
        state.open = {}
        state.opened_at = None
        state.quorum_at = None
        return job

    def finish_round(self, job: RoundJob, update: Segment, now: float,
                     condensed: Mapping[str, tuple[int, Segment]] | None = None, base: Base | None = None) -> None:
        """``condensed``, ``base``: ``condense_replies``'s answers to the round's mirrored
        pushers, and the base their mirrors are stored against."""
        state = self.state_of(job.fragment.id)
        if not state.applying or job.version != state.version + 1:
            raise FailedPrecondition(f"round for version {job.version} does not fit fragment at {state.version}")
        state.version = job.version
        state.chain.append(update)
        if job.outer is not None:
            state.outer_share = job.outer.share
        # A mirror replaced while the round ran (the learner bootstrapped again) keeps its own.
        mirrored = {learner: mirror for learner, _, mirror in job.mirrors if state.mirrors.get(learner) is mirror}
        state.condensed = {learner: reply for learner, reply in (condensed or {}).items() if learner in mirrored}
        if base is not None:
            self._use_base(state, base)
            state.answers += len(mirrored)
        for mirror in mirrored.values():
            if mirror.rounding_sq > 0:
                self.drift_peak = max(self.drift_peak, mirror.drift_sq / mirror.rounding_sq)
        state.full_cache = None
        state.applying = False
        state.last_reason = job.reason
        state.last_participants = len(job.pushes)
        state.last_round_at = now
        for push, clip, (cos, gated) in zip(job.pushes, job.clip, job.measured):
            state.influence.agreed(push.meta.learner_id, cos, clip * gated)
        if follows(job, [gated for _, gated in job.measured]):
            state.influence.turned(p.meta.learner_id for p, w in zip(job.pushes, job.weights) if w > 0)
        state.timings.observe("sync_time_s", now - job.closed_at, self.cfg.rounds.ema_factor)
        self.rounds_closed += 1
        self.clock = self.clock.tick(self.process)
        waiting, state.next = state.next, {}
        for pending in waiting.values():
            self._join_open(state, pending, now)

    def fail_round(self, job: RoundJob, reason: str, now: float) -> None:
        """A round whose computation failed: the fragment must keep serving. Its version
        moves on with no update in the chain, so every learner (the round's pushers first)
        gets the full values the shard holds now (which the failed step may have touched)
        and stays identical to it; the failed round's deltas are dropped."""
        state = self.state_of(job.fragment.id)
        if not state.applying or job.version != state.version + 1:
            raise FailedPrecondition(f"round for version {job.version} does not fit fragment at {state.version}")
        state.version = job.version
        state.chain.clear()
        state.condensed = {}
        touched = [mirror for _, _, mirror in job.mirrors] + list(job.stale)
        for learner, mirror in list(state.mirrors.items()):  # the worker may have moved them: forget them
            if any(mirror is m for m in touched):
                del state.mirrors[learner]
        state.full_cache = state.norm_cache = None
        state.applying = False
        state.last_reason, state.last_participants = f"round failed ({reason}): its deltas were dropped", 0
        self.clock = self.clock.tick(self.process)
        waiting, state.next = state.next, {}
        for pending in waiting.values():
            self._join_open(state, pending, now)

    def update_for(self, fragment_id: int, base_version: int, learner_id: str | None = None,
                   final: bool = False) -> FragmentUpdate:
        """The chain base+1..version, or the full fp32 fragment when the chain is too short;
        for a learner (``learner_id``) with condensed replies, see ``_condensed``; for a
        final push (its learner is leaving), the version alone."""
        state = self.state_of(fragment_id)
        if base_version > state.version:
            raise FailedPrecondition(
                f"base version {base_version} is in the future: fragment {fragment_id} is at version {state.version}"
            )
        if final:
            segments: tuple[Segment, ...] = ()
        elif learner_id is not None and self.cfg.merge.downlink == "condensed":
            segments = self._condensed(state, base_version, learner_id)
        elif base_version == state.version:
            segments = ()
        elif state.chain and state.chain[0].version <= base_version + 1:
            segments = tuple(s for s in state.chain if s.version > base_version)
        else:
            segments = (self.full(fragment_id),)
        return FragmentUpdate(
            fragment_id, base_version, state.version, segments, state.last_reason, state.last_participants
        )

    def _condensed(self, state: FragmentState, base_version: int, learner_id: str) -> tuple[Segment, ...]:
        """The round's condensed reply to the learner; nothing when it is current; else
        (no mirror of its anchor at ``base_version``: first contact since this shard
        started, a reply it never applied, a duplicate push) the full values, mirrored
        from then on."""
        reply = state.condensed.get(learner_id)
        if reply is not None and reply[0] == base_version and reply[1].version == state.version:
            return (reply[1],)
        mirror = state.mirrors.get(learner_id)
        if mirror is not None and mirror.version == base_version == state.version:
            return ()
        full = self.full(state.fragment.id)
        self.mirror(state.fragment.id, learner_id, full)
        return (full,)

    def mirror(self, fragment_id: int, learner_id: str, full: Segment) -> None:
        """The learner holds the fragment's full values ``full`` (a bootstrap, a full
        reply): mirror them, for condensed replies (``mirrors_for``)."""
        if self.mirrors_for(learner_id):
            self.set_mirror(fragment_id, learner_id, exact(self.base_for(fragment_id, full)))

    def base_for(self, fragment_id: int, full: Segment) -> Base:
        """The fragment's base at ``full``'s version (its values, as ``full`` holds them):
        the newest base when it is at that version, else a new newest one, read in place
        from ``full``."""
        state = self.state_of(fragment_id)
        if state.base is not None and state.base.version == full.version:
            return state.base
        base = base_of(full.version, [np.frombuffer(t.payload, dtype="<f4") for t in full.tensors], copy=False)
        self._use_base(state, base)
        return base

    @staticmethod
    def _use_base(state: FragmentState, base: Base) -> None:
        """``base`` becomes the newest (unless a newer one came meanwhile); the mirrors on
        the one before last move at the next round (``RoundJob.stale``)."""
        if state.base is None or base.version > state.base.version:
            state.previous_base, state.base, state.answers = state.base, base, 0

    def set_mirror(self, fragment_id: int, learner_id: str, mirror: Mirror) -> None:
        """``mirror`` is the learner's anchor of the fragment (for ``mirrors_for`` only: a
        learner that left while it was computed gets none)."""
        if self.mirrors_for(learner_id):
            self.state_of(fragment_id).mirrors[learner_id] = mirror

    def mirrors_for(self, learner_id: str) -> bool:
        """Whether the shard mirrors this learner's anchors: with condensed replies, for a
        member of the run (live or draining) only: a caller minting learner ids cannot make
        the shard hold copies for them."""
        return self.cfg.merge.downlink == "condensed" and learner_id in self.live | self.draining

    def full(self, fragment_id: int) -> Segment:
        state = self.state_of(fragment_id)
        if state.full_cache is None or state.full_cache.version != state.version:
            tensors = tuple(
                encode(piece.name, param, encoding="fp32") for piece, param in zip(state.fragment.pieces, state.params)
            )
            state.full_cache = Segment(state.version, "full", tensors)
        return state.full_cache

    # --- membership ------------------------------------------------------------------

    def receive(self, clock: VectorClock) -> None:
        """Merge a received clock, keeping only ids the run issued that this shard knows
        (``known_processes``): made-up names cannot grow the clock every reply carries."""
        self.clock = self.clock.receive(self.process, clock, self.known_processes())

    def known_processes(self) -> set[str]:
        """The ids a clock held here may name: the coordinator, every shard and the
        learners that may push (live or draining)."""
        return {auth.COORDINATOR_ID, *(f"S{m}" for m in range(self.cfg.num_shards)), *self.live, *self.draining}

    def check_reader(self, learner_id: str) -> None:
        """A learner's credential stays valid until it expires; once this shard knows the
        learner left or failed, it no longer reads the model or the shard's state (the same
        refusal as its pushes get). A learner this shard has not heard of yet (it has just
        joined) or one draining passes."""
        if learner_id in self.failed:
            raise PermissionDenied(f"{learner_id} was marked failed or removed: it may no longer read the run")
        if learner_id in self.left:
            raise FailedPrecondition(f"{learner_id} has left the run: join the coordinator again")

    def set_membership(self, live: set[str], failed: set[str], draining: set[str] = frozenset(),
                       left: set[str] = frozenset()) -> None:
        self.live = set(live)
        self.failed = set(failed)
        self.draining = set(draining) - self.live
        for learner_id in left:
            self._remember_left(learner_id)
        for learner_id in self.live | self.draining | self.failed:
            self.left.pop(learner_id, None)

    def learner_failed(self, learner_id: str) -> None:
        self.live.discard(learner_id)
        self.draining.discard(learner_id)
        self.failed.add(learner_id)
        for state in self.fragments.values():
            state.departed.pop(learner_id, None)
        self._forget(learner_id)
        for state in self.fragments.values():  # a removed learner (a bad one, say) vouches for nothing more
            state.influence.forget(learner_id)

    def sampled(self, fragments: Sequence[int] = ()) -> list[tuple[int, int, Pending]]:
        """(fragment, its version, a push) for each kept sample of the given fragments
        (empty: every owned one), oldest first per fragment."""
        states = [(f, self.state_of(f)) for f in (list(fragments) or sorted(self.fragments))]
        return [(f, state.version, pending) for f, state in states for pending in state.samples.values()]

    def set_trust(self, learner_id: str, fragment_id: int, trust: float) -> bool:
        """The validator's judgement of a learner's pushes of a fragment, from the next
        round on; False when the fragment is not this shard's or holds no values."""
        if not (math.isfinite(trust) and 0.0 <= trust <= 1.0):
            raise InvalidArgument(f"trust of {learner_id!r} must be in [0, 1], got {trust}")
        state = self.fragments.get(fragment_id)
        if state is None:
            return False
        state.trust[learner_id] = trust
        if trust < 1.0:
            state.influence.forget(learner_id)
        return True

    def trust_of(self, state: FragmentState, learner_id: str) -> float:
        """What a learner's pushes of a fragment count for: the validator's latest judgement;
        before its first judgement of the learner, ``PROBATION_TRUST`` in a run with a
        validator (from the run's first push: a holder of several learners that pushes
        before the validator has judged anyone would otherwise move the model in full,
        docs/results/trust/README.md) and 1 without one."""
        judged = state.trust.get(learner_id)
        if judged is not None:
            return judged
        return PROBATION_TRUST if self.cfg.validator else 1.0

    def learner_draining(self, learner_id: str) -> None:
        self.live.discard(learner_id)
        self.draining.add(learner_id)

    def learner_left(self, learner_id: str) -> None:
        """Gone in good standing. At a run's end (every member draining) it keeps its share of
        each fragment's step until the last learner has left, as a merged final push gives
        it (``begin_round``): a learner often leaves without a final push to every fragment
        (none was due, or its last push was merged already), and the others' last rounds
        of such a fragment were merged at 1/3 or 1/2 where the rest were at 1/4 (the long
        workload's tapes, docs/results/final-flush/)."""
        if learner_id in self.draining and not (self.live - self.failed):
            for state in self.fragments.values():
                state.departed.setdefault(learner_id, state.version + 1)
        self.live.discard(learner_id)
        self.draining.discard(learner_id)
        self._remember_left(learner_id)
        self._forget(learner_id)

    def _remember_left(self, learner_id: str) -> None:
        self.left.pop(learner_id, None)
        self.left[learner_id] = None
        while len(self.left) > MAX_LEFT_KEPT:
            del self.left[next(iter(self.left))]

    def _forget(self, learner_id: str) -> None:
        """A learner gone for good: its mirrors, samples and trust are memory no reply will
        use (a learner that joins again has a new id). (Its latest pushes stay in the
        fragments' references when it left in good standing: a learner that outstays the
        others is still compared with them.)"""
        for state in self.fragments.values():
            state.mirrors.pop(learner_id, None)
            state.condensed.pop(learner_id, None)
            state.samples.pop(learner_id, None)
            state.trust.pop(learner_id, None)

    def learner_joined(self, learner_id: str) -> None:
        self.live.add(learner_id)
        self.draining.discard(learner_id)
        self.failed.discard(learner_id)
        self.left.pop(learner_id, None)
