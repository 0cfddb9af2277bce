"""A minimal OTLP/gRPC receiver on 127.0.0.1: the trace and metrics services of the
OpenTelemetry collector protocol, keeping what the real exporters of diloco processes send.
For ``diloco bench learner --tracing`` (a real exporter with somewhere to send) and for the
end-to-end telemetry test; not a collector to run anything against.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    """Empty for a root span."""
    kind: int
    attributes: dict = field(repr=False)
    resource: dict = field(repr=False)
    links: tuple[tuple[str, str], ...] = ()
    """(trace id, span id) of each link."""


def _value(value: AnyValue):
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: list[KeyValue]) -> dict:
    return {kv.key: _value(kv.value) for kv in pairs}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer, metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._metrics: dict[tuple[str, str], int] = {}
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self.endpoint = f"http://{host}:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=1).wait()

    def Export(self, request, context):
        if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
            received = []
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        received.append(ReceivedSpan(
                            service=resource.get("service.name", ""), name=span.name, trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(), kind=span.kind,
                            attributes=_attributes(span.attributes), resource=resource,
                            links=tuple((link.trace_id.hex(), link.span_id.hex()) for link in span.links),
                        ))
            with self._lock:
                self._spans.extend(received)
            return trace_service_pb2.ExportTraceServiceResponse()
        with self._lock:
            for resource_metrics in request.resource_metrics:
                service = _attributes(resource_metrics.resource.attributes).get("service.name", "")
                for scope in resource_metrics.scope_metrics:
                    for metric in scope.metrics:
                        key = (service, metric.name)
                        self._metrics[key] = self._metrics.get(key, 0) + 1
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def metrics(self) -> dict[tuple[str, str], int]:
        """(service name, metric name) -> exports that carried it."""
        with self._lock:
            return dict(self._metrics)
