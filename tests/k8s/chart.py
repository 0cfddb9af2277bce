"""Rendering k8s/diloco with the real Helm engine (helm-python-sdk, Helm v4's Go code
through its C ABI, no helm binary) and reading what it rendered the way the kubelet
would: $(VAR) expansion, the downward API, volumes behind mount paths, StatefulSet
ordinals, and NetworkPolicy selection."""

from __future__ import annotations

import copy
import fnmatch
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "diloco"
PRESETS = ("values-tpu-v5e.yaml", "values-tpu-v6e.yaml", "values-cpu-dev.yaml")
# Presets whose learners are multi-host TPU slices (JobSets), apart: the tests of PRESETS
# read learners as one pod each.
MULTIHOST_PRESETS = ("values-tpu-v5e-4x4.yaml", "values-tpu-v6e-2x4-multihost.yaml")
RELEASE = "diloco"
NAMESPACE = "ml"
CLUSTER_DOMAIN = "cluster.local"
# Kinds kubernetes-validate has no schema for (CRDs of the monitoring stacks, cert-manager,
# JobSet: validate_jobset below has its schema).
CRD_KINDS = {"PodMonitoring", "ServiceMonitor", "Certificate", "JobSet"}
EXISTING_SECRET = {"auth": {"existingSecret": "diloco-auth"}}
JOIN_TOKEN = "pods.64.1000000." + "0" * 64
INLINE_SECRET = {"auth": {"secret": "run-secret", "joinToken": JOIN_TOKEN, "adminToken": "admin-token"}}
REGISTRY = "registry.example/ml"
# The image repositories an install names (README, docs/kubernetes.md: the chart has no
# default and refuses to render without them); every render below has them unless told not to.
IMAGES = {"image": {"repository": f"{REGISTRY}/diloco"},
          "learners": {"images": {"tpu": {"repository": f"{REGISTRY}/diloco-tpu"},
                                  "gpu": {"repository": f"{REGISTRY}/diloco-gpu"}}}}


def merge(base: dict, *overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for override in overrides:
        for key, value in override.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def preset(name: str) -> dict:
    """A preset as `helm -f` reads it."""
    return helm.values_from_yaml((CHART / name).read_text())


@dataclass
class Rendered:
    values: dict
    """The values the chart saw (its defaults merged with the overrides)."""
    objects: list[dict]
    notes: str

    def all(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, suffix: str = "") -> dict:
        found = [o for o in self.all(kind) if o["metadata"]["name"].endswith(suffix)]
        assert len(found) == 1, f"{len(found)} {kind} objects named *{suffix}: {[o['metadata']['name'] for o in found]}"
        return found[0]

    def named(self, kind: str, name: str) -> dict | None:
        return next((o for o in self.all(kind) if o["metadata"]["name"] == name), None)

    def launcher_templates(self) -> dict[str, dict]:
        """The launcher's templates, by pool: a pod template, or a JobSet on multi-host slices."""
        configmap = self.one("ConfigMap", "-pod-templates")
        return {key.removesuffix(".yaml"): yaml.safe_load(text) for key, text in configmap["data"].items()}

    def pod_templates(self) -> dict[str, dict]:
        """The launcher's pod templates, by pool (a JobSet template's pod template)."""
        return {pool: jobset_pod_template(t) if t.get("kind") == "JobSet" else t
                for pool, t in self.launcher_templates().items()}

    def workload_pods(self) -> dict[str, dict]:
        """name -> PodTemplateSpec of every workload, plus the helm test pod as {metadata, spec}."""
        pods = {}
        for kind in ("Deployment", "StatefulSet", "Job"):
            for o in self.all(kind):
                pods[f"{kind}/{o['metadata']['name']}"] = o["spec"]["template"]
        for o in self.all("JobSet"):
            pods[f"JobSet/{o['metadata']['name']}"] = jobset_pod_template(o)
        for o in self.all("Pod"):
            pods[f"Pod/{o['metadata']['name']}"] = {"metadata": o["metadata"], "spec": o["spec"]}
        return pods


class Chart:
    """The chart loaded once; renders are cheap (milliseconds)."""

    def __init__(self) -> None:
        self._chart = helm.Chart.load(CHART)

    def render(self, values: dict, name: str = RELEASE, namespace: str = NAMESPACE, images: dict = IMAGES) -> Rendered:
        """``values`` over ``images`` (the repositories; ``{}``: none), as `helm install -f/--set` would."""
        values = merge(images, values)
        manifests = self._chart.render(values=values, name=name, namespace=namespace)
        objects = []
        notes = ""
        for path, text in sorted(manifests.items()):
            if path.endswith("NOTES.txt"):
                notes = text
                continue
            objects.extend(o for o in yaml.safe_load_all(text) if o)
        return Rendered(self._chart.merge_values(values), objects, notes)

    def validate(self, values: dict) -> None:
        self._chart.validate_schema(values)


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


# --- what the kubelet does with a pod ----------------------------------------------------

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values, command and args ($$ escapes; an
    undefined reference stays as written)."""
    return _VAR.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), value)


def field_ref(pod: dict, path: str) -> str:
    keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if keyed:
        return pod["metadata"][keyed.group(1)][keyed.group(2)]
    return {
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"]["namespace"],
        "spec.nodeName": "node-a",
    }[path]


def environment(pod: dict, c: dict) -> dict[str, str]:
    """The container's environment as the kubelet resolves it (fieldRefs from `pod`;
    secret references become a placeholder)."""
    env: dict[str, str] = {}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var.get("valueFrom", {}):
            env[var["name"]] = field_ref(pod, var["valueFrom"]["fieldRef"]["fieldPath"])
        else:
            env[var["name"]] = f"<{var['name']} from {sorted(var['valueFrom'])[0]}>"
    return env


def args(pod: dict, c: dict) -> list[str]:
    env = environment(pod, c)
    return [expand(a, env) for a in c.get("args", [])]


def statefulset_pod(sts: dict, ordinal: int) -> dict:
    """Pod `ordinal` of a StatefulSet, with the name, hostname and labels the controller sets."""
    name = f"{sts['metadata']['name']}-{ordinal}"
    template = copy.deepcopy(sts["spec"]["template"])
    labels = {
        **template["metadata"]["labels"],
        "apps.kubernetes.io/pod-index": str(ordinal),
        "statefulset.kubernetes.io/pod-name": name,
    }
    spec = {**template["spec"], "hostname": name, "subdomain": sts["spec"]["serviceName"]}
    return {"metadata": {**template["metadata"], "name": name, "namespace": sts["metadata"]["namespace"], "labels": labels},
            "spec": spec}


def jobset_pod_template(jobset: dict) -> dict:
    """The pod template of a JobSet's one replicated job."""
    [replicated] = jobset["spec"]["replicatedJobs"]
    return replicated["template"]["spec"]["template"]


def jobset_pods(jobset: dict, job_index: int) -> list[dict]:
    """The pods of Job `job_index` of a JobSet's one replicated job, one per completion
    index, as the controllers make them: the JobSet's keys (its name, the job index) and
    the Job's completion index as labels and annotations, the Indexed Job's hostname
    <job>-<index>, and with DNS hostnames on, the JobSet's subdomain (its name by default)."""
    [replicated] = jobset["spec"]["replicatedJobs"]
    name = jobset["metadata"]["name"]
    job = f"{name}-{replicated['name']}-{job_index}"
    template = replicated["template"]["spec"]["template"]
    network = jobset["spec"].get("network") or {}
    pods = []
    for index in range(replicated["template"]["spec"]["completions"]):
        keys = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": replicated["name"],
                "jobset.sigs.k8s.io/job-index": str(job_index), "batch.kubernetes.io/job-completion-index": str(index)}
        metadata = {**template["metadata"], "name": f"{job}-{index}-abcde", "namespace": jobset["metadata"]["namespace"],
                    "labels": {**template["metadata"].get("labels", {}), **keys},
                    "annotations": {**template["metadata"].get("annotations", {}), **keys}}
        spec = {**template["spec"], "hostname": f"{job}-{index}"}
        if network.get("enableDNSHostnames"):
            spec["subdomain"] = network.get("subdomain") or name
        pods.append({"metadata": metadata, "spec": spec})
    return pods


def templated_pod(template: dict, name: str, namespace: str = NAMESPACE) -> dict:
    return {"metadata": {**template["metadata"], "name": name, "namespace": namespace}, "spec": template["spec"]}


@dataclass(frozen=True)
class Mounted:
    kind: str
    """configMap, secret, persistentVolumeClaim, emptyDir, csi, ..."""
    source: str
    """The ConfigMap, Secret or claim name; the volume's name for other kinds."""
    key: str
    """The key of a ConfigMap or Secret; the path inside the volume otherwise."""


def mounted(pod: dict, c: dict, path: str) -> Mounted:
    """Which volume (and key) a file path inside the container comes from."""
    mounts = sorted(c.get("volumeMounts", []), key=lambda m: len(m["mountPath"]), reverse=True)
    mount = next((m for m in mounts if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")), None)
    assert mount is not None, f"{path} is on no volume of container {c['name']}"
    inside = path[len(mount["mountPath"]):].lstrip("/")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    for kind, name_field in (("configMap", "name"), ("secret", "secretName")):
        if kind in volume:
            source = volume[kind]
            items = source.get("items")
            key = next((i["key"] for i in items if i["path"] == inside), None) if items else inside
            assert key is not None, f"{path}: volume {volume['name']} projects no item at {inside!r}"
            return Mounted(kind, source[name_field], key)
    if "persistentVolumeClaim" in volume:
        return Mounted("persistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"], inside)
    [kind] = [k for k in volume if k != "name"]
    return Mounted(kind, volume["name"], inside)


# --- NetworkPolicy ------------------------------------------------------------------------


def selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _port_matches(rule: dict, port_name: str, port_number: int) -> bool:
    ports = rule.get("ports")
    return not ports or any(p.get("port") in (port_name, port_number) for p in ports)


def ingress_allowed(
    policies: list[dict], target: dict[str, str], source: dict[str, str], port: tuple[str, int],
    source_namespace: str = NAMESPACE, namespace_labels: dict[str, str] | None = None,
) -> bool:
    """Whether a pod labelled `source` may open a connection to `port` of a pod labelled
    `target` (both pods' namespaces as given; the policies are in NAMESPACE)."""
    namespace_labels = namespace_labels or {"kubernetes.io/metadata.name": source_namespace}
    isolating = [p for p in policies if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
                 and selects(p["spec"]["podSelector"], target)]
    if not isolating:
        return True
    for policy in isolating:
        for rule in policy["spec"].get("ingress") or []:
            if not _port_matches(rule, *port):
                continue
            peers = rule.get("from")
            if not peers:
                return True
            for peer in peers:
                pods_ok = "podSelector" not in peer or selects(peer["podSelector"], source)
                if "namespaceSelector" in peer:
                    ns_ok = selects(peer["namespaceSelector"], namespace_labels)
                else:
                    ns_ok = source_namespace == NAMESPACE
                if pods_ok and ns_ok and ("podSelector" in peer or "namespaceSelector" in peer):
                    return True
    return False


def matches_any(patterns: list[str], value: str) -> bool:
    return any(fnmatch.fnmatchcase(value, p) for p in patterns)


# --- JobSet: a CRD, checked against its own schema ----------------------------------------

JOBSET_SCHEMA = ROOT / "tests" / "k8s" / "crds" / "jobset.x-k8s.io_jobsets.v1alpha2.yaml"


def _strict(node):
    """The schema with unknown fields made errors, as the API server's strict field
    validation (kubectl's default) makes them, where the CRD does not keep unknown fields."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {key: _strict(value) for key, value in node.items()}
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        node.setdefault("additionalProperties", False)
    return node


@functools.cache
def _jobset_validator() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(_strict(yaml.safe_load(JOBSET_SCHEMA.read_text())))


def jobset_jobs(jobset: dict) -> list[dict]:
    """The first Job of each replicated job, as the JobSet controller creates it."""
    return [{"apiVersion": "batch/v1", "kind": "Job",
             "metadata": {"name": f"{jobset['metadata']['name']}-{r['name']}-0", "namespace": jobset["metadata"]["namespace"]},
             "spec": r["template"]["spec"]} for r in jobset["spec"]["replicatedJobs"]]


def validate_jobset(jobset: dict, kubernetes_version: str) -> None:
    """Raises if a JobSet breaks the CRD's schema (strictly), or a replicated job's Job,
    pod template included, breaks the core batch/v1 schema of that Kubernetes version."""
    _jobset_validator().validate(jobset)
    for job in jobset_jobs(jobset):
        kubernetes_validate.validate(job, kubernetes_version, strict=True)
