"""The coordinator's metrics, through the OpenTelemetry API (no-ops unless the process
installed providers, see ``diloco.telemetry``). Its spans are the RPCs' own (the server
interceptor in ``diloco.rpc``).

Per learner, from its heartbeats: ``diloco.coordinator.learner.version_lag`` and
``diloco.coordinator.learner.tokens_per_second``; membership changes:
``diloco.coordinator.membership`` (event: joined, left); the members now:
``diloco.coordinator.members`` (by state and pool).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from opentelemetry import metrics

from diloco.telemetry import LEARNER_ID, POOL

SCOPE = "diloco.coordinator"
STATE = "diloco.state"


class CoordinatorTelemetry:
    def __init__(self, meter: metrics.Meter | None = None,
                 members: Callable[[], Mapping[tuple[str, str], int]] = dict) -> None:
        """``members``: the learners by (state, pool) now; called on the exporter's thread
        at each collection, so it must only read a value the event loop replaces whole."""
        meter = meter or metrics.get_meter(SCOPE)
        meter.create_observable_gauge(
            "diloco.coordinator.members", [lambda options: [
                metrics.Observation(count, {STATE: state, POOL: pool}) for (state, pool), count in members().items()]],
            "{learner}", "learners by state (joining, active, draining, failed, left) and pool",
        )
        self._version_lag = meter.create_gauge(
            "diloco.coordinator.learner.version_lag", "{version}", "a learner's version lag, from its heartbeats"
        )
        self._tokens_per_s = meter.create_gauge(
            "diloco.coordinator.learner.tokens_per_second", "{token}/s", "a learner's throughput, from its heartbeats"
        )
        self._membership = meter.create_counter("diloco.coordinator.membership", "{event}", "joins and leaves")

    def heartbeat(self, learner_id: str, version_lag: int, tokens_per_s: float) -> None:
        attributes = {LEARNER_ID: learner_id}
        self._version_lag.set(version_lag, attributes)
        self._tokens_per_s.set(tokens_per_s, attributes)

    def membership(self, event: str, pool: str = "") -> None:
        self._membership.add(1, {"diloco.event": event, POOL: pool})
