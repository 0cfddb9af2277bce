"""Traces across a real push: a learner's streamer pushes to a real shard on 127.0.0.1, and
the spans (recorded in memory) form one tree: ``sync fragment`` (learner) -> the RPC's
client span -> its server span -> ``push`` (shard); the shard's ``round`` span links to
every push it merged. Metrics land in an in-memory reader.

OpenTelemetry's global providers can be set once per process: the first test here sets
them for the rest of the session, and each test reads only the spans of its own traces.
"""

import asyncio
import time

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from diloco import auth
from diloco.learner.streamer import PushJob, Streamer
from diloco.learner.telemetry import LearnerTelemetry
from tests.grpc.conftest import SECRET, client_for, run, running_shard
from tests.grpc.test_syncer_service import FakeLearner

_INSTALLED: dict = {}


@pytest.fixture
def telemetry():
    """(span exporter, metric reader), installed globally once."""
    if not _INSTALLED:
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        if trace.get_tracer_provider() is not provider:
            pytest.skip("another test installed a global tracer provider first")
        _INSTALLED.update(exporter=exporter, reader=reader)
    _INSTALLED["exporter"].clear()
    yield _INSTALLED["exporter"], _INSTALLED["reader"]
    _INSTALLED["exporter"].clear()


def wait_for_spans(exporter, predicate, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while True:
        spans = exporter.get_finished_spans()
        if predicate(spans):
            return spans
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {[s.name for s in spans]}"
        time.sleep(0.02)


def one(spans, name, kind=None, **attributes):
    found = [
        s for s in spans
        if s.name == name and (kind is None or s.kind == kind)
        and all(s.attributes.get(k) == v for k, v in attributes.items())
    ]
    assert len(found) == 1, f"{len(found)} spans named {name!r} with {attributes}: {[(s.name, dict(s.attributes)) for s in spans]}"
    return found[0]


def metric_points(reader, name):
    points = []
    for resource_metrics in reader.get_metrics_data().resource_metrics:
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    points.extend(metric.data.data_points)
    return points


def test_sync_span_is_the_parent_of_the_shards_push_span_and_the_round_links_every_push(tmp_path, telemetry):
    exporter, reader = telemetry

    async def scenario():
        async with running_shard(tmp_path, learners=("L0", "L1"), quorum=2, grace_mode="off") as (server, address):
            # L0: the learner's own path, a SyncTrace through the streamer's event loop thread.
            streamer = Streamer({0: address}, auth.Credential("L0", secret=SECRET), timeout_s=20)
            learner_telemetry = LearnerTelemetry("L0")
            try:
                fake = FakeLearner.of(server, "L0")
                sync = learner_telemetry.start_sync(fragment=0, shard=0, base_version=0, step=7)
                meta, encoded = fake.next_push()
                sync.phase("encode", 0.001)
                assert streamer.submit(PushJob(0, meta, encoded, fake.anchor, 7, sync))
                # L1: a plain client push completes the quorum.
                async with client_for(address, "L1") as client:
                    await FakeLearner.of(server, "L1", seed=1).push(client)
                reply = await asyncio.to_thread(streamer.replies.get, True, 20)
                sync.received = True
                sync.applied(0.0005, reply.staleness)
            finally:
                await asyncio.to_thread(streamer.close, 10)
            return reply

    reply = run(scenario())
    assert reply.version == 1

    def complete(spans):
        names = [s.name for s in spans]
        return "sync fragment" in names and names.count("push") == 2 and "round" in names

    spans = wait_for_spans(exporter, complete, "the sync, both pushes and the round")
    sync = one(spans, "sync fragment")
    # L0's client span; L1's push ran outside any sync span, so its client span is a root.
    client = next(s for s in spans if s.kind == SpanKind.CLIENT and s.parent is not None
                  and s.parent.span_id == sync.context.span_id)
    servers = [s for s in spans if s.kind == SpanKind.SERVER and s.name == "/diloco.v1.Syncer/PushFragment"]
    server = next(s for s in servers if s.parent is not None and s.parent.span_id == client.context.span_id)
    push = one(spans, "push", **{"diloco.learner.id": "L0"})
    other_push = one(spans, "push", **{"diloco.learner.id": "L1"})
    round_span = one(spans, "round")

    # One trace: sync fragment -> client RPC -> server RPC -> push.
    trace_id = sync.context.trace_id
    assert sync.parent is None
    assert {client.context.trace_id, server.context.trace_id, push.context.trace_id} == {trace_id}
    assert client.parent.span_id == sync.context.span_id
    assert server.parent.span_id == client.context.span_id and server.parent.is_remote
    assert push.parent.span_id == server.context.span_id
    assert other_push.context.trace_id != trace_id

    # The round is its own trace, linked to both pushes it merged.
    assert round_span.parent is None and round_span.context.trace_id != trace_id
    linked = {(link.context.trace_id, link.context.span_id) for link in round_span.links}
    assert linked == {(p.context.trace_id, p.context.span_id) for p in (push, other_push)}

    a = sync.attributes
    assert (a["diloco.learner.id"], a["diloco.fragment"], a["diloco.shard.id"]) == ("L0", 0, 0)
    assert (a["diloco.base_version"], a["diloco.version"], a["diloco.staleness"]) == (0, 1, 0)
    assert a["diloco.bytes_up"] > 0 and a["diloco.bytes_down"] > 0
    for phase in ("encode", "send", "wait", "decode", "apply", "overlap_wait"):
        assert a[f"diloco.{phase}_s"] >= 0, phase
    assert a["diloco.outcome"] == "applied" and a["diloco.push.outcome"] == "accepted"
    assert [e.name for e in sync.events] == ["acked"]

    p = push.attributes
    assert (p["diloco.fragment"], p["diloco.base_version"], p["diloco.push.outcome"], p["diloco.target_version"]) == (
        0, 0, "accepted", 1)
    assert p["diloco.bytes_up"] == a["diloco.bytes_up"]
    assert [e.name for e in push.events] == ["round closed"]

    r = round_span.attributes
    assert (r["diloco.fragment"], r["diloco.version"], r["diloco.shard.id"]) == (0, 1, 0)
    assert sorted(r["diloco.participants"]) == ["L0", "L1"]
    assert len(r["diloco.weights"]) == 2 and abs(sum(r["diloco.weights"]) - 1) < 1e-5
    assert r["diloco.close_reason"] == "all 2 live learners pushed"
    assert r["diloco.quorum_wait_s"] >= 0 and r["diloco.grace_wait_s"] >= 0 and r["diloco.merge_s"] > 0
    # The round span covers the round: from its first push accepted to the update in place.
    assert min(push.start_time, other_push.start_time) <= round_span.start_time < round_span.end_time
    assert round_span.end_time <= max(push.end_time, other_push.end_time)

    # Metrics, through the same API.
    latency = metric_points(reader, "diloco.sync.latency")
    assert sum(pt.count for pt in latency) >= 1
    participants = metric_points(reader, "diloco.round.participants")
    assert any(pt.count >= 1 and pt.max == 2 for pt in participants)
    directions = {pt.attributes["diloco.direction"] for pt in metric_points(reader, "diloco.wire.bytes")}
    assert directions == {"up", "down"}
    for name in ("diloco.round.grace", "diloco.round.quorum_wait", "diloco.round.merge", "diloco.push.received",
                 "diloco.round.merged_steps", "diloco.learner.version_lag"):
        assert metric_points(reader, name), name


def test_a_push_the_streamer_drops_ends_its_span_as_dropped(telemetry):
    exporter, reader = telemetry
    # No shard behind the address: with no push in flight allowed, the streamer drops it at once.
    streamer = Streamer({0: "127.0.0.1:1"}, auth.Credential("L0", "x"), timeout_s=5, max_inflight=0)
    try:
        sync = LearnerTelemetry("L0").start_sync(fragment=1, shard=0, base_version=3, step=2)
        assert not streamer.submit(PushJob(0, None, [], [], 2, sync))
    finally:
        streamer.close(5)
    span = one(exporter.get_finished_spans(), "sync fragment")
    assert span.attributes["diloco.outcome"] == "dropped" and span.attributes["diloco.reason"] == "inflight_limit"
    assert any(pt.attributes == {"diloco.reason": "inflight_limit"} for pt in metric_points(reader, "diloco.push.dropped"))


def test_a_push_rejected_by_the_shard_ends_its_span_with_the_status(tmp_path, telemetry):
    exporter, _ = telemetry

    async def scenario():
        async with running_shard(tmp_path, learners=("L0",)) as (server, address):
            streamer = Streamer({0: address}, auth.Credential("L0", "not-the-credential"), timeout_s=20)
            try:
                fake = FakeLearner.of(server, "L0")
                meta, encoded = fake.next_push()
                sync = LearnerTelemetry("L0").start_sync(fragment=0, shard=0, base_version=0, step=0)
                assert streamer.submit(PushJob(0, meta, encoded, fake.anchor, 0, sync))
                await asyncio.to_thread(wait_for_spans, exporter, lambda s: any(x.name == "sync fragment" for x in s),
                                        "the sync span")
            finally:
                await asyncio.to_thread(streamer.close, 10)

    run(scenario())
    spans = exporter.get_finished_spans()
    sync = one(spans, "sync fragment")
    assert sync.attributes["diloco.outcome"] == "failed"
    assert sync.status.status_code == trace.StatusCode.ERROR and "UNAUTHENTICATED" in sync.status.description
    server = next(s for s in spans if s.kind == SpanKind.SERVER)
    assert server.context.trace_id == sync.context.trace_id
    push = one(spans, "push")
    assert push.parent.span_id == server.context.span_id and push.status.status_code == trace.StatusCode.ERROR


def test_where_each_fragment_s_values_came_from_is_traced(tmp_path, telemetry):
    """A fragment's values from a learner's initial offer, and, on a shard that restarted
    without its state, from a learner's anchor: each a ``fragment values`` span."""
    from tests.grpc.test_syncer_initialize import MANIFEST, PLAN, empty_shard, fp32

    exporter, _ = telemetry

    async def scenario():
        async with empty_shard(tmp_path / "fresh") as (server, address):
            async with client_for(address, "L1") as client:
                assert await client.initialize(0, MANIFEST.to_json(), PLAN.plan_hash, fp32(0))
        async with empty_shard(tmp_path / "fresh") as (server, address):  # same data dir: it held the model
            assert server.runtime.anchors_only
            async with client_for(address, "L0") as client:
                assert await client.initialize(1, MANIFEST.to_json(), PLAN.plan_hash, fp32(1), anchor_version=7)

    run(scenario())
    spans = wait_for_spans(exporter, lambda s: sum(x.name == "fragment values" for x in s) == 2, "two fragment values spans")
    values = sorted((dict(s.attributes) for s in spans if s.name == "fragment values"), key=lambda a: a["diloco.fragment"])
    assert [(a["diloco.fragment"], a["diloco.source"], a["diloco.origin"], a["diloco.version"]) for a in values] == \
        [(0, "initial", "L1", 0), (1, "anchor", "L0", 7)]
