"""The shard's spans and metrics, through the OpenTelemetry API (no-ops unless the process
installed providers, see ``diloco.telemetry``).

Spans: ``push`` (one per PushFragment, a child of the RPC's server span and so of the
learner's ``sync fragment``) and ``round`` (one per closed round, linked to every push
it merged), and ``fragment values`` (one each time a fragment gets its values: a
learner's initial values, a learner's anchor after a restart without state, or a
snapshot; attribute ``diloco.source``). Metrics: ``diloco.push.received``, ``diloco.wire.bytes``,
``diloco.round.closed``, ``diloco.round.participants``, ``diloco.round.quorum_wait``, ``diloco.round.grace``,
``diloco.round.merge``, ``diloco.round.merged_steps``.
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import context, metrics, trace

from diloco.telemetry import SECONDS_BUCKETS, SHARD_ID
from diloco.wire import PushMeta
from diloco.syncer.core.shard import RoundJob

SCOPE = "diloco.syncer"


def push_attributes(meta: PushMeta) -> dict:
    return {
        "diloco.learner.id": meta.learner_id,
        "diloco.fragment": meta.fragment,
        "diloco.base_version": meta.base_version,
        "diloco.seq": meta.seq,
        "diloco.tokens": meta.tokens,
        "diloco.inner_steps": meta.inner_steps,
    }


class ShardTelemetry:
    def __init__(self, shard_id: int, tracer: trace.Tracer | None = None, meter: metrics.Meter | None = None) -> None:
        self.shard_id = shard_id
        self.tracer = tracer or trace.get_tracer(SCOPE)
        meter = meter or metrics.get_meter(SCOPE)
        self._pushes = meter.create_counter("diloco.push.received", "{push}", "pushes received, by outcome")
        self._bytes = meter.create_counter(
            "diloco.wire.bytes", "By", "push payload bytes on the wire (direction: up = to the shard, down = updates)"
        )
        self._rounds = meter.create_counter("diloco.round.closed", "{round}", "rounds closed, by fragment")
        self._participants = meter.create_histogram(
            "diloco.round.participants", "{learner}", "learners merged per round",
            explicit_bucket_boundaries_advisory=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128),
        )
        self._quorum = meter.create_histogram(
            "diloco.round.quorum_wait", "s", "from a round's first push to its quorum",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._grace = meter.create_histogram(
            "diloco.round.grace", "s", "grace window granted after the quorum",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._merge = meter.create_histogram(
            "diloco.round.merge", "s", "merge, outer step and update encoding of a round",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._merged_steps = meter.create_counter(
            "diloco.round.merged_steps", "{step}",
            "learner inner steps whose delta was merged with weight > 0 (goodput's numerator)",
        )

    def start_push(self) -> trace.Span:
        """The ``push`` span, a child of the current (RPC server) span."""
        return self.tracer.start_span("push", attributes={SHARD_ID: self.shard_id})

    def push_received(self, outcome: str, fragment: int, wire_bytes: int) -> None:
        self._pushes.add(1, {"diloco.push.outcome": outcome, "diloco.fragment": fragment})
        self._bytes.add(wire_bytes, {"diloco.direction": "up"})

    def bytes_sent(self, count: int) -> None:
        self._bytes.add(count, {"diloco.direction": "down"})

    def fragment_values(self, fragment: int, version: int, source: str, origin: str) -> None:
        """Where a fragment's values came from: ``source`` initial | anchor | snapshot,
        ``origin`` the learner id or the snapshot id."""
        self.tracer.start_span(
            "fragment values", context=context.Context(),
            attributes={SHARD_ID: self.shard_id, "diloco.fragment": fragment, "diloco.version": version,
                        "diloco.source": source, "diloco.origin": origin},
        ).end()

    def round_closed(
        self, job: RoundJob, merge_s: float, links: Sequence[trace.SpanContext], opened_ns: int, finished_ns: int
    ) -> None:
        """Record a round: its span runs from the first push to the update being in place,
        linked to the push spans it merged; and its metrics."""
        participants = [p.meta.learner_id for p in job.pushes]
        span = self.tracer.start_span(
            "round",
            context=context.Context(),  # a root: it has many causes, each linked
            links=[trace.Link(c) for c in links if c.is_valid],
            start_time=opened_ns,
            attributes={
                SHARD_ID: self.shard_id,
                "diloco.fragment": job.fragment.id,
                "diloco.version": job.version,
                "diloco.participants": participants,
                "diloco.weights": [float(w) for w in job.weights],
                "diloco.quorum_wait_s": job.quorum_s,
                "diloco.grace_wait_s": job.grace_s,
                "diloco.merge_s": merge_s,
                "diloco.close_reason": job.reason,
            },
        )
        span.end(end_time=finished_ns)
        attributes = {"diloco.fragment": job.fragment.id}
        self._rounds.add(1, attributes)
        self._participants.record(len(participants), attributes)
        self._quorum.record(job.quorum_s, attributes)
        self._grace.record(job.grace_s, attributes)
        self._merge.record(merge_s, attributes)
        merged = sum(p.meta.inner_steps for p, w in zip(job.pushes, job.weights) if w > 0)
        if merged:
            self._merged_steps.add(merged, attributes)
