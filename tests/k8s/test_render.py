"""Every preset and value combination renders with the real Helm engine, lints clean,
and every object it makes passes the Kubernetes API's own schema in strict mode (no
unknown fields), on the oldest Kubernetes the chart supports and the newest known."""

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.k8s.chart import (CHART, CRD_KINDS, EXISTING_SECRET, MULTIHOST_PRESETS, PRESETS, REGISTRY, container, merge,
                             preset)
from tests.k8s.conftest import DIGEST, VARIANTS

KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
RENDERS = (*PRESETS, *MULTIHOST_PRESETS, *VARIANTS)


@pytest.mark.parametrize("name", PRESETS + MULTIHOST_PRESETS)
def test_preset_lints_clean(name):
    report = helm.lint(CHART, merge(preset(name), EXISTING_SECRET), strict=True, namespace="ml", kube_version="v1.29.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_lint_reports_what_is_wrong():
    """The lint check above can fail: without credentials it reports the schema error."""
    report = helm.lint(CHART, {}, strict=True)
    assert any("/auth" in m["error"] for m in report["messages"] if m["severity"] == 3), report


@pytest.mark.parametrize("name", RENDERS)
def test_every_object_is_valid_kubernetes_in_strict_mode(renders, name):
    """(JobSets: test_multihost.py validates them against their CRD's schema.)"""
    objects = renders[name].objects
    assert len(objects) >= 10
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            if obj["kind"] in CRD_KINDS:
                continue
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", PRESETS)
def test_launched_learner_pods_are_valid_kubernetes_in_strict_mode(launched, name):
    pods, _ = launched[name]
    assert pods
    for version in KUBERNETES_VERSIONS:
        for pod in pods:
            kubernetes_validate.validate(pod, version, strict=True)


def test_strict_validation_rejects_an_unknown_field():
    """What 'strict' buys: a misspelt field is an error, not silently dropped."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "i", "readinessProbes": {}}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES_VERSIONS[0], strict=True)


@pytest.mark.parametrize("name", RENDERS)
def test_every_object_lives_in_the_release_namespace_with_release_labels(renders, name):
    for obj in renders[name].objects:
        meta = obj["metadata"]
        assert meta["namespace"] == "ml", f"{obj['kind']}/{meta['name']}"
        assert meta["labels"]["app.kubernetes.io/instance"] == "diloco"
        assert meta["labels"]["app.kubernetes.io/name"] == "diloco"
        assert len(meta["name"]) <= 63


@pytest.mark.parametrize("name", RENDERS)
def test_no_two_objects_share_a_kind_and_name(renders, name):
    """Helm refuses a release with two objects of one kind and name (the static learners'
    JobSets, one per learner, are numbered)."""
    keys = [(o["kind"], o["metadata"]["name"]) for o in renders[name].objects]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


@pytest.mark.parametrize("name", RENDERS)
def test_references_resolve(renders, name):
    """Every volume, ConfigMap, Secret and claim a pod names is rendered by the chart (or
    is one the values name as existing), and every mount has its volume."""
    rendered = renders[name]
    values = rendered.values
    existing_secrets = {values["auth"]["existingSecret"], values["tls"]["existingSecret"]} - {""}
    existing_claims = {values["snapshots"]["existingClaim"], values["coordinator"]["persistence"]["existingClaim"]} - {""}
    sts_claims = {t["metadata"]["name"] for s in rendered.all("StatefulSet") for t in s["spec"].get("volumeClaimTemplates", [])}
    pods = {**rendered.workload_pods(), **{f"template/{k}": v for k, v in rendered.pod_templates().items()}} \
        if values["scavenging"]["enabled"] else rendered.workload_pods()
    for where, pod in pods.items():
        volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
        for c in pod["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or m["name"] in sts_claims, f"{where}: mount {m['name']} has no volume"
        for v in volumes.values():
            if "configMap" in v:
                assert rendered.named("ConfigMap", v["configMap"]["name"]), f"{where}: {v}"
            if "secret" in v:
                name = v["secret"]["secretName"]  # the user's, or one the chart makes or has cert-manager make
                assert name in existing_secrets or rendered.named("Secret", name) or rendered.named("Certificate", name)
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                assert claim in existing_claims or rendered.named("PersistentVolumeClaim", claim), f"{where}: {claim}"


def test_digests_pin_every_image(variants):
    rendered = variants["restore-pinned"]
    images = {c["image"] for pod in rendered.workload_pods().values() for c in pod["spec"]["containers"]}
    images |= {c["image"] for t in rendered.pod_templates().values() for c in t["spec"]["containers"]}
    assert images == {f"us-docker.pkg.dev/p/r/diloco@{DIGEST}", f"us-docker.pkg.dev/p/r/diloco-tpu@{DIGEST}"}


def test_images_default_to_the_chart_app_version(presets):
    rendered = presets["values-tpu-v5e.yaml"]
    app_version = helm.Chart.load(CHART).metadata["appVersion"]
    assert rendered.one("StatefulSet")["spec"]["template"]["spec"]["containers"][0]["image"] == \
        f"{REGISTRY}/diloco:{app_version}"
    [job] = rendered.all("Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == f"{REGISTRY}/diloco-tpu:{app_version}"


@pytest.mark.parametrize("given,missing", [
    ({}, "image.repository"),
    ({"image": {"repository": f"{REGISTRY}/diloco"}}, "learners.images.tpu.repository"),
    ({"image": {"repository": f"{REGISTRY}/diloco"}, "learners": {"accelerator": "gpu"}}, "learners.images.gpu.repository"),
])
def test_an_install_that_does_not_name_its_image_repositories_fails_at_render_naming_the_value(chart, given, missing):
    """The chart's repositories defaulted to bare names (diloco, diloco-tpu) no cluster can
    pull: the install went through and every pod sat in ImagePullBackOff. Without them the
    render now fails, naming the value and how to set it."""
    with pytest.raises(helm.HelmError) as error:
        chart.render(merge(EXISTING_SECRET, given), images={})
    assert f"{missing} is required: the registry path of" in str(error.value)
    assert f"--set {missing}=$REGISTRY/" in str(error.value)


def test_cpu_learners_run_the_chart_s_image_unless_given_their_own(chart):
    values = merge(EXISTING_SECRET, {"image": {"repository": f"{REGISTRY}/diloco"}, "learners": {"accelerator": "cpu"}})
    [job] = chart.render(values, images={}).all("Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["image"].startswith(f"{REGISTRY}/diloco:")


def test_notes_say_how_to_add_scavenged_learners_and_where_traces_go(presets, variants):
    notes = presets["values-tpu-v5e.yaml"].notes
    assert "diloco admin --token-file admin-token add-learners 4 --pool v5e-spot" in notes
    assert "port-forward svc/diloco-coordinator 50051:50051" in notes
    assert "AddLearners" in notes
    assert "set otel.endpoint" in notes
    assert "exports OTLP/gRPC to http://otel-collector.observability.svc:4317" in variants["observability"].notes
    assert "add-learners is refused" in variants["static-only"].notes


def test_the_status_page_is_on_loopback_and_notes_say_how_to_reach_it(presets, variants):
    rendered = presets["values-tpu-v5e.yaml"]
    deployment = rendered.one("Deployment", "coordinator")
    coordinator_args = container(deployment["spec"]["template"], "coordinator")["args"]
    at = coordinator_args.index("--status-port")
    assert coordinator_args[at + 1] == "8080" and "--status-host" not in coordinator_args  # its default: 127.0.0.1
    assert f"port-forward deploy/{deployment['metadata']['name']} 8080:8080" in rendered.notes
    assert "open http://127.0.0.1:8080/" in rendered.notes
    for service in rendered.all("Service"):  # no Service exposes it
        assert 8080 not in [p.get("targetPort", p["port"]) for p in service["spec"]["ports"]], service["metadata"]["name"]


def test_monitoring_objects_only_behind_the_flag(presets, variants):
    for rendered in presets.values():
        assert not {o["kind"] for o in rendered.objects} & CRD_KINDS
    rendered = variants["observability"]
    pod_monitoring = rendered.one("PodMonitoring")
    service_monitor = rendered.one("ServiceMonitor")
    assert pod_monitoring["apiVersion"] == "monitoring.googleapis.com/v1"
    assert service_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert pod_monitoring["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "diloco",
                                                                "app.kubernetes.io/instance": "diloco"}
    assert [e["port"] for e in pod_monitoring["spec"]["endpoints"]] == ["metrics"]
    metrics_service = rendered.one("Service", "-metrics")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()
    # Every process, launched learners included, exposes the port the monitors scrape.
    pods = [*rendered.workload_pods().values(), *rendered.pod_templates().values()]
    for pod in pods:
        if pod["metadata"]["labels"]["app.kubernetes.io/component"] == "test":
            continue
        ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert ports["metrics"] == 9464


SCRAPE = {"prometheus.io/scrape": "true", "prometheus.io/port": "9464", "prometheus.io/path": "/metrics"}


def scrape_annotations(rendered) -> dict[str, dict]:
    """Each pod's prometheus.io annotations, by workload (the launcher's templates as template/<pool>)."""
    pods = {**rendered.workload_pods(), **{f"template/{p}": t for p, t in rendered.pod_templates().items()}}
    return {name: {k: v for k, v in (pod["metadata"].get("annotations") or {}).items() if k.startswith("prometheus.io/")}
            for name, pod in pods.items()}


def test_scrape_annotations_name_the_metrics_port_of_every_pod_that_serves_one(chart, presets, variants):
    for rendered in presets.values():  # metrics off
        assert not any(scrape_annotations(rendered).values())
    annotated = scrape_annotations(variants["observability"])
    assert {name.split("/")[0] for name, a in annotated.items() if a} == {"Deployment", "StatefulSet", "Job", "template"}
    for name, annotations in annotated.items():
        assert annotations == ({} if name.startswith("Pod/") else SCRAPE), name  # the helm test serves nothing
    # They follow the port; off with scrapeAnnotations false, the port still served.
    moved = chart.render(merge(EXISTING_SECRET, {"metrics": {"enabled": True, "port": 9100}}))
    assert {a["prometheus.io/port"] for a in scrape_annotations(moved).values() if a} == {"9100"}
    quiet = chart.render(merge(EXISTING_SECRET, {"metrics": {"enabled": True, "scrapeAnnotations": False}}))
    assert not any(scrape_annotations(quiet).values())
    assert "(annotated prometheus.io/scrape)" in variants["observability"].notes and "annotated" not in quiet.notes
    ports = [p for pod in quiet.workload_pods().values() for c in pod["spec"]["containers"] for p in c.get("ports", [])]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in ports


def test_the_service_monitor_is_rendered_only_when_asked_and_selects_the_metrics_service(chart):
    metrics_on = chart.render(merge(EXISTING_SECRET, {"metrics": {"enabled": True}}))
    assert not {o["kind"] for o in metrics_on.objects} & CRD_KINDS and metrics_on.named("Service", "diloco-metrics") is None
    labelled = chart.render(merge(EXISTING_SECRET, {"metrics": {"enabled": True, "interval": "15s", "serviceMonitor": {
        "enabled": True, "labels": {"release": "kube-prometheus-stack"}}}}))
    monitor, service = labelled.one("ServiceMonitor"), labelled.one("Service", "-metrics")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # what the operator selects monitors by
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "15s"}]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["ports"][0]["targetPort"] == "metrics"
    # The headless Service selects every process of the release, the launched learners' templates included.
    pods = [*labelled.workload_pods().values(), *labelled.pod_templates().values()]
    selected = [p for p in pods if service["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in selected} >= {"coordinator", "syncer", "learner"}


# --- the validator (validator.enabled) ------------------------------------------------------


def _components(rendered) -> set[str]:
    return {o["metadata"]["labels"].get("app.kubernetes.io/component") for o in rendered.objects}


@pytest.mark.parametrize("name", [*PRESETS, *MULTIHOST_PRESETS, *(v for v in VARIANTS if v != "validator")])
def test_without_the_validator_nothing_of_it_is_rendered_and_shards_keep_no_samples(renders, name):
    rendered = renders[name]
    assert rendered.values["validator"]["enabled"] is False
    assert "validator" not in _components(rendered)
    assert "validator" not in rendered.notes
    assert "validator" not in yaml.safe_dump_all(rendered.all("NetworkPolicy"))
    for sts in rendered.all("StatefulSet"):
        assert "--validator" not in container(sts["spec"]["template"], "syncer")["args"]


def test_the_validator_is_one_deployment_on_the_nodes_its_values_name(variants):
    rendered = variants["validator"]
    values = rendered.values["validator"]
    deployment = rendered.one("Deployment", "-validator")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert {o["kind"] for o in rendered.objects if o["metadata"]["labels"].get("app.kubernetes.io/component") == "validator"} \
        == {"Deployment"}, "a client of the shards: no Service, no claim"
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    spec = pod["spec"]
    assert spec["nodeSelector"] == values["nodeSelector"] and spec["tolerations"] == values["tolerations"]
    assert spec["affinity"] == values["affinity"] and spec["automountServiceAccountToken"] is False
    c = container(pod, "validator")
    assert c["resources"] == values["resources"]
    assert c["image"] == container(rendered.one("StatefulSet", "-syncer")["spec"]["template"], "syncer")["image"]
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & set(c), "it serves no port (metrics off)"
    assert {"name": "corpus", "mountPath": "/data", "readOnly": True} in c["volumeMounts"]
    sts = rendered.one("StatefulSet", "-syncer")
    assert container(sts["spec"]["template"], "syncer")["args"].count("--validator") == 1
    assert "kubectl -n ml logs deploy/diloco-validator" in rendered.notes and "every 2.5 s" in rendered.notes


def test_the_validator_serves_metrics_when_the_release_does(chart):
    rendered = chart.render(merge(EXISTING_SECRET, {"validator": {"enabled": True}, "metrics": {"enabled": True}}))
    pod = rendered.one("Deployment", "-validator")["spec"]["template"]
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in container(pod, "validator")["ports"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9464"
