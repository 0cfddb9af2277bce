"""OpenTelemetry configuration from the OTEL_* environment: what is exported when, the
resource, the Prometheus flag (and its message when the extra is missing)."""

import json
import socket
import sys
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from opentelemetry import metrics, trace

from diloco import telemetry
from diloco import command as cli
from diloco.errors import InvalidArgument


@pytest.mark.parametrize(
    "env, traces, metric_exporters",
    [
        ({}, (), ()),
        ({"OTEL_SERVICE_NAME": "x", "OTEL_RESOURCE_ATTRIBUTES": "a=b"}, (), ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ("otlp",), ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ("otlp",), ()),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://collector:4317"}, (), ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_METRICS_EXPORTER": "none"}, ("otlp",), ()),
        ({"OTEL_TRACES_EXPORTER": "console"}, ("console",), ()),
        ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_METRICS_EXPORTER": "prometheus"}, ("otlp", "console"), ("prometheus",)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "true"}, (), ()),
    ],
)
def test_nothing_is_exported_unless_the_environment_names_an_exporter(env, traces, metric_exporters):
    plan = telemetry.export_plan(env)
    assert (plan.traces, plan.metrics) == (traces, metric_exporters), plan.reason


def test_unsupported_exporters_and_protocols_are_refused_with_the_fix():
    with pytest.raises(InvalidArgument, match="supported are otlp, console"):
        telemetry.export_plan({"OTEL_TRACES_EXPORTER": "zipkin"})
    with pytest.raises(InvalidArgument, match="OTLP over gRPC only"):
        telemetry.export_plan({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})


def test_resource_names_the_service_per_role_and_carries_the_diloco_ids():
    learner = telemetry.resource_attributes("learner", {}, learner_id="L3", pool="spot")
    assert learner["service.name"] == "diloco-learner"
    assert (learner["diloco.learner.id"], learner["diloco.pool"]) == ("L3", "spot")
    shard = telemetry.resource_attributes("syncer", {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,team=ml%20infra"},
                                          shard_id=2)
    assert shard["service.name"] == "diloco-syncer" and shard["diloco.shard.id"] == 2
    assert (shard["deployment.environment"], shard["team"]) == ("prod", "ml infra")
    assert telemetry.resource_attributes("coordinator", {})["service.name"] == "diloco-coordinator"
    # OTEL_SERVICE_NAME wins over the attribute, which wins over the role's default.
    env = {"OTEL_SERVICE_NAME": "trainer", "OTEL_RESOURCE_ATTRIBUTES": "service.name=ignored"}
    assert telemetry.resource_attributes("syncer", env)["service.name"] == "trainer"
    assert telemetry.resource_attributes("syncer", {"OTEL_RESOURCE_ATTRIBUTES": "service.name=s"})["service.name"] == "s"
    with pytest.raises(InvalidArgument, match="not key=value"):
        telemetry.resource_attributes("syncer", {"OTEL_RESOURCE_ATTRIBUTES": "novalue"})


def test_start_with_nothing_configured_installs_nothing():
    tracer_provider, meter_provider = trace.get_tracer_provider(), metrics.get_meter_provider()
    handle = telemetry.start("learner", {}, learner_id="L0")
    assert handle.tracer_provider is None and handle.meter_provider is None
    assert trace.get_tracer_provider() is tracer_provider and metrics.get_meter_provider() is meter_provider
    handle.shutdown()


def test_start_builds_providers_from_the_mapping_it_is_given():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_METRIC_EXPORT_INTERVAL": "60000"}
    handle = telemetry.start("syncer", env, shard_id=1, install=False)
    try:
        assert handle.tracer_provider.resource.attributes["service.name"] == "diloco-syncer"
        assert handle.tracer_provider.resource.attributes["diloco.shard.id"] == 1
        assert handle.meter_provider is not None
    finally:
        handle.shutdown(timeout_s=10)  # nothing was recorded: nothing to send to the dead endpoint
    with pytest.raises(InvalidArgument, match="OTEL_BSP_SCHEDULE_DELAY"):
        telemetry.start("syncer", {**env, "OTEL_BSP_SCHEDULE_DELAY": "soon"}, install=False)


def test_prometheus_address():
    assert telemetry.prometheus_address("9464") == ("0.0.0.0", 9464)
    assert telemetry.prometheus_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert telemetry.prometheus_address("[::1]:9000") == ("::1", 9000)
    for bad in ("http", "1:2:x", "70000"):
        with pytest.raises(InvalidArgument):
            telemetry.prometheus_address(bad)


def test_prometheus_endpoint_serves_the_metrics_with_the_resource():
    pytest.importorskip("opentelemetry.exporter.prometheus")
    handle = telemetry.start("syncer", {}, shard_id=0, prometheus=("127.0.0.1", 0), install=False)
    try:
        assert handle.tracer_provider is None  # the flag turns on metrics only
        from diloco.syncer.telemetry import ShardTelemetry

        shard = ShardTelemetry(0, meter=handle.meter_provider.get_meter("test"))
        shard.push_received("accepted", 0, 1234)
        with urllib.request.urlopen(f"http://127.0.0.1:{handle.prometheus_port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        handle.shutdown()
    assert "diloco_wire_bytes" in text and 'diloco_direction="up"' in text
    assert 'service_name="diloco-syncer"' in text


def test_prometheus_flag_without_the_extra_fails_with_a_message_not_a_traceback(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.prometheus", None)  # import raises ImportError
    (tmp_path / "secret").write_text("s")
    code = cli.main(["--insecure", "syncer", "--prometheus", "0", "--secret-file", str(tmp_path / "secret"), "--learners", "L0"])
    assert code == 2
    err = capsys.readouterr().err
    assert "diloco[metrics]" in err and "Traceback" not in err


def test_prometheus_target_names_the_process_as_endpoints_json_does_and_labels_it():
    assert telemetry.prometheus_target("learner", "127.0.0.1", 9100, learner_id="L3") == (
        "L3.json", [{"targets": ["127.0.0.1:9100"], "labels": {"role": "learner", "learner": "L3"}}])
    assert telemetry.prometheus_target("syncer", "::1", 9101, shard_id=1) == (
        "shard1.json", [{"targets": ["[::1]:9101"], "labels": {"role": "shard", "shard": "1"}}])
    name, [group] = telemetry.prometheus_target("coordinator", "0.0.0.0", 9102)
    assert name == "coordinator.json" and group["labels"] == {"role": "coordinator"}
    assert group["targets"] == [f"{socket.getfqdn()}:9102"]  # every interface: this host's name, not 0.0.0.0
    with pytest.raises(InvalidArgument, match="cannot name a Prometheus target file"):
        telemetry.prometheus_target("learner", "127.0.0.1", 9100, learner_id="../L0")


def test_the_endpoint_lists_itself_with_the_port_it_got_and_unlists_itself_at_shutdown(tmp_path):
    pytest.importorskip("opentelemetry.exporter.prometheus")
    handle = telemetry.start("learner", {}, learner_id="L2", pool="spot", prometheus=("127.0.0.1", 0),
                             prometheus_targets_dir=tmp_path / "targets", install=False)
    try:
        assert json.loads((tmp_path / "targets" / "L2.json").read_text()) == [
            {"targets": [f"127.0.0.1:{handle.prometheus_port}"], "labels": {"role": "learner", "learner": "L2"}}]
        from diloco.learner.telemetry import LearnerTelemetry

        LearnerTelemetry("L2", meter=handle.meter_provider.get_meter("test")).train_loss(2.5, "bits/byte")
        with urllib.request.urlopen(f"http://127.0.0.1:{handle.prometheus_port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        handle.shutdown()
    # The learner's ids are on its series, not only on target_info: a scraper that knows only the pod tells learners apart.
    (loss,) = [line for line in text.splitlines() if line.startswith("diloco_learner_train_loss{")]
    assert 'diloco_learner_id="L2"' in loss and 'diloco_pool="spot"' in loss and loss.endswith(" 2.5")
    assert 'diloco_eval_unit="bits/byte"' in loss
    assert not (tmp_path / "targets" / "L2.json").exists()


def test_a_targets_dir_without_an_endpoint_is_refused():
    with pytest.raises(InvalidArgument, match="add --prometheus"):
        telemetry.start("syncer", {}, shard_id=0, prometheus_targets_dir=Path("/nonexistent"), install=False)


def test_the_shard_counts_rounds_and_the_coordinator_reports_its_members_by_state_and_pool():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from diloco.coordinator.telemetry import CoordinatorTelemetry
    from diloco.syncer.telemetry import ShardTelemetry

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    counts = {("active", "default"): 2, ("left", "spot"): 1}
    CoordinatorTelemetry(meter=meter, members=lambda: counts)
    shard = ShardTelemetry(0, meter=meter)
    for fragment in (0, 2, 2):
        job = SimpleNamespace(fragment=SimpleNamespace(id=fragment), pushes=[], weights=[], version=1, quorum_s=0.0,
                              grace_s=0.0, reason="quorum")
        shard.round_closed(job, 0.01, [], 0, 1)

    def points(name: str) -> dict:
        (metric,) = [m for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                     for m in sm.metrics if m.name == name]
        return {tuple(sorted(p.attributes.items())): p.value for p in metric.data.data_points}

    assert points("diloco.coordinator.members") == {
        (("diloco.pool", "default"), ("diloco.state", "active")): 2, (("diloco.pool", "spot"), ("diloco.state", "left")): 1}
    assert points("diloco.round.closed") == {(("diloco.fragment", 0),): 1, (("diloco.fragment", 2),): 2}


def test_every_process_the_command_line_starts_has_a_service_name():
    """A role the CLI starts telemetry for but ``SERVICE_NAMES`` lacks would stop that
    process at start whenever metrics or OTLP are on (the validator once did)."""
    import ast
    from pathlib import Path

    from diloco.telemetry import SERVICE_NAMES

    cli = Path(__file__).resolve().parents[2] / "diloco" / "cli"
    roles = {call.args[1].value for path in cli.rglob("*.py") for call in ast.walk(ast.parse(path.read_text()))
             if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "start_telemetry"
             and len(call.args) > 1 and isinstance(call.args[1], ast.Constant)}
    assert roles >= {"learner", "syncer", "coordinator", "validator"}
    assert roles <= set(SERVICE_NAMES)
