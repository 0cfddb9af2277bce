"""Multi-host TPU slices: a learner whose topology spans several hosts is a JobSet slice,
one pod per host, and every learner, static or launched, is a JobSet of its own (a JobSet
restart recreates all its Jobs: a failed host must restart its own slice only). The
presets render JobSets valid against the JobSet CRD's own schema (tests/k8s/crds) and
the core Job and Pod schemas; every host, followed as the JobSet and Job controllers
create it, gets its chips, its index and its leader's address, and that address is the
DNS name of host 0 of its own slice; the launcher adds a slice the same way, with only
the RBAC the chart grants; the NetworkPolicy opens the slice port between hosts and
nothing else."""

import math
import re

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest

from diloco.command import build_parser
from tests.k8s.chart import (
    CLUSTER_DOMAIN,
    EXISTING_SECRET,
    MULTIHOST_PRESETS,
    NAMESPACE,
    args,
    container,
    environment,
    ingress_allowed,
    jobset_jobs,
    jobset_pods,
    merge,
    preset,
    statefulset_pod,
    templated_pod,
    validate_jobset,
)
from tests.k8s.conftest import configmap_uid
from tests.k8s.test_render import KUBERNETES_VERSIONS

# preset -> (accelerator, topology, chips per host, hosts)
SLICES = {
    "values-tpu-v5e-4x4.yaml": ("tpu-v5-lite-podslice", "4x4", 4, 4),
    "values-tpu-v6e-2x4-multihost.yaml": ("tpu-v6e-slice", "2x4", 4, 2),
}
assert set(SLICES) == set(MULTIHOST_PRESETS)
EXCLUSIVE = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}


def dns_name(pod: dict) -> str:
    """A pod's DNS name under its subdomain's headless Service, as cluster DNS serves it."""
    spec = pod["spec"]
    return f"{spec['hostname']}.{spec['subdomain']}.{pod['metadata']['namespace']}.svc.{CLUSTER_DOMAIN}"


STATIC = re.compile(r"(.+)-learner-([0-9a-f]{8})-(\d+)")  # <fullname>-learner-<hash>-<learner>


def static_jobsets(rendered) -> list[dict]:
    """The static learners' JobSets, learner by learner (the number ending the name)."""
    jobsets = rendered.all("JobSet")
    return sorted(jobsets, key=lambda j: int(STATIC.fullmatch(j["metadata"]["name"]).group(3)))


def slices_of(rendered) -> list[list[dict]]:
    """Every static slice's host pods, slice by slice: Job 0 of each learner's JobSet."""
    return [jobset_pods(jobset, 0) for jobset in static_jobsets(rendered)]


@pytest.mark.parametrize("name", MULTIHOST_PRESETS)
def test_static_learners_are_one_jobset_of_one_slice_each(multihost, name):
    """learners.replicas JobSets, each of one slice: a JobSet restart recreates every Job
    of the JobSet, so a failed host restarts its own learner's slice and no other."""
    accelerator, topology, per_host, hosts = SLICES[name]
    rendered = multihost[name]
    values = rendered.values["learners"]
    assert hosts == math.prod(int(d) for d in topology.split("x")) // per_host
    assert not rendered.all("Job"), "no single-host learner Job beside the slices"
    jobsets = static_jobsets(rendered)
    assert len(jobsets) == values["replicas"] >= 2
    names = [j["metadata"]["name"] for j in jobsets]
    assert len(set(names)) == len(names)
    matches = [STATIC.fullmatch(n) for n in names]
    assert [(m.group(1), int(m.group(3))) for m in matches] == [("diloco", j) for j in range(values["replicas"])], names
    assert len({m.group(2) for m in matches}) == 1, "hashed like the Job's name, one hash for the learners' pod"
    first = jobsets[0]
    for jobset in jobsets:
        assert {**jobset, "metadata": {**jobset["metadata"], "name": first["metadata"]["name"]}} == first, \
            "the learners' JobSets differ in their names only"
        assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
        assert jobset["metadata"]["annotations"] == EXCLUSIVE
        spec = jobset["spec"]
        assert spec["network"] == {"enableDNSHostnames": True}
        assert spec["failurePolicy"] == {"maxRestarts": values["backoffLimitPerIndex"]}
        [replicated] = spec["replicatedJobs"]
        assert replicated["replicas"] == 1, "one slice per JobSet: its restarts recreate that slice only"
        assert len(jobset_jobs(jobset)) == 1
    [replicated] = first["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", hosts, hosts)
    assert job["backoffLimit"] == 0, "a host that fails fails its slice: its JobSet restarts it whole"
    pod = job["template"]
    assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": accelerator,
                                           "cloud.google.com/gke-tpu-topology": topology}
    c = container(pod, "learner")
    assert c["resources"]["requests"]["google.com/tpu"] == c["resources"]["limits"]["google.com/tpu"] == per_host
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert {"name": "slice", "containerPort": values["slicePort"], "protocol": "TCP"} in c["ports"]
    assert pod["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize("name", MULTIHOST_PRESETS)
def test_every_host_knows_its_slice_its_index_and_its_leader(multihost, launched_slices, name):
    """Followed as the controllers make them, the hosts of every slice, static or
    launched, run `diloco learner` (the real command line) with indices 0..N-1 and name
    host 0 of their own slice as leader: its DNS name, on the slice port."""
    hosts = SLICES[name][3]
    rendered = multihost[name]
    port = rendered.values["learners"]["slicePort"]
    coordinator = templated_pod(rendered.one("Deployment", "-coordinator")["spec"]["template"], "coordinator")
    advertised = build_parser().parse_args(args(coordinator, container(coordinator, "coordinator"))).advertise_address
    static = slices_of(rendered)
    assert len(static) == rendered.values["learners"]["replicas"]
    for jobset, pods in zip(static_jobsets(rendered), static, strict=True):
        own = jobset["metadata"]["name"]
        assert all(p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == own for p in pods)
        for pod in pods:
            parsed = build_parser().parse_args(args(pod, container(pod, "learner")))
            assert parsed.slice_leader == f"{own}-slice-0-0.{own}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}:{port}", \
                "host 0 of its own JobSet"
    leaders = set()
    for pods in [*static, *(jobset_pods(launched, 0) for launched in launched_slices[name][0])]:
        assert len(pods) == hosts
        leader = f"{dns_name(pods[0])}:{rendered.values['learners']['slicePort']}"
        leaders.add(leader)
        for index, pod in enumerate(pods):
            argv = args(pod, container(pod, "learner"))
            assert "$(" not in " ".join(argv), argv
            parsed = build_parser().parse_args(argv)
            assert (parsed.command, parsed.device, parsed.coordinator) == ("learner", "xla", advertised)
            assert (parsed.slice_hosts, parsed.slice_index, parsed.slice_leader) == (hosts, index, leader)
            assert environment(pod, container(pod, "learner"))["PJRT_DEVICE"] == "TPU"
    assert len(leaders) == len(static) + len(launched_slices[name][0]), "each slice has its own leader"


@pytest.mark.parametrize("name", MULTIHOST_PRESETS)
def test_jobsets_are_valid_against_the_crd_and_the_core_schemas(multihost, launched_slices, name):
    jobsets = [*multihost[name].all("JobSet"), *launched_slices[name][0]]
    assert len(jobsets) == multihost[name].values["learners"]["replicas"] + len(multihost[name].launcher_templates())
    for version in KUBERNETES_VERSIONS:
        for jobset in jobsets:
            validate_jobset(jobset, version)


def test_jobset_validation_rejects_what_the_api_server_would(multihost):
    """What the validation buys: a misspelt JobSet field, a wrong type, and a bad field
    inside the embedded pod are each an error."""
    jobset = multihost["values-tpu-v5e-4x4.yaml"].all("JobSet")[0]
    misspelt = {**jobset, "spec": {**jobset["spec"], "network": {"enableDNSHostname": True}}}
    with pytest.raises(jsonschema.ValidationError, match="enableDNSHostname"):
        validate_jobset(misspelt, KUBERNETES_VERSIONS[0])
    wrong_type = {**jobset, "spec": {**jobset["spec"], "failurePolicy": {"maxRestarts": "three"}}}
    with pytest.raises(jsonschema.ValidationError, match="three"):
        validate_jobset(wrong_type, KUBERNETES_VERSIONS[0])
    [replicated] = jobset["spec"]["replicatedJobs"]
    pod = replicated["template"]["spec"]["template"]
    bad_pod = {**pod, "spec": {**pod["spec"], "containers": [{**pod["spec"]["containers"][0], "args": "--oops"}]}}
    bad = {**jobset, "spec": {**jobset["spec"], "replicatedJobs": [
        {**replicated, "template": {"spec": {**replicated["template"]["spec"], "template": bad_pod}}}]}}
    # The CRD carries the pod schema too; the core Job schema is checked after it.
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_jobset(bad, KUBERNETES_VERSIONS[0])


@pytest.mark.parametrize("name", MULTIHOST_PRESETS)
def test_the_launcher_adds_a_slice_per_learner_owned_by_the_release(multihost, launched_slices, name):
    rendered = multihost[name]
    jobsets, _ = launched_slices[name]
    owner = rendered.one("ConfigMap", "-pod-templates")
    templates = rendered.launcher_templates()
    assert {t["kind"] for t in templates.values()} == {"JobSet"}
    assert [j["metadata"]["labels"]["diloco/pool"] for j in jobsets] == list(templates)
    _, _, per_host, hosts = SLICES[name]
    spot = {p["name"] for p in rendered.values["scavenging"]["pools"] if p["spot"]}
    assert spot
    for jobset in jobsets:
        launch_id = jobset["metadata"]["labels"]["diloco/launch-id"]
        assert jobset["metadata"]["name"] == f"diloco-learner-{launch_id}"
        assert jobset["metadata"]["namespace"] == NAMESPACE
        assert jobset["metadata"]["annotations"] == EXCLUSIVE
        assert jobset["metadata"]["ownerReferences"] == [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"], "uid": configmap_uid(owner),
            "controller": False, "blockOwnerDeletion": False,
        }]
        [replicated] = jobset["spec"]["replicatedJobs"]
        assert replicated["replicas"] == 1
        assert replicated["template"]["spec"]["completions"] == hosts
        pods = jobset_pods(jobset, 0)
        leader = f"{dns_name(pods[0])}:{rendered.values['learners']['slicePort']}"
        for index, pod in enumerate(pods):
            labels = pod["metadata"]["labels"]
            assert (labels["diloco/launch-id"], labels["diloco/owner"], labels["app.kubernetes.io/component"]) == \
                (launch_id, "diloco", "learner")
            c = container(pod, "learner")
            assert c["resources"]["limits"]["google.com/tpu"] == per_host
            parsed = build_parser().parse_args(args(pod, c))
            assert parsed.launch_id == launch_id, "every host runs as the launch (its leader toward the shards)"
            assert (parsed.slice_index, parsed.slice_leader) == (index, leader)
        selector = replicated["template"]["spec"]["template"]["spec"]["nodeSelector"]
        assert (selector.get("cloud.google.com/gke-spot") == "true") == (jobset["metadata"]["labels"]["diloco/pool"] in spot)


@pytest.mark.parametrize("name", MULTIHOST_PRESETS)
def test_rbac_grants_jobsets_and_not_pods_on_multi_host_slices(multihost, launched_slices, name):
    rendered = multihost[name]
    _, api = launched_slices[name]
    [role] = rendered.all("Role")
    owner = rendered.one("ConfigMap", "-pod-templates")["metadata"]["name"]
    assert role["rules"] == [
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["create", "list", "delete"]},
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [owner], "verbs": ["get"]},
    ]
    granted = {(verb, f"{resource}.{group}" if group else resource, name_)
               for rule in role["rules"] for group in rule["apiGroups"] for verb in rule["verbs"]
               for resource in rule["resources"] for name_ in rule.get("resourceNames", [None])}
    used = {(verb, resource, name_ if resource == "configmaps" else None) for verb, resource, _, name_ in api.calls}
    assert used == granted, "every verb the chart grants is used, on exactly the objects granted, and none beyond"


@pytest.mark.parametrize("name", MULTIHOST_PRESETS)
def test_network_policy_opens_slice_hosts_to_each_other_only(multihost, name):
    rendered = multihost[name]
    policies = rendered.all("NetworkPolicy")
    first, second = slices_of(rendered)[:2]
    port = ("slice", rendered.values["learners"]["slicePort"])
    leader, follower = first[0]["metadata"]["labels"], first[1]["metadata"]["labels"]
    assert ingress_allowed(policies, leader, follower, port), "a host reaches its leader"
    assert ingress_allowed(policies, leader, second[1]["metadata"]["labels"], port), \
        "a policy cannot tell slices apart: the release's slice hosts reach each other"
    shard = statefulset_pod(rendered.one("StatefulSet"), 0)["metadata"]["labels"]
    others = {"a shard": shard, "another release's host": {**follower, "app.kubernetes.io/instance": "other"},
              "an unlabelled pod": {"app": "web"}}
    for who, labels in others.items():
        assert not ingress_allowed(policies, leader, labels, port), who
    # gloo's pairwise connections (and the TPU runtime's) use ports besides the slice port.
    assert ingress_allowed(policies, leader, follower, ("gloo", 41234)), "any port between hosts"
    for who, labels in others.items():
        assert not ingress_allowed(policies, leader, labels, ("gloo", 41234)), who


@pytest.mark.parametrize(("fullname", "replicas", "longest"), [
    ("x" * 28, 2, None), ("x" * 29, 2, 64), ("x" * 27, 11, None), ("x" * 28, 11, 64)])
def test_pod_names_of_every_static_slice_are_checked_against_63_characters(chart, fullname, replicas, longest):
    """The static JobSets' names are 2 or more characters longer than the launched ones'
    (the learner's number after the hash): the check is on the longest pod name the JobSet
    webhook would make, <jobset>-slice-0-<last host>-<5 characters>, of the last learner."""
    values = merge(preset("values-tpu-v5e-4x4.yaml"), EXISTING_SECRET,
                   {"fullnameOverride": fullname, "learners": {"replicas": replicas}})
    if longest is None:
        jobsets = static_jobsets(chart.render(values))
        assert len(jobsets) == replicas
        last = jobsets[-1]["metadata"]["name"]
        assert last.endswith(f"-{replicas - 1}")
        assert len(jobset_pods(jobsets[-1], 0)[-1]["metadata"]["name"]) == 63
        return
    with pytest.raises(helm.HelmError, match=f"would be {longest} characters, more than 63"):
        chart.render(values)


def test_a_new_learner_pod_renames_every_static_jobset(chart, multihost):
    """A JobSet's jobs are immutable, so the names hash the learners' pod, as the Job's
    does: an upgrade that changes the learners replaces every JobSet; one that does not
    keeps them (the same render, the same names)."""
    name = "values-tpu-v6e-2x4-multihost.yaml"
    before = [j["metadata"]["name"] for j in static_jobsets(multihost[name])]
    same = chart.render(merge(preset(name), EXISTING_SECRET))
    assert [j["metadata"]["name"] for j in static_jobsets(same)] == before
    changed = chart.render(merge(preset(name), EXISTING_SECRET, {"learners": {"steps": 1234}}))
    after = [j["metadata"]["name"] for j in static_jobsets(changed)]
    assert len(after) == len(before) and not set(after) & set(before)
