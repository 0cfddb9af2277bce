"""The learner's spans and metrics, through the OpenTelemetry API (no-ops unless the
process installed providers, see ``diloco.telemetry``).

One ``sync fragment`` span per push, from the start of encoding to the update being
merged into the model (or the push ending otherwise: dropped, failed, superseded by a
newer reply). It is started on the training thread, handed to the streamer thread inside
the ``PushJob`` and made current there explicitly (``SyncTrace.context``), so the push's
RPC span, and through the call metadata the shard's ``push`` span, are its children.

Metrics: ``diloco.sync.latency`` (the same interval, for merged pushes),
``diloco.push.dropped``, ``diloco.wire.bytes``, ``diloco.learner.tokens``,
``diloco.learner.fragment_steps`` (goodput's denominator),
``diloco.learner.tokens_per_second``, ``diloco.learner.version_lag``, and the task's
``diloco.learner.train_loss`` and ``diloco.learner.eval_loss`` (gauges, so the backend
that shows sync latency draws the loss curve too).
"""

from __future__ import annotations

import time

from opentelemetry import context, metrics, trace
from opentelemetry.trace import Status, StatusCode

from diloco.telemetry import LEARNER_ID, SECONDS_BUCKETS, SHARD_ID

SCOPE = "diloco.learner"

APPLIED = "applied"
SUPERSEDED = "superseded"
DROPPED = "dropped"
FAILED = "failed"
UNFINISHED = "unfinished"


class SyncTrace:
    """One push's life on the learner. Phases are recorded by whichever thread runs them,
    one after another (the job and the reply queue order them); ``end`` runs once."""

    def __init__(self, telemetry: LearnerTelemetry, span: trace.Span, fragment: int) -> None:
        self._telemetry = telemetry
        self.span = span
        self.fragment = fragment
        self.context = trace.set_span_in_context(span, context.Context())
        """Attach this in the streamer's event loop: the RPC then joins the sync's trace."""
        self.started = time.perf_counter()
        self.received = False
        """Set on the training thread once its reply reached the sync book."""
        self.ended = False
        self._apply_s = 0.0
        self._replied_at: float | None = None

    def phase(self, name: str, seconds: float) -> None:
        self.span.set_attribute(f"diloco.{name}_s", seconds)
        if name == "apply":
            self._apply_s = seconds

    def acked(self, outcome: str, target_version: int) -> None:
        self.span.add_event("acked", {"diloco.push.outcome": outcome, "diloco.target_version": target_version})
        self.span.set_attribute("diloco.push.outcome", outcome)

    def replied(self, version: int, staleness: int, bytes_up: int, bytes_down: int) -> None:
        self.span.set_attributes({
            "diloco.version": version, "diloco.staleness": staleness,
            "diloco.bytes_up": bytes_up, "diloco.bytes_down": bytes_down,
        })
        self._telemetry.wire(bytes_up, bytes_down)
        self._replied_at = time.perf_counter()

    def applied(self, merge_s: float, staleness: int) -> None:
        """The update is in the model: the end of the sync latency."""
        if self.ended:
            return
        now = time.perf_counter()
        self.span.set_attribute("diloco.apply_s", self._apply_s + merge_s)
        if self._replied_at is not None:  # the reply waited for its step (send + tau)
            self.span.set_attribute("diloco.overlap_wait_s", max(now - merge_s - self._replied_at, 0.0))
        self._telemetry.synced(self.fragment, now - self.started, staleness)
        self._end(APPLIED)

    def dropped(self, reason: str) -> None:
        if self.ended:
            return
        self._telemetry.dropped(reason)
        self._end(DROPPED, reason)

    def failed(self, code: str, details: str) -> None:
        if self.ended:
            return
        self._telemetry.dropped(code.lower())
        self.span.set_status(Status(StatusCode.ERROR, f"{code}: {details}"))
        self._end(FAILED, code)

    def superseded(self) -> None:
        self._end(SUPERSEDED, "a newer reply for the fragment was applied instead")

    def unfinished(self) -> None:
        self._end(UNFINISHED, "the learner stopped before the reply arrived")

    def _end(self, outcome: str, reason: str = "") -> None:
        if self.ended:
            return
        self.ended = True
        self.span.set_attribute("diloco.outcome", outcome)
        if reason:
            self.span.set_attribute("diloco.reason", reason)
        self.span.end()


class LearnerTelemetry:
    def __init__(self, learner_id: str, tracer: trace.Tracer | None = None, meter: metrics.Meter | None = None) -> None:
        self.learner_id = learner_id
        self.tracer = tracer or trace.get_tracer(SCOPE)
        meter = meter or metrics.get_meter(SCOPE)
        self._latency = meter.create_histogram(
            "diloco.sync.latency", "s", "from the start of a push to its update merged into the model",
            explicit_bucket_boundaries_advisory=SECONDS_BUCKETS,
        )
        self._dropped = meter.create_counter("diloco.push.dropped", "{push}", "pushes dropped or failed, by reason")
        self._bytes = meter.create_counter(
            "diloco.wire.bytes", "By", "push payload bytes on the wire (direction: up = to the shard, down = updates)"
        )
        self._tokens = meter.create_counter("diloco.learner.tokens", "{token}", "training tokens")
        self._fragment_steps = meter.create_counter(
            "diloco.learner.fragment_steps", "{step}", "inner steps times fragments (goodput's denominator)"
        )
        self._tokens_per_s = meter.create_gauge("diloco.learner.tokens_per_second", "{token}/s", "inner-loop throughput")
        self._version_lag = meter.create_gauge(
            "diloco.learner.version_lag", "{version}",
            "versions the global fragment moved past a push's base, besides its own round, when its update was merged",
        )

        self._train_loss = meter.create_gauge(
            "diloco.learner.train_loss", "1", "the task's training loss, the mean over the last --train-loss-every inner steps")
        self._eval_loss = meter.create_gauge(
            "diloco.learner.eval_loss", "1", "the task's mean loss over its eval batches (in its eval unit, e.g. bits/byte)"
        )

    def train_loss(self, value: float, unit: str) -> None:
        self._train_loss.set(value, {"diloco.eval_unit": unit})

    def eval_loss(self, value: float, unit: str) -> None:
        self._eval_loss.set(value, {"diloco.eval_unit": unit})

    def start_sync(self, fragment: int, shard: int, base_version: int, step: int) -> SyncTrace:
        span = self.tracer.start_span(
            "sync fragment",
            context=context.Context(),  # every sync is its own trace
            attributes={
                LEARNER_ID: self.learner_id, "diloco.fragment": fragment, SHARD_ID: shard,
                "diloco.base_version": base_version, "diloco.sent_step": step,
            },
        )
        return SyncTrace(self, span, fragment)

    def step(self, tokens: int, fragments: int, tokens_per_s: float) -> None:
        self._tokens.add(tokens)
        self._fragment_steps.add(fragments)
        self._tokens_per_s.set(tokens_per_s)

    def wire(self, bytes_up: int, bytes_down: int) -> None:
        self._bytes.add(bytes_up, {"diloco.direction": "up"})
        self._bytes.add(bytes_down, {"diloco.direction": "down"})

    def synced(self, fragment: int, latency_s: float, staleness: int) -> None:
        self._latency.record(latency_s, {"diloco.fragment": fragment})
        self._version_lag.set(staleness, {"diloco.fragment": fragment})

    def dropped(self, reason: str) -> None:
        self._dropped.add(1, {"diloco.reason": reason})
