"""How much one push may move a fragment: robust bounds from the other learners' pushes.

A shard cannot check a learner's delta or its token count, but it can compare them with
what the other learners send. Each fragment remembers the latest merged push of each of
its recent learners (``Influence``); a push in a round is held to that reference:

- its delta is scaled down to at most ``multiple`` x the median norm of the *other*
  learners' latest deltas, times ``min(1, dt / median interval)``, ``dt`` being the time
  since the learner's own previous merged push to the fragment: the bound is on movement
  per unit of time, so pushing more often than the others buys nothing;
- its merge weight (``tokens * tokens / steps``) is capped at ``multiple ** 2`` x the
  median of the other learners' weights: its tokens count for at most ``multiple`` x
  theirs (a learner with twice the others' batch keeps its full weight of four).

- its delta is scaled by its *agreement* with where the fragment has been going: the
  cosine between the delta and the fragment's reference direction (an average of the
  recent merged updates that every pusher agreed with) against the median of the other
  learners' latest cosines, ``m``: fully counted at ``m / 2`` and above, not at all at
  ``m / 4`` and below (``gate``). Norm bounds alone do not stop a learner that pushes the
  same harmful direction every time: at 3x an honest delta, pushes along the model's own
  values grew it ~5x and ended a run at 50 bits/byte. Honest deltas measured here agree
  with the reference at cosine 0.28 (5th percentile) to 0.88, median 0.43; a random
  direction at 0.000 ± 0.005, the model's own values at 0.10 (docs/results/influence/).

This is norm clipping around a robust centre (the median, as in Byzantine-robust
aggregation: one learner, however extreme, moves a median of three or more values by at
most one rank; clipping keeps every honest contribution when honest pushes sit within the
multiple of each other, which trimmed means or a coordinate-wise median would not: those
drop or distort honest updates in every round, and most rounds here merge a single push).
The reference is the other learners' latest values, raw: a clipped value stored instead
would ratchet the reference down whenever honest deltas grow (the first full sync
period after a run starts grows them twenty-fold), and one learner's own history must not
vouch for it. The reference needs no honest majority to let an honest push through:

- each other learner's norm counts as at least ``FLOOR_RATIO`` x the fragment's norm: a
  peer pushing zeros or crumbs cannot clip the others to nothing (measured before the
  floor: a 2-learner run with an all-zero peer ended at the untrained model's eval);
- a record not refreshed for ``STALE_INTERVALS`` x the typical interval (at least
  ``STALE_MIN_S``) is no reference: a learner that left or stopped pushing does not bound
  the others for ever;
- the typical interval the time factor compares with counts the pusher's own among the
  others': one slow peer cannot throttle a fast learner (measured before: a zero-pushing
  peer stepping every 0.3 s cut a fast honest learner's pushes to a third), while a
  majority pushing at its pace still bounds a learner that floods.

With no other learner on record (the fragment's first pushes, a shard that came back
without its state) while other learners are members of the run, a delta is held to
``FALLBACK_RATIO`` x the fragment's norm per ``FALLBACK_PERIOD_S`` since the fragment's
last merged push: a learner that joins before the others (measured: 5 s before the
learners of ``diloco local``) and pushes alone cannot compound its pushes meanwhile. A
learner that is the run's only member is held to ``FALLBACK_RATIO`` x the fragment's
norm per push and no time: with nothing to compare it with, a per-time bound only
throttles fast honest hardware (it held a lone learner's 600 steps in 9 s to eval 7.15
where two learners reached 3.25), and a run of one learner is that learner.

A push whose direction nothing judges is held to the same fallback, shared by every such
push to the fragment: ``FALLBACK_RATIO`` x the fragment's norm per ``FALLBACK_PERIOD_S``
since the last one merged. Nothing judges it while the others' agreement is unknown or not
above 0 (``gate`` lets it through whole then, so that honest pushes can turn a reference
that points the wrong way), or while the reference was turned by the pusher alone: its own
history does not vouch for it, as for the norms (``Influence.turned_by``). Both happen at a
fragment's start, and both were how one negating learner of three got in: it joined first,
set the reference alone, and its pushes passed while the honest learners' agreement with
that reference was negative (4 or 5 of them merged after the honest learners' first in
the runs that ended 15-18 % worse, docs/results/trust/direction-bootstrap/). A learner
gated out has no say in the others' agreement: of two others, the lower middle is the
lower, and its negative cosine would leave every honest push unjudged (in the gate it
keeps its say: there the honest learners vouch for each other through it).

Measured on the honest default run (4 learners, 240 steps, docs/results/influence/): the
rule clipped 6 of 496 pushes at multiple 3, all but two during the run's first seconds.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

REFERENCE_DECAY = 0.5
"""The reference direction: ``r <- decay * r + (1 - decay) * merged update``, over the
rounds whose every merged push passed its gate in full."""
LEARNERS_REMEMBERED = 64
"""A fragment's reference: the latest pushes of at most this many recent learners."""
FALLBACK_RATIO = 0.25
"""With no other learner's push on record, a delta is clipped to this x the fragment's
norm (taken as at least 1) per ``FALLBACK_PERIOD_S``. Honest deltas measured here: median
0.048 x it, at most 0.37 x."""
FALLBACK_PERIOD_S = 5.0
FLOOR_RATIO = 0.05
"""Another learner's norm counts as at least this x the fragment's norm (taken as at
least 1) in the reference: the median honest delta measured here (0.048 x it), so an
honest push passes a zero-pushing peer's bound at up to ``multiple`` x that."""
STALE_INTERVALS = 8.0
STALE_MIN_S = 30.0
"""A learner's record older than ``STALE_INTERVALS`` x the median interval on record, and
than ``STALE_MIN_S``, is no reference for the others."""


@dataclass(frozen=True)
class Sample:
    """A learner's latest merged push to a fragment, as it was sent (unclipped)."""

    norm: float
    weight: float
    at: float
    """When the shard received it (its monotonic clock)."""
    interval: float | None
    """Seconds since the learner's previous merged push to the fragment (None: its first)."""
    cos: float | None = None
    """Its latest push's agreement with the reference direction (None: not measured)."""
    counted: float = 1.0
    """The factor it was merged at (norm clip x direction gate x trust; 1 until its round has
    judged it): a learner whose pushes are gated to nothing counts for nothing
    (``negligible``)."""


@dataclass(frozen=True)
class Bound:
    clip: float
    """The factor the push's delta is scaled by (1: untouched)."""
    weight_cap: float
    """The most its raw merge weight may count for (inf: no cap)."""
    agreement: float | None = None
    """The median of the other learners' latest agreements (None: none measured): what
    ``gate`` holds this push's agreement to."""
    unvouched: bool = False
    """With other learners on record, nothing judges its direction (``Influence.bounds``):
    ``clip`` includes the fragment's shared fallback for such pushes. With none on record
    it is False: the lone-learner fallback is already its whole bound."""


@dataclass(frozen=True)
class Push:
    """What the bound looks at in one push."""

    learner: str
    norm: float
    weight: float
    at: float


class Influence:
    """One fragment's reference: the latest merged push of each recent learner."""

    def __init__(self) -> None:
        self.latest: OrderedDict[str, Sample] = OrderedDict()
        self.last_at: float | None = None
        """When the latest merged push arrived (any learner's)."""
        self.turned_by: frozenset[str] = frozenset()
        """Who turned the fragment's reference direction (``turned``), two names at most:
        enough to tell a reference only one learner made from one the others made too."""
        self.unvouched_at: float | None = None
        """When the latest push merged with nothing to judge its direction arrived."""

    def bounds(self, pushes: list[Push], multiple: float, fragment_norm: Callable[[], float],
               members: frozenset[str] | None = None) -> list[Bound]:
        """The bound of each push of a round. The other pushes of the same round count as
        the other learners' latest (they are newer than anything on record).
        ``fragment_norm``: the fragment's L2 norm now. ``members``: the run's live and
        draining learners (None: unknown, taken as others being there)."""
        current = {p.learner: self._sample(p) for p in pushes}
        reference = {**self.latest, **current}
        intervals = [s.interval for s in reference.values() if s.interval is not None]
        stale_s = max(STALE_MIN_S, STALE_INTERVALS * statistics.median_low(intervals)) if intervals else math.inf
        floor = FLOOR_RATIO * max(fragment_norm(), 1.0)
        bounds = [self._bound(p, reference, multiple, fragment_norm, floor, stale_s,
                              alone=members is not None and not (members - {p.learner})) for p in pushes]
        unvouched = [i for i, b in enumerate(bounds) if b.unvouched]
        if unvouched:  # one share of the fragment's fallback each
            since = min(pushes[i].at for i in unvouched) - self.unvouched_at if self.unvouched_at is not None else math.inf
            limit = FALLBACK_RATIO * max(fragment_norm(), 1.0) * min(1.0, max(since, 0.0) / FALLBACK_PERIOD_S)
            for i in unvouched:
                share = _clip(pushes[i].norm, limit / len(unvouched))
                bounds[i] = dataclasses.replace(bounds[i], clip=min(bounds[i].clip, share))
        return bounds

    def turned(self, learners: Iterable[str]) -> None:
        """A round of these learners' pushes turned the reference direction."""
        for learner in sorted(learners):
            if len(self.turned_by) < 2:
                self.turned_by |= {learner}

    def vouches(self, learner: str) -> bool:
        """The reference direction was turned by another learner than ``learner`` too: its
        cosine with a push of ``learner`` says something of the push."""
        return bool(self.turned_by - {learner})

    def record(self, pushes: list[Push], unvouched: Collection[str] = ()) -> None:
        """The round merged these pushes: they are their learners' latest. ``unvouched``: the
        learners among them whose directions nothing judged (their time spends the fallback)."""
        for push in pushes:
            if push.learner in unvouched:
                self.unvouched_at = push.at if self.unvouched_at is None else max(self.unvouched_at, push.at)
            self.last_at = push.at if self.last_at is None else max(self.last_at, push.at)
            sample = self._sample(push)
            self.latest.pop(push.learner, None)
            self.latest[push.learner] = sample
            while len(self.latest) > LEARNERS_REMEMBERED:
                self.latest.popitem(last=False)

    def agreed(self, learner: str, cos: float | None, counted: float = 1.0) -> None:
        """The agreement measured for the learner's latest push and the factor it was merged
        at (after its round)."""
        sample = self.latest.get(learner)
        if sample is not None:
            self.latest[learner] = dataclasses.replace(sample, cos=sample.cos if cos is None else cos, counted=counted)

    def negligible(self, floor: float) -> set[str]:
        """The learners whose latest push, as merged (clipped and gated), is under ``floor``."""
        return {learner for learner, sample in self.latest.items() if sample.norm * sample.counted < floor}

    def forget(self, learner: str) -> None:
        self.latest.pop(learner, None)

    def to_state(self, now: float) -> dict:
        """As plain data for a snapshot: each sample's time as its age at ``now`` (a shard's
        clock is its process's, which a restored shard does not share)."""
        return {
            "latest": [[learner, s.norm, s.weight, now - s.at, s.interval, s.cos, s.counted]
                       for learner, s in self.latest.items()],
            "last_age": None if self.last_at is None else now - self.last_at,
            "turned_by": sorted(self.turned_by),
            "unvouched_age": None if self.unvouched_at is None else now - self.unvouched_at,
        }

    @classmethod
    def from_state(cls, state: dict, now: float) -> "Influence":
        """The record ``to_state`` wrote, its ages counted back from ``now``: a restored
        shard's bounds continue where they were instead of starting from the lone-learner
        fallback."""
        influence = cls()
        for learner, norm, weight, age, interval, cos, *counted in state["latest"][-LEARNERS_REMEMBERED:]:
            # Snapshots written before ``counted`` existed have six fields: counted in full.
            influence.latest[str(learner)] = Sample(float(norm), float(weight), now - float(age),
                                                    None if interval is None else float(interval),
                                                    None if cos is None else float(cos),
                                                    float(counted[0]) if counted else 1.0)
        influence.last_at = None if state["last_age"] is None else now - float(state["last_age"])
        # Snapshots written before these were kept: nobody turned the reference yet (it is
        # turned again by the next round that follows it), nothing unvouched merged.
        influence.turned_by = frozenset(str(learner) for learner in state.get("turned_by", ())[:2])
        age = state.get("unvouched_age")
        influence.unvouched_at = None if age is None else now - float(age)
        return influence

    def _sample(self, push: Push) -> Sample:
        previous = self.latest.get(push.learner)
        interval = push.at - previous.at if previous is not None else None
        return Sample(push.norm, push.weight, push.at, interval, previous.cos if previous is not None else None)

    def _bound(self, push: Push, reference: dict[str, Sample], multiple: float, fragment_norm: Callable[[], float],
               floor: float, stale_s: float, alone: bool) -> Bound:
        others = [s for learner, s in reference.items() if learner != push.learner and push.at - s.at <= stale_s]
        if not others:
            period = 1.0
            if not alone and self.last_at is not None:
                period = min(1.0, max(push.at - self.last_at, 0.0) / FALLBACK_PERIOD_S)
            return Bound(_clip(push.norm, FALLBACK_RATIO * max(fragment_norm(), 1.0) * period), math.inf)
        limit = multiple * max(floor, statistics.median_low(s.norm for s in others))
        previous = self.latest.get(push.learner)
        intervals = [s.interval for s in others if s.interval is not None]
        if previous is not None and intervals:
            # The learner's own interval is one of the values: a single slower peer cannot
            # throttle it (of two, the lower middle is its own), a majority still can.
            dt = max(push.at - previous.at, 0.0)
            typical = statistics.median_low([*intervals, dt])
            if typical > 0:
                limit *= min(1.0, dt / typical)
        cosines = [s.cos for s in others if s.cos is not None]
        agreement = statistics.median_low(cosines) if cosines else None
        # Whether anything judges its direction: the agreement of the others whose latest push
        # counted (a learner gated out, the lower middle of two, would leave every honest push
        # unjudged; it keeps its say in the gate, where the honest learners vouch for each other).
        counted = [s.cos for s in others if s.cos is not None and s.counted > 0]
        judged = bool(counted) and statistics.median_low(counted) > 0 and self.vouches(push.learner)
        return Bound(_clip(push.norm, limit), multiple**2 * statistics.median_low(s.weight for s in others), agreement,
                     unvouched=not judged)


def gate(cos: float | None, agreement: float | None) -> float:
    """How much of a push counts, from its delta's cosine with the reference direction and
    the others' median cosine ``agreement``: 1 from ``agreement / 2`` up, 0 at
    ``agreement / 4`` and below, linear between. 1 when either is unknown or the others do
    not agree with the reference themselves (``agreement <= 0``)."""
    if cos is None or agreement is None or agreement <= 0:
        return 1.0
    return min(1.0, max(0.0, (cos - agreement / 4) / (agreement / 4)))


def _clip(norm: float, limit: float) -> float:
    return min(1.0, limit / norm) if norm > limit else 1.0


ANCHOR_VERSION_SLACK = 64
"""How many versions an anchor may be ahead of the lower median of those offered."""
ANCHOR_NORM_RATIO = 2.0
"""How far (either way) an anchor's norm may be from the lower median of those offered."""
ANCHOR_DISTANCE_RATIO = 4.0
"""How much farther from the reference values an anchor may be than the lower median of
the offers' distances from them."""


@dataclass(frozen=True)
class AnchorOffer:
    """What ``choose_anchor`` looks at in one learner's anchor of a fragment."""

    version: int
    norm: float
    distance: float = 0.0
    """From the reference values: the fragment's values in the shard's latest snapshot,
    else the elementwise median of the anchors offered."""


def choose_anchor(offers: list[AnchorOffer], snapshot_norm: float | None = None) -> int | None:
    """Which of the anchors offered for a fragment of a shard back without its state (one
    per learner) becomes its state: the newest of those that agree with the others, ties to
    the nearest the reference. An anchor agrees when its version is at most
    ``ANCHOR_VERSION_SLACK`` above the lower median of the versions offered, its norm within
    ``ANCHOR_NORM_RATIO`` of the lower median norm, and its distance from the reference
    values at most ``ANCHOR_DISTANCE_RATIO`` x the lower median distance: one learner cannot
    pull the fragment to a version the others never saw, to values of another scale, nor to
    values of the same norm in another direction (negated: twice the norm away from the
    median of the others). ``snapshot_norm``: the reference is a snapshot's values, of this
    norm; then an anchor must also point the snapshot's way (cosine > 0, from the distance
    and the two norms), which holds even for an anchor offered alone. None when none
    qualifies. One offer with no snapshot is taken as it is: there is nothing to compare
    it with."""
    if not offers:
        return None
    version_limit = statistics.median_low(o.version for o in offers) + ANCHOR_VERSION_SLACK
    norm = statistics.median_low(o.norm for o in offers)
    distance_limit = ANCHOR_DISTANCE_RATIO * statistics.median_low(o.distance for o in offers)
    candidates = [i for i, o in enumerate(offers)
                  if o.version <= version_limit and norm / ANCHOR_NORM_RATIO <= o.norm <= norm * ANCHOR_NORM_RATIO
                  and o.distance <= distance_limit
                  and (snapshot_norm is None or o.distance**2 < o.norm**2 + snapshot_norm**2)]
    if not candidates:
        return None
    return max(candidates, key=lambda i: (offers[i].version, -offers[i].distance))
