import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from diloco.coordinator.config import KubernetesLauncherConfig
from diloco.coordinator.kubernetes import KubernetesLauncher
from diloco.command import build_parser
from tests.k8s.chart import (
    EXISTING_SECRET,
    INLINE_SECRET,
    MULTIHOST_PRESETS,
    PRESETS,
    Chart,
    Rendered,
    args,
    container,
    merge,
    mounted,
    preset,
)

DIGEST = "sha256:" + "ab" * 32
CUSTOM_TASK = "/opt/task/mytask.py:build"
# Keys out of order, a dotted key, '=' and spaces in values: rendered sorted, kept verbatim.
CUSTOM_OPTIONS = {"vocab": "32000", "layers": "12", "optim.betas": "0.9,0.95", "note": "a=b c"}
# Value combinations beyond the presets; each is rendered once per session.
VARIANTS = {
    "defaults": INLINE_SECRET,
    "observability": merge(EXISTING_SECRET, {
        "otel": {"endpoint": "http://otel-collector.observability.svc:4317", "sampler": "parentbased_traceidratio",
                 "samplerArg": "0.1", "resourceAttributes": {"deployment.environment": "prod east", "team": "ml"}},
        "metrics": {"enabled": True, "podMonitoring": {"enabled": True}, "serviceMonitor": {"enabled": True}},
    }),
    "static-only": merge(EXISTING_SECRET, {"scavenging": {"enabled": False}, "learners": {"replicas": 3}}),
    "scavenged-only": merge(EXISTING_SECRET, {"learners": {"replicas": 0}}),
    "gpu": merge(EXISTING_SECRET, {"run": {"taskOptions": {"data": "/data/corpus"}}, "learners": {
        "accelerator": "gpu", "gpu": {"accelerator": "nvidia-h100-80gb", "count": 8},
        "podAnnotations": {"gke-gcsfuse/volumes": "true"},
        "extraVolumes": [{"name": "corpus", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": True,
                                                    "volumeAttributes": {"bucketName": "corpus"}}}],
        "extraVolumeMounts": [{"name": "corpus", "mountPath": "/data", "readOnly": True}],
    }}),
    # A task of the user's own, in a learner image built FROM the diloco one (docs/kubernetes.md).
    "custom-task": merge(EXISTING_SECRET, {
        "run": {"task": CUSTOM_TASK, "taskOptions": CUSTOM_OPTIONS, "seed": 7},
        "learners": {"images": {"tpu": {"repository": "us-docker.pkg.dev/p/r/mytask-tpu", "tag": "3"}}},
        "scavenging": {"pools": [{"name": "spot-a", "spot": True}, {"name": "spot-b", "spot": True}]},
    }),
    "ephemeral": merge(EXISTING_SECRET, {
        "coordinator": {"persistence": {"enabled": False}}, "syncer": {"persistence": {"enabled": False}},
        "snapshots": {"enabled": False}, "networkPolicy": {"enabled": False},
    }),
    # Mutual TLS from the user's Secret; probes on the plaintext health port. (The
    # defaults have TLS with certificates Helm generates.)
    "tls": merge(EXISTING_SECRET, {"tls": {"enabled": True, "existingSecret": "diloco-tls"}}),
    "tls-cert-manager": merge(EXISTING_SECRET, {"tls": {"certManager": {"issuerName": "run-ca", "issuerKind": "ClusterIssuer"}}}),
    "plaintext": merge(EXISTING_SECRET, {"tls": {"enabled": False}}),
    # The validator on its own nodes, over three shards, with the task's data mounted as
    # the learners mount it.
    "validator": merge(EXISTING_SECRET, {
        "syncer": {"shards": 3},
        "run": {"taskOptions": {"data": "/data/corpus"}},
        "validator": {
            "enabled": True, "intervalSeconds": 2.5, "steps": 4, "agreement": 0.1,
            "nodeSelector": {"pool": "cpu"}, "tolerations": [{"key": "cpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}},
            "extraVolumes": [{"name": "corpus", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": True,
                                                     "volumeAttributes": {"bucketName": "corpus"}}}],
            "extraVolumeMounts": [{"name": "corpus", "mountPath": "/data", "readOnly": True}],
        },
    }),
    # Snapshots in object storage on a schedule, credentials from a Secret, restored from.
    "object-storage": merge(EXISTING_SECRET, {
        "restore": "latest",
        "snapshots": {"url": "s3://diloco-runs/run-a", "credentialsSecret": "s3-credentials", "everySeconds": 600,
                      "keep": 3},
    }),
    "restore-pinned": merge(EXISTING_SECRET, {
        "fullnameOverride": "run-b", "restore": "latest",
        "image": {"repository": "us-docker.pkg.dev/p/r/diloco", "digest": DIGEST},
        "learners": {"images": {"tpu": {"repository": "us-docker.pkg.dev/p/r/diloco-tpu", "digest": DIGEST}}},
        "snapshots": {"existingClaim": "filestore-snapshots"},
        "coordinator": {"persistence": {"existingClaim": "coordinator-data"}},
        "scavenging": {"pools": [{"name": "spot-a", "spot": True}, {"name": "flex", "spot": False,
                                                                     "nodeSelector": {"pool": "flex"}}]},
    }),
}


@pytest.fixture(scope="session")
def chart():
    return Chart()


@pytest.fixture(scope="session")
def presets(chart) -> dict[str, Rendered]:
    return {name: chart.render(merge(preset(name), EXISTING_SECRET)) for name in PRESETS}


@pytest.fixture(scope="session")
def variants(chart) -> dict[str, Rendered]:
    return {name: chart.render(values) for name, values in VARIANTS.items()}


@pytest.fixture(scope="session")
def multihost(chart) -> dict[str, Rendered]:
    return {name: chart.render(merge(preset(name), EXISTING_SECRET)) for name in MULTIHOST_PRESETS}


@pytest.fixture(scope="session")
def renders(presets, variants, multihost) -> dict[str, Rendered]:
    return {**presets, **variants, **multihost}


class RecordingPodApi:
    """Stands in for kubernetes.client.CoreV1Api and, for JobSets, CustomObjectsApi:
    records each call as the RBAC (verb, resource, namespace, name) it needs (name None
    where RBAC cannot restrict it by resourceNames: create and list); any other method is
    an AttributeError. It knows the ConfigMaps of a render, each with a made-up UID."""

    def __init__(self, configmaps: dict[tuple[str, str], str] | None = None) -> None:
        self.configmaps = dict(configmaps or {})
        self.calls: list[tuple[str, str, str, str | None]] = []
        self.created: list[dict] = []

    def read_namespaced_config_map(self, name, namespace):
        from kubernetes.client.exceptions import ApiException

        self.calls.append(("get", "configmaps", namespace, name))
        if (namespace, name) not in self.configmaps:
            raise ApiException(status=404, reason="Not Found")
        return SimpleNamespace(metadata=SimpleNamespace(name=name, namespace=namespace, uid=self.configmaps[(namespace, name)]))

    def list_namespaced_pod(self, namespace, label_selector=None):
        self.calls.append(("list", "pods", namespace, None))
        return SimpleNamespace(items=[])

    def create_namespaced_pod(self, namespace, body):
        self.calls.append(("create", "pods", namespace, None))
        self.created.append(body)

    def delete_namespaced_pod(self, name, namespace):
        self.calls.append(("delete", "pods", namespace, name))

    def list_namespaced_custom_object(self, group, version, namespace, plural, label_selector=None):
        self.calls.append(("list", f"{plural}.{group}", namespace, None))
        return {"items": []}

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.calls.append(("create", f"{plural}.{group}", namespace, None))
        self.created.append(body)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, propagation_policy=None):
        self.calls.append(("delete", f"{plural}.{group}", namespace, name))


def configmap_uid(configmap: dict) -> str:
    """The UID the recording API gives a rendered ConfigMap (what the API server would)."""
    return f"uid-{configmap['metadata']['namespace']}-{configmap['metadata']['name']}"


def coordinator_launcher(rendered: Rendered, directory: Path) -> tuple[KubernetesLauncher, RecordingPodApi]:
    """The KubernetesLauncher exactly as `diloco coordinator` builds it from the rendered
    Deployment's args, with the pod templates read from the files its mounts give them,
    against an API that holds the rendered ConfigMaps."""
    deployment = rendered.one("Deployment", "-coordinator")
    pod = {"metadata": {**deployment["spec"]["template"]["metadata"], "name": "coordinator-0", "namespace": "ml"},
           "spec": deployment["spec"]["template"]["spec"]}
    c = container(pod, "coordinator")
    parsed = build_parser().parse_args(args(pod, c))
    templates = []
    for pool, path in parsed.pod_template:
        source = mounted(pod, c, str(path))
        assert source.kind == "configMap"
        configmap = rendered.named("ConfigMap", source.source)
        assert configmap is not None, f"{path} comes from ConfigMap {source.source}, which the chart does not render"
        file = directory / f"{pool or 'default'}.yaml"
        file.write_text(configmap["data"][source.key])
        templates.append((pool, file))
    cfg = KubernetesLauncherConfig(
        namespace=parsed.namespace, pod_templates=tuple(templates), container=parsed.learner_container,
        join_token_path=parsed.join_token_path, kube_config=parsed.kube_config, owner_configmap=parsed.owner_configmap,
    )
    api = RecordingPodApi({(o["metadata"]["namespace"], o["metadata"]["name"]): configmap_uid(o)
                           for o in rendered.all("ConfigMap")})
    launcher = KubernetesLauncher(cfg, parsed.release, parsed.advertise_address, parsed.max_learners, core_api=api,
                                  custom_api=api)
    return launcher, api


def launch_one_per_pool(rendered: Rendered, directory: Path) -> tuple[list[dict], RecordingPodApi]:
    """The objects `add-learners 1 --pool P` creates for each pool, through the real
    launcher, and the API calls it made (launch, then stop)."""
    launcher, api = coordinator_launcher(rendered, directory)

    async def launch_and_stop():
        for i, pool in enumerate(rendered.pod_templates()):
            [result] = await launcher.launch([f"{i + 0xa0:08x}"], pool, {})
            assert result.ok, result.detail
        await launcher.stop([p["metadata"]["labels"]["diloco/launch-id"] for p in api.created])

    asyncio.run(launch_and_stop())
    return api.created, api


@pytest.fixture(scope="session")
def launched(presets, tmp_path_factory) -> dict[str, tuple[list[dict], RecordingPodApi]]:
    """Per preset: the pods launched into each pool, and the API calls (launch_one_per_pool)."""
    return {name: launch_one_per_pool(rendered, tmp_path_factory.mktemp(name)) for name, rendered in presets.items()}


@pytest.fixture(scope="session")
def launched_slices(multihost, tmp_path_factory) -> dict[str, tuple[list[dict], RecordingPodApi]]:
    """Per multi-host preset: the JobSets launched into each pool, and the API calls."""
    return {name: launch_one_per_pool(rendered, tmp_path_factory.mktemp(name)) for name, rendered in multihost.items()}
