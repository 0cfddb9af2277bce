"""OpenTelemetry for every diloco process, configured by the standard ``OTEL_*`` variables.

``start`` installs a tracer provider and a meter provider only when the environment
names an exporter: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the per-signal
``..._TRACES_ENDPOINT`` / ``..._METRICS_ENDPOINT``), or ``OTEL_TRACES_EXPORTER`` /
``OTEL_METRICS_EXPORTER``. Otherwise it installs nothing: every span and instrument in the
code stays the OpenTelemetry API's no-op. Unlike the SDK's own default, an unset exporter
is "none", so a process never dials localhost:4317 on its own.

The CLI passes the environment in (only the CLI reads the process environment); what this
module decides (exporters, endpoint, service name, resource, batching and export
intervals) comes from that mapping. The OTLP exporter reads its remaining standard
variables itself (headers, certificates, compression, timeout), as does the sampler
(``OTEL_TRACES_SAMPLER``).

This is a service-side module of the kernel, like ``rpc``: core code never imports it.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from diloco.errors import InvalidArgument
from diloco.files import atomic_write

logger = logging.getLogger(__name__)

SERVICE_NAMES = {"learner": "diloco-learner", "syncer": "diloco-syncer", "coordinator": "diloco-coordinator",
                 "validator": "diloco-validator"}
"""Default ``service.name`` per role; ``OTEL_SERVICE_NAME`` overrides it."""

LEARNER_ID = "diloco.learner.id"
SHARD_ID = "diloco.shard.id"
POOL = "diloco.pool"
PROMETHEUS_LABELS = (LEARNER_ID, SHARD_ID, POOL)
"""Resource attributes the Prometheus endpoint also puts on every series (as
``diloco_learner_id``, ``diloco_shard_id``, ``diloco_pool``): a scraper that knows the pod,
not the learner, can still tell the learners apart. The whole resource is on ``target_info``."""

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Histogram boundaries for durations: the SDK's default buckets are meant for milliseconds."""

_TRACE_EXPORTERS = ("otlp", "console")
_METRIC_EXPORTERS = ("otlp", "console", "prometheus")
_PROMETHEUS_HINT = "pip install 'diloco[metrics]' (opentelemetry-exporter-prometheus)"


@dataclass(frozen=True)
class ExportPlan:
    traces: tuple[str, ...]
    """Span exporters to install: otlp, console; empty: none (the API's no-op)."""
    metrics: tuple[str, ...]
    """Metric exporters: otlp, console, prometheus; empty: none."""
    reason: str


def _exporters(env: Mapping[str, str], signal: str, allowed: tuple[str, ...]) -> tuple[tuple[str, ...], str]:
    variable = f"OTEL_{signal}_EXPORTER"
    named = [k.strip().lower() for k in env.get(variable, "").split(",") if k.strip()]
    if named:
        if "none" in named:
            return (), f"{variable}=none"
        unknown = [k for k in named if k not in allowed]
        if unknown:
            raise InvalidArgument(f"{variable}={env[variable]}: supported are {', '.join(allowed)} and none")
        return tuple(dict.fromkeys(named)), f"{variable}={','.join(named)}"
    for endpoint in (f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        if env.get(endpoint, "").strip():
            return ("otlp",), f"{endpoint} is set"
    return (), f"neither {variable} nor an OTLP endpoint is set"


def export_plan(env: Mapping[str, str]) -> ExportPlan:
    """What the environment asks to export; nothing unless it names an exporter or an
    OTLP endpoint."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ExportPlan((), (), "OTEL_SDK_DISABLED=true")
    traces, traces_why = _exporters(env, "TRACES", _TRACE_EXPORTERS)
    metrics, metrics_why = _exporters(env, "METRICS", _METRIC_EXPORTERS)
    for signal, kinds in (("TRACES", traces), ("METRICS", metrics)):
        protocol = env.get(f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        if "otlp" in kinds and protocol.strip().lower() != "grpc":
            raise InvalidArgument(
                f"OTLP protocol {protocol!r}: diloco exports OTLP over gRPC only; set OTEL_EXPORTER_OTLP_PROTOCOL=grpc "
                "and point the endpoint at the collector's gRPC port (usually 4317)"
            )
    return ExportPlan(traces, metrics, f"traces: {traces_why}; metrics: {metrics_why}")


def parse_resource_attributes(value: str) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES``: comma-separated ``key=value``, values percent-encoded."""
    attributes = {}
    for item in value.split(","):
        key, sep, raw = item.partition("=")
        if not item.strip():
            continue
        if not sep or not key.strip():
            raise InvalidArgument(f"OTEL_RESOURCE_ATTRIBUTES: {item!r} is not key=value")
        attributes[key.strip()] = urllib.parse.unquote(raw.strip())
    return attributes


def resource_attributes(
    role: str, env: Mapping[str, str], learner_id: str | None = None, shard_id: int | None = None, pool: str | None = None
) -> dict[str, str | int]:
    """The process's resource: ``OTEL_RESOURCE_ATTRIBUTES``, then the diloco ids; the
    service name is ``OTEL_SERVICE_NAME``, else one set in the attributes, else the role's."""
    if role not in SERVICE_NAMES:
        raise InvalidArgument(f"unknown role {role!r}: one of {', '.join(SERVICE_NAMES)}")
    attributes: dict[str, str | int] = dict(parse_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES", "")))
    attributes["service.name"] = env.get("OTEL_SERVICE_NAME", "").strip() or attributes.get("service.name") or SERVICE_NAMES[role]
    attributes.setdefault("service.namespace", "diloco")
    if learner_id is not None:
        attributes[LEARNER_ID] = learner_id
    if shard_id is not None:
        attributes[SHARD_ID] = shard_id
    if pool is not None:
        attributes[POOL] = pool
    return attributes


def _millis(env: Mapping[str, str], name: str) -> float | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        millis = float(value)
    except ValueError:
        raise InvalidArgument(f"{name}={value!r} is not a number of milliseconds") from None
    if millis < 0:
        raise InvalidArgument(f"{name}={value!r} is negative")
    return millis


def _count(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise InvalidArgument(f"{name}={value!r} is not a positive integer")
    return int(value)


def _otlp_args(env: Mapping[str, str], signal: str) -> dict:
    endpoint = env.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None
    insecure = env.get(f"OTEL_EXPORTER_OTLP_{signal}_INSECURE") or env.get("OTEL_EXPORTER_OTLP_INSECURE")
    args: dict = {"endpoint": endpoint}
    if insecure is not None and insecure.strip():
        args["insecure"] = insecure.strip().lower() == "true"
    return args


def prometheus_address(value: str) -> tuple[str, int]:
    """``--prometheus [HOST:]PORT`` (HOST defaults to every interface, for scrapers)."""
    host, sep, port = value.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise InvalidArgument(f"--prometheus takes [HOST:]PORT, got {value!r}") from None
    if not 0 <= number < 65536:
        raise InvalidArgument(f"--prometheus port {number} is out of range")
    return (host.strip("[]") if sep and host else "0.0.0.0"), number


def require_prometheus() -> None:
    """Fail early, with the fix, when a Prometheus endpoint is asked for but the exporter
    is not installed (it is an optional extra)."""
    try:
        import opentelemetry.exporter.prometheus  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError:
        raise InvalidArgument(f"a Prometheus endpoint needs the Prometheus exporter: {_PROMETHEUS_HINT}") from None


_TARGET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def prometheus_target(role: str, host: str, port: int, learner_id: str | None = None,
                      shard_id: int | None = None) -> tuple[str, list[dict]]:
    """This process's Prometheus target, as a ``file_sd_configs`` file: its name (the
    process's name in a local run's endpoints.json: ``coordinator``, ``shard<m>``, the
    learner's id) and its one target group, the /metrics address labelled ``role``
    (coordinator, shard, learner) and ``learner`` or ``shard``. An endpoint on every
    interface is given under this host's name."""
    if role not in SERVICE_NAMES:
        raise InvalidArgument(f"unknown role {role!r}: one of {', '.join(SERVICE_NAMES)}")
    if host in ("", "0.0.0.0", "::"):
        host = socket.getfqdn()
    labels = {"role": "shard" if role == "syncer" else role}
    if learner_id is not None:
        labels["learner"] = learner_id
    if shard_id is not None:
        labels["shard"] = str(shard_id)
    name = learner_id if learner_id is not None else f"shard{shard_id}" if shard_id is not None else role
    if not _TARGET_NAME.match(name):
        raise InvalidArgument(f"learner id {name!r} cannot name a Prometheus target file")
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"{name}.json", [{"targets": [address], "labels": labels}]


class Telemetry:
    """The providers ``start`` installed (None where nothing was), shut down at exit."""

    def __init__(self, plan: ExportPlan, tracer_provider=None, meter_provider=None, prometheus_server=None,
                 target_file: Path | None = None) -> None:
        self.plan = plan
        self.tracer_provider = tracer_provider
        self.meter_provider = meter_provider
        self._prometheus_server = prometheus_server
        self.target_file = target_file
        """The Prometheus target file this process wrote (``prometheus_target``), removed at shutdown."""
        self._closed = False

    @property
    def prometheus_port(self) -> int | None:
        return self._prometheus_server.server_port if self._prometheus_server is not None else None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Flush and stop the exporters, bounded: an unreachable collector must not keep a
        process that was asked to stop from exiting."""
        if self._closed:
            return
        self._closed = True
        if self.target_file is not None:
            self.target_file.unlink(missing_ok=True)
        if self._prometheus_server is not None:
            self._prometheus_server.shutdown()
            self._prometheus_server.server_close()
        providers = [p for p in (self.tracer_provider, self.meter_provider) if p is not None]
        if not providers:
            return

        def flush() -> None:
            for provider in providers:
                try:
                    provider.shutdown()
                except Exception:  # an exporter's failure at exit must not mask the exit status
                    logger.warning("telemetry: shutting %s down failed", type(provider).__name__, exc_info=True)

        worker = threading.Thread(target=flush, name="diloco-telemetry-shutdown", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            logger.warning("telemetry: exporters did not flush within %.1f s; exiting without them", timeout_s)


def start(
    role: str,
    env: Mapping[str, str],
    *,
    learner_id: str | None = None,
    shard_id: int | None = None,
    pool: str | None = None,
    prometheus: tuple[str, int] | None = None,
    prometheus_targets_dir: Path | None = None,
    install: bool = True,
) -> Telemetry:
    """Install the global tracer and meter providers the environment asks for (and a
    Prometheus endpoint at ``prometheus``); with nothing asked, install nothing.
    ``prometheus_targets_dir``: write the endpoint's ``prometheus_target`` file there
    once it serves (with port 0, the port the OS chose).
    ``install=False`` builds the providers without making them global (tests)."""
    plan = export_plan(env)
    if prometheus is not None and "prometheus" not in plan.metrics:
        plan = ExportPlan(plan.traces, (*plan.metrics, "prometheus"), plan.reason + "; --prometheus given")
    if "prometheus" in plan.metrics:
        require_prometheus()
    elif prometheus_targets_dir is not None:
        raise InvalidArgument("--prometheus-targets-dir lists a Prometheus endpoint: add --prometheus [HOST:]PORT")
    if not plan.traces and not plan.metrics:
        logger.debug("telemetry off (%s)", plan.reason)
        return Telemetry(plan)

    from opentelemetry import metrics, trace
    from opentelemetry.sdk.resources import Resource

    resource = Resource(resource_attributes(role, env, learner_id, shard_id, pool))
    tracer_provider = meter_provider = server = target_file = None
    if plan.traces:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider = TracerProvider(resource=resource)
        for kind in plan.traces:
            tracer_provider.add_span_processor(
                BatchSpanProcessor(
                    _span_exporter(kind, env),
                    max_queue_size=_count(env, "OTEL_BSP_MAX_QUEUE_SIZE"),
                    schedule_delay_millis=_millis(env, "OTEL_BSP_SCHEDULE_DELAY"),
                    max_export_batch_size=_count(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE"),
                    export_timeout_millis=_millis(env, "OTEL_BSP_EXPORT_TIMEOUT"),
                )
            )
        if install:
            trace.set_tracer_provider(tracer_provider)
    if plan.metrics:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers = []
        for kind in plan.metrics:
            if kind == "prometheus":
                from opentelemetry.exporter.prometheus import PrometheusMetricReader
                from prometheus_client import start_http_server

                host, port = prometheus or prometheus_address(
                    f"{env.get('OTEL_EXPORTER_PROMETHEUS_HOST', 'localhost')}:{env.get('OTEL_EXPORTER_PROMETHEUS_PORT', '9464')}"
                )
                readers.append(PrometheusMetricReader(resource_attribute_filter=PROMETHEUS_LABELS.__contains__))
                try:
                    server, _ = start_http_server(port, addr=host)
                except OSError as error:
                    raise InvalidArgument(f"cannot serve Prometheus metrics on {host}:{port}: {error.strerror}") from None
                logger.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_port)
                if prometheus_targets_dir is not None:
                    name, groups = prometheus_target(role, host, server.server_port, learner_id, shard_id)
                    target_file = Path(prometheus_targets_dir) / name
                    atomic_write(target_file, json.dumps(groups))
            else:
                readers.append(
                    PeriodicExportingMetricReader(
                        _metric_exporter(kind, env),
                        export_interval_millis=_millis(env, "OTEL_METRIC_EXPORT_INTERVAL"),
                        export_timeout_millis=_millis(env, "OTEL_METRIC_EXPORT_TIMEOUT"),
                    )
                )
        meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        if install:
            metrics.set_meter_provider(meter_provider)
    logger.info("telemetry on as %s: traces %s, metrics %s", resource.attributes["service.name"],
                ",".join(plan.traces) or "off", ",".join(plan.metrics) or "off")
    return Telemetry(plan, tracer_provider, meter_provider, server, target_file)


def _span_exporter(kind: str, env: Mapping[str, str]):
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(**_otlp_args(env, "TRACES"))


def _metric_exporter(kind: str, env: Mapping[str, str]):
    if kind == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return ConsoleMetricExporter()
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(**_otlp_args(env, "METRICS"))
