"""The chart against the code it deploys: the rendered args parse with the real `diloco`
command line, files named on them are mounted from the right ConfigMap or Secret key,
the shard id each StatefulSet pod computes is its ordinal and the coordinator lists that
pod's address at that position, the launcher builds runnable pods from the templates
with only the RBAC the chart grants, and the probes ask for the services the servers
register."""

import math
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from diloco.coordinator.server import SERVICE_NAME as COORDINATOR_SERVICE
from diloco import telemetry
from diloco.command import build_parser
from diloco.config import RunConfig
from diloco.cli.settings import from_flags
from diloco.syncer.server import SERVICE_NAME as SYNCER_SERVICE
from diloco.validator.config import ValidatorConfig
from tests.k8s.chart import (
    CLUSTER_DOMAIN,
    NAMESPACE,
    MULTIHOST_PRESETS,
    Mounted,
    PRESETS,
    REGISTRY,
    args,
    container,
    environment,
    ingress_allowed,
    merge,
    mounted,
    statefulset_pod,
    templated_pod,
)
from tests.k8s.conftest import VARIANTS, configmap_uid

TPU_PRESETS = {"values-tpu-v5e.yaml": ("tpu-v5-lite-podslice", "2x4"), "values-tpu-v6e.yaml": ("tpu-v6e-slice", "2x4")}


def tls_secret_name(rendered):
    """The Secret the run's certificates are in: the user's, or the one the chart makes
    (generated, or a cert-manager Certificate's)."""
    if rendered.values["tls"]["existingSecret"]:
        return rendered.values["tls"]["existingSecret"]
    kind = "Certificate" if rendered.values["tls"]["certManager"]["issuerName"] else "Secret"
    return rendered.one(kind, "-tls")["metadata"]["name"]


def coordinator_pod(rendered):
    deployment = rendered.one("Deployment", "-coordinator")
    return templated_pod(deployment["spec"]["template"], "diloco-coordinator-5d9f-x2x4z")


def validator_pod(rendered):
    deployment = rendered.one("Deployment", "-validator")
    return templated_pod(deployment["spec"]["template"], "diloco-validator-6c4f-k2j8q")


def job_pod(rendered, index=0):
    [job] = rendered.all("Job")
    return templated_pod(job["spec"]["template"], f"{job['metadata']['name']}-{index}-abcde")


@pytest.mark.parametrize("name", PRESETS)
def test_shard_id_is_the_pod_ordinal_and_the_coordinator_lists_shards_in_that_order(presets, name):
    rendered = presets[name]
    shards = rendered.values["syncer"]["shards"]
    sts = rendered.one("StatefulSet", "-syncer")
    assert sts["spec"]["replicas"] == shards
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    headless = rendered.one("Service", "-syncer")
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == headless["metadata"]["name"]

    coordinator = coordinator_pod(rendered)
    listed = build_parser().parse_args(args(coordinator, container(coordinator, "coordinator"))).shards.split(",")
    assert len(listed) == shards
    for ordinal in range(shards):
        pod = statefulset_pod(sts, ordinal)
        parsed = build_parser().parse_args(args(pod, container(pod, "syncer")))
        assert (parsed.command, parsed.shard_id, parsed.shards) == ("syncer", ordinal, shards)
        dns = f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
        assert listed[ordinal] == f"{dns}:{parsed.port}"
        env = environment(pod, container(pod, "syncer"))
        assert telemetry.parse_resource_attributes(env["OTEL_RESOURCE_ATTRIBUTES"])[telemetry.SHARD_ID] == str(ordinal)


@pytest.mark.parametrize("name", PRESETS)
def test_each_shard_keeps_its_tape_on_its_own_claim_and_the_budget_allows_one_down(presets, name):
    rendered = presets[name]
    sts = rendered.one("StatefulSet", "-syncer")
    [claim] = sts["spec"]["volumeClaimTemplates"]
    pod = statefulset_pod(sts, 0)
    parsed = build_parser().parse_args(args(pod, container(pod, "syncer")))
    mount = next(m for m in container(pod, "syncer")["volumeMounts"] if m["mountPath"] == parsed.data_dir)
    assert mount["name"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    pdb = rendered.one("PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("name", PRESETS)
def test_coordinator_args_parse_and_name_mounted_files(presets, name):
    rendered = presets[name]
    deployment = rendered.one("Deployment", "-coordinator")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    pod = coordinator_pod(rendered)
    c = container(pod, "coordinator")
    parsed = build_parser().parse_args(args(pod, c))
    values = rendered.values
    assert parsed.command == "coordinator" and parsed.launcher == "kubernetes"
    assert parsed.host == "0.0.0.0" and parsed.port == values["coordinator"]["port"]
    service = rendered.one("Service", "-coordinator")
    assert parsed.advertise_address == \
        f"{service['metadata']['name']}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}:{service['spec']['ports'][0]['port']}"
    assert (parsed.namespace, parsed.release, parsed.kube_config) == (NAMESPACE, "diloco", "in-cluster")
    scavenging = [p["name"] for p in values["scavenging"]["pools"]]
    assert parsed.pools.split(",") == [*scavenging, values["learners"]["pool"]]
    assert sorted(pool for pool, _ in parsed.pod_template) == sorted(parsed.pools.split(","))
    secret = values["auth"]["existingSecret"]
    assert mounted(pod, c, parsed.secret_file) == Mounted("secret", secret, "secret")
    assert mounted(pod, c, parsed.admin_token_file).key == "admin-token"
    assert mounted(pod, c, parsed.data_dir).kind == "persistentVolumeClaim"
    snapshots = mounted(pod, c, parsed.snapshot_dir)
    assert snapshots.kind == "persistentVolumeClaim"
    assert rendered.named("PersistentVolumeClaim", snapshots.source)["spec"]["accessModes"] == values["snapshots"]["accessModes"]
    sts = rendered.one("StatefulSet", "-syncer")
    shard = statefulset_pod(sts, 0)
    shard_args = build_parser().parse_args(args(shard, container(shard, "syncer")))
    assert mounted(shard, container(shard, "syncer"), shard_args.snapshot_dir) == snapshots, \
        "the coordinator and the shards must see one snapshot directory"
    assert shard_args.coordinator == parsed.advertise_address


@pytest.mark.parametrize("name", PRESETS)
def test_learners_write_their_snapshot_files_on_the_same_claim(presets, name):
    """A snapshot marker names a directory under the coordinator's --snapshot-dir; every
    learner (static and scavenged) writes its model there, so it mounts the same claim."""
    rendered = presets[name]
    pod = coordinator_pod(rendered)
    snapshot_dir = build_parser().parse_args(args(pod, container(pod, "coordinator"))).snapshot_dir
    claim = mounted(pod, container(pod, "coordinator"), snapshot_dir)
    learners = [*([job_pod(rendered)] if rendered.all("Job") else []),
                *(templated_pod(t, "p") for t in rendered.pod_templates().values())]
    assert learners
    for learner in learners:
        assert mounted(learner, container(learner, "learner"), f"{snapshot_dir}/000001/L0.pt") == \
            Mounted("persistentVolumeClaim", claim.source, "000001/L0.pt")


def test_snapshots_in_object_storage_reach_every_process_with_its_credentials(variants):
    rendered = variants["object-storage"]
    snapshots = rendered.values["snapshots"]
    assert not [c for c in rendered.all("PersistentVolumeClaim") if c["metadata"]["name"].endswith("-snapshots")]
    coordinator = coordinator_pod(rendered)
    parsed = build_parser().parse_args(args(coordinator, container(coordinator, "coordinator")))
    assert (parsed.snapshot_dir, parsed.snapshot_every_s, parsed.snapshot_keep, parsed.restore) == \
        (snapshots["url"], 600.0, 3, "latest")
    shard = statefulset_pod(rendered.one("StatefulSet", "-syncer"), 0)
    shard_args = build_parser().parse_args(args(shard, container(shard, "syncer")))
    assert (shard_args.snapshot_dir, shard_args.restore) == (snapshots["url"], "latest")
    pods = {"coordinator": (coordinator, "coordinator"), "shard": (shard, "syncer"),
            **{f"template/{k}": (templated_pod(t, "p"), "learner") for k, t in rendered.pod_templates().items()},
            **({"static learner": (job_pod(rendered), "learner")} if rendered.all("Job") else {})}
    for what, (pod, name) in pods.items():
        c = container(pod, name)
        assert c.get("envFrom") == [{"secretRef": {"name": "s3-credentials"}}], what
        assert all(v["name"] != "snapshots" for v in pod["spec"]["volumes"]), what


@pytest.mark.parametrize("name", PRESETS)
def test_every_process_reads_the_same_run_config(presets, name):
    rendered = presets[name]
    configmap = rendered.one("ConfigMap", "-run")
    run = RunConfig.from_json(configmap["data"]["run-config.json"])
    values = rendered.values["run"]
    assert run == RunConfig(
        task=values["task"], task_options=values["taskOptions"], seed=values["seed"], fragments=values["fragments"],
        sync_every_steps=values["syncEverySteps"], overlap_steps=values["overlapSteps"],
        merge_alpha=values["mergeAlpha"], reply_rule=values["replyRule"],
    )
    pods = [(coordinator_pod(rendered), "coordinator"), (statefulset_pod(rendered.one("StatefulSet"), 0), "syncer")]
    for pod, name_ in pods:
        c = container(pod, name_)
        source = mounted(pod, c, build_parser().parse_args(args(pod, c)).run_config)
        assert (source.kind, source.source, source.key) == ("configMap", configmap["metadata"]["name"], "run-config.json")


def test_the_codecs_chosen_in_values_reach_learners_and_shards(chart):
    from tests.k8s.test_schema import AUTH, merge

    rendered = chart.render(merge(AUTH, {"learners": {"deltaCodec": "sparse", "deltaDensity": 0.0625},
                                         "syncer": {"replyCodec": "sparse", "replyDensity": 1}}))
    pod = job_pod(rendered)
    learner = build_parser().parse_args(args(pod, container(pod, "learner")))
    assert (learner.delta_codec, learner.delta_density) == ("sparse", 0.0625)
    shard = statefulset_pod(rendered.one("StatefulSet"), 0)
    syncer = build_parser().parse_args(args(shard, container(shard, "syncer")))
    assert (syncer.reply_codec, syncer.reply_density) == ("sparse", 1.0)


@pytest.mark.parametrize("name", PRESETS)
def test_static_learners_join_the_coordinator_with_the_join_token(presets, name):
    rendered = presets[name]
    [job] = rendered.all("Job")
    values = rendered.values["learners"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == values["replicas"]
    pod = job_pod(rendered)
    c = container(pod, "learner")
    parsed = build_parser().parse_args(args(pod, c))
    assert parsed.command == "learner" and parsed.pool == values["pool"]
    assert parsed.coordinator == build_parser().parse_args(args(coordinator_pod(rendered), container(coordinator_pod(rendered), "coordinator"))).advertise_address
    assert mounted(pod, c, parsed.join_token_file) == Mounted("secret", rendered.values["auth"]["existingSecret"], "join-token")
    assert parsed.block_size == rendered.values["syncer"]["blockSize"]
    assert parsed.device == {"tpu": "xla", "gpu": "cuda", "cpu": "cpu"}[values["accelerator"]]
    # A learner never holds the run secret: only the join token is projected into it
    # (beside the TLS Secret, which holds no token).
    secrets = {v["secret"]["secretName"]: v["secret"].get("items") for v in pod["spec"]["volumes"] if "secret" in v}
    auth = rendered.values["auth"]["existingSecret"]
    assert [i["key"] for i in secrets.pop(auth)] == ["join-token"]
    assert list(secrets) == [tls_secret_name(rendered)]


@pytest.mark.parametrize("name", PRESETS)
def test_launcher_pods_run_a_learner_that_joins_its_pool(presets, launched, name):
    rendered = presets[name]
    pods, _ = launched[name]
    pools = set(rendered.pod_templates())
    assert {p["metadata"]["labels"]["diloco/pool"] for p in pods} == pools
    coordinator = build_parser().parse_args(args(coordinator_pod(rendered), container(coordinator_pod(rendered), "coordinator")))
    for pod in pods:
        c = container(pod, "learner")
        parsed = build_parser().parse_args(args(pod, c))
        assert parsed.command == "learner"
        assert parsed.coordinator == coordinator.advertise_address
        assert parsed.pool == pod["metadata"]["labels"]["diloco/pool"] and parsed.launch_id
        assert mounted(pod, c, parsed.join_token_file).key == "join-token"
        assert pod["metadata"]["namespace"] == NAMESPACE and pod["spec"]["restartPolicy"] == "Never"
        assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == "diloco"
        assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "learner"


@pytest.mark.parametrize("name", PRESETS)
def test_rbac_grants_the_coordinator_exactly_what_its_launcher_uses(presets, launched, name):
    rendered = presets[name]
    _, api = launched[name]
    [role] = rendered.all("Role")
    [binding] = rendered.all("RoleBinding")
    assert not rendered.all("ClusterRole") and not rendered.all("ClusterRoleBinding")
    owner = rendered.one("ConfigMap", "-pod-templates")["metadata"]["name"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "list", "delete"]},
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [owner], "verbs": ["get"]},
    ]
    # (verb, resource, name): name None where the rule grants every object of the resource.
    granted = {(verb, resource, name_) for rule in role["rules"] for verb in rule["verbs"]
               for resource in rule["resources"] for name_ in rule.get("resourceNames", [None])}
    used = {(verb, resource, name_ if resource == "configmaps" else None) for verb, resource, _, name_ in api.calls}
    assert used == granted, "every verb the chart grants is used, on exactly the objects granted, and none beyond"
    assert api.calls[0] == ("get", "configmaps", NAMESPACE, owner), "the owner's UID is read once, at start"
    assert [c for c in api.calls if c[1] == "configmaps"] == [api.calls[0]]
    assert {namespace for _, _, namespace, _ in api.calls} == {role["metadata"]["namespace"]} == {NAMESPACE}
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    deployment = rendered.one("Deployment", "-coordinator")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    assert rendered.named("ServiceAccount", account)


@pytest.mark.parametrize("name", PRESETS)
def test_helm_uninstall_garbage_collects_launched_pods(presets, launched, name):
    """The coordinator passes the pod-templates ConfigMap as the owner of its pods; every
    pod it creates names that ConfigMap (by the UID the API gave it) in ownerReferences,
    and Helm deletes the ConfigMap on uninstall (no keep policy, no hook), so the garbage
    collector deletes the pods. The owner is not the coordinator's pod: pods outlive it."""
    rendered = presets[name]
    pods, _ = launched[name]
    pod = coordinator_pod(rendered)
    parsed = build_parser().parse_args(args(pod, container(pod, "coordinator")))
    owner = rendered.one("ConfigMap", "-pod-templates")
    assert parsed.owner_configmap == owner["metadata"]["name"] == "diloco-pod-templates"
    assert owner["metadata"]["namespace"] == parsed.namespace == NAMESPACE, "an owner must be in its dependents' namespace"
    annotations = owner["metadata"].get("annotations") or {}
    assert "helm.sh/resource-policy" not in annotations and "helm.sh/hook" not in annotations
    assert pods
    for p in pods:
        assert p["metadata"]["ownerReferences"] == [{
            "apiVersion": "v1", "kind": "ConfigMap", "name": owner["metadata"]["name"], "uid": configmap_uid(owner),
            "controller": False, "blockOwnerDeletion": False,
        }]


@pytest.mark.parametrize("name", ["static-only", "scavenged-only"])
def test_scavenging_switch(variants, name):
    rendered = variants[name]
    pod = coordinator_pod(rendered)
    parsed = build_parser().parse_args(args(pod, container(pod, "coordinator")))
    if name == "static-only":
        assert parsed.launcher == "none" and not parsed.pod_template and not parsed.owner_configmap
        assert not rendered.all("Role") and not rendered.all("RoleBinding")
        assert pod["spec"]["automountServiceAccountToken"] is False
        assert rendered.one("Job")["spec"]["completions"] == 3
    else:
        assert parsed.launcher == "kubernetes" and not rendered.all("Job")


@pytest.mark.parametrize("name", PRESETS)
def test_only_the_coordinator_gets_an_api_token(presets, launched, name):
    rendered = presets[name]
    pods = {**rendered.workload_pods(), **{f"launched/{p['metadata']['name']}": p for p in launched[name][0]}}
    tokens = {where for where, pod in pods.items() if pod["spec"].get("automountServiceAccountToken", True)}
    assert tokens == {"Deployment/diloco-coordinator"}


@pytest.mark.parametrize("name", TPU_PRESETS)
def test_tpu_learners_land_on_their_slice_with_every_chip(presets, launched, name):
    accelerator, topology = TPU_PRESETS[name]
    chips = math.prod(int(d) for d in topology.split("x"))
    rendered = presets[name]
    pods = {"job": job_pod(rendered), **{p["metadata"]["labels"]["diloco/pool"]: p for p in launched[name][0]}}
    spot_pools = {p["name"] for p in rendered.values["scavenging"]["pools"] if p.get("spot")}
    assert spot_pools
    for where, pod in pods.items():
        spec = pod["spec"]
        selector = spec["nodeSelector"]
        assert selector["cloud.google.com/gke-tpu-accelerator"] == accelerator, where
        assert selector["cloud.google.com/gke-tpu-topology"] == topology, where
        c = container(pod, "learner")
        assert c["resources"]["requests"]["google.com/tpu"] == c["resources"]["limits"]["google.com/tpu"] == chips
        assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert environment(pod, c)["PJRT_DEVICE"] == "TPU"
        assert c["image"].startswith(f"{REGISTRY}/diloco-tpu:")
        spot = where in spot_pools
        assert (selector.get("cloud.google.com/gke-spot") == "true") == spot, where
        spot_toleration = {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        assert (spot_toleration in spec["tolerations"]) == spot, where
        if spot:
            assert spec["terminationGracePeriodSeconds"] <= 30, "Spot VMs give 30 s notice"


def test_cpu_and_gpu_learners_through_values(presets, variants):
    cpu = job_pod(presets["values-cpu-dev.yaml"])
    assert "nodeSelector" not in cpu["spec"] and "tolerations" not in cpu["spec"]
    assert set(container(cpu, "learner")["resources"]["limits"]) == {"cpu", "memory"}
    gpu = job_pod(variants["gpu"])
    c = container(gpu, "learner")
    assert gpu["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    parsed = build_parser().parse_args(args(gpu, c))
    assert parsed.device == "cuda"
    assert gpu["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"
    # The corpus is the task's option (in the run config the coordinator hands the
    # learner), read inside the learner pod.
    run = RunConfig.from_json(variants["gpu"].one("ConfigMap", "-run")["data"]["run-config.json"])
    assert mounted(gpu, c, run.task_options["data"]) == Mounted("csi", "corpus", "corpus")
    assert c["image"].startswith(f"{REGISTRY}/diloco-gpu:")


@pytest.mark.parametrize("name", PRESETS)
def test_grpc_probes_ask_the_services_the_servers_register(presets, name):
    rendered = presets[name]
    servers = {
        "coordinator": (coordinator_pod(rendered), COORDINATOR_SERVICE),
        "syncer": (statefulset_pod(rendered.one("StatefulSet"), 0), SYNCER_SERVICE),
    }
    for name_, (pod, service) in servers.items():
        c = container(pod, name_)
        parsed = build_parser().parse_args(args(pod, c))
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"] == parsed.port
        # Under TLS (the presets') kubelet asks the plaintext health port; plaintext: the main one.
        port = parsed.health_port if rendered.values["tls"]["enabled"] else parsed.port
        assert port
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": port, "service": service}, (name_, probe)
        # Liveness asks for the server as a whole (""), which stays SERVING while it drains.
        assert c["livenessProbe"]["grpc"] == {"port": port}
    for pod in (job_pod(rendered), *rendered.pod_templates().values()):
        c = container(pod, "learner")
        assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c), "learners serve no port"


def grpc_processes(rendered):
    """Every container that opens a gRPC server or channel: what -> (pod, container, service)."""
    pods = {"coordinator": (coordinator_pod(rendered), "coordinator", COORDINATOR_SERVICE),
            "shard": (statefulset_pod(rendered.one("StatefulSet", "-syncer"), 0), "syncer", SYNCER_SERVICE),
            "static learner": (job_pod(rendered), "learner", None),
            **{f"template/{k}": (templated_pod(t, "p"), "learner", None) for k, t in rendered.pod_templates().items()}}
    test_pod = next(p for p in rendered.all("Pod") if p["metadata"]["name"].endswith("-test-health"))
    pods["helm test"] = (test_pod, "health", None)
    if rendered.values["validator"]["enabled"]:
        pods["validator"] = (validator_pod(rendered), "validator", None)
    return pods


@pytest.mark.parametrize("name", ["defaults", "tls", "tls-cert-manager", "validator"])
def test_with_tls_every_process_gets_the_run_s_certificates_and_probes_use_the_health_port(variants, name):
    """tls.enabled (the default; certificates generated, the user's Secret, or
    cert-manager's): every container that opens a gRPC server or channel (coordinator,
    shards, static and launched learners, the helm test) reads ca.crt, tls.crt and
    tls.key from the Secret through DILOCO_TLS_DIR (the CLI's --tls-dir); kubelet's
    probes, which present no certificate, ask the plaintext --health-port."""
    rendered = variants[name]
    secret = tls_secret_name(rendered)
    health_port = rendered.values["tls"]["healthPort"]
    for what, (pod, name, service) in grpc_processes(rendered).items():
        c = container(pod, name)
        env = environment(pod, c)
        assert "DILOCO_INSECURE" not in env, what
        tls_dir = env["DILOCO_TLS_DIR"]
        for file in ("ca.crt", "tls.crt", "tls.key"):
            assert mounted(pod, c, f"{tls_dir}/{file}") == Mounted("secret", secret, file), what
        if service is None:
            continue
        parsed = build_parser().parse_args(args(pod, c))
        assert parsed.health_port == health_port and parsed.port != health_port, what
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["health"] == health_port
        for probe in ("startupProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": health_port, "service": service}, (what, probe)
        assert c["livenessProbe"]["grpc"] == {"port": health_port}


def test_plaintext_is_asked_for_explicitly_in_every_process(chart):
    """tls.enabled=false: every gRPC process is told DILOCO_INSECURE=1 (diloco refuses
    plaintext otherwise), mounts no certificates, and is probed on its main port."""
    rendered = chart.render(merge(VARIANTS["plaintext"], {"validator": {"enabled": True}}))
    assert rendered.one("Deployment", "-validator")
    assert not rendered.all("Certificate") and not [s for s in rendered.all("Secret") if s["metadata"]["name"].endswith("-tls")]
    for what, (pod, name, service) in grpc_processes(rendered).items():
        c = container(pod, name)
        env = environment(pod, c)
        assert "DILOCO_TLS_DIR" not in env, what
        if what != "helm test":  # (a plain grpc script, not the diloco CLI)
            assert env.get("DILOCO_INSECURE") == "1", what
        assert not [v for v in pod["spec"]["volumes"] if v["name"] == "tls"], what
        if service is not None:
            parsed = build_parser().parse_args(args(pod, c))
            assert c["readinessProbe"]["grpc"] == {"port": parsed.port, "service": service}, what


def test_the_chart_s_generated_certificates_carry_mutual_tls(variants, tmp_path):
    """The default install's Secret (a CA and a certificate Helm generates): written out as
    the pods see it, a real shard serving with it answers a client holding it, and
    refuses a plaintext client and a client of another CA."""
    import asyncio
    import base64

    from diloco import rpc
    from diloco.cli.certs import make_certs
    from tests.grpc.conftest import running_shard
    from tests.grpc.test_tls import status_with

    secret = variants["defaults"].one("Secret", "-tls")
    assert secret["type"] == "kubernetes.io/tls" and sorted(secret["data"]) == ["ca.crt", "tls.crt", "tls.key"]
    (tmp_path / "tls").mkdir()
    for key, value in secret["data"].items():
        (tmp_path / "tls" / key).write_bytes(base64.b64decode(value))
    ours = rpc.Tls.from_dir(tmp_path / "tls")
    make_certs(tmp_path / "other")
    theirs = rpc.Tls.from_dir(tmp_path / "other")

    async def scenario():
        rpc.use_tls(ours)
        try:
            async with running_shard(tmp_path / "shard") as (_, address):
                assert (await status_with(address, ours)).plan_hash
                for tls in (None, theirs):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await status_with(address, tls)
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            rpc.use_tls(None)

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_cert_manager_is_asked_for_a_certificate_every_process_can_use(variants):
    rendered = variants["tls-cert-manager"]
    certificate = rendered.one("Certificate", "-tls")
    spec = certificate["spec"]
    assert certificate["apiVersion"] == "cert-manager.io/v1"
    assert spec["secretName"] == certificate["metadata"]["name"] == tls_secret_name(rendered)
    assert "diloco" in spec["dnsNames"]  # the name every channel verifies (rpc.TLS_SERVER_NAME)
    assert {"server auth", "client auth"} <= set(spec["usages"])  # each process is both
    assert spec["issuerRef"] == {"group": "cert-manager.io", "kind": "ClusterIssuer", "name": "run-ca"}
    assert not [s for s in rendered.all("Secret") if s["metadata"]["name"] == spec["secretName"]]


@pytest.mark.parametrize("name", [*PRESETS, *MULTIHOST_PRESETS, "observability", "restore-pinned", "validator"])
def test_security_context_and_resources_everywhere(renders, launched, name):
    rendered = renders[name]
    pods = {**rendered.workload_pods(), **{f"template/{k}": v for k, v in rendered.pod_templates().items()}}
    pods.update({f"launched/{p['metadata']['name']}": p for p in launched.get(name, ([], None))[0]})
    if name in MULTIHOST_PRESETS:  # every static learner's JobSet, one per learner
        assert sum(where.startswith("JobSet/") for where in pods) == rendered.values["learners"]["replicas"]
    for where, pod in pods.items():
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] >= 10000, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec["enableServiceLinks"] is False, where
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["readOnlyRootFilesystem"] is True, where
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}, where
            for bound in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][bound]), (where, bound)
            assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"]), f"{where}: no writable /tmp"


def test_otel_wiring(presets, variants):
    for rendered in (presets["values-tpu-v5e.yaml"], variants["observability"]):
        endpoint = rendered.values["otel"]["endpoint"]
        pods = {
            "coordinator": (coordinator_pod(rendered), "coordinator"),
            "syncer": (statefulset_pod(rendered.one("StatefulSet"), 1), "syncer"),
            "learner": (job_pod(rendered), "learner"),
            "launched learner": (templated_pod(next(iter(rendered.pod_templates().values())), "p"), "learner"),
        }
        for role, (pod, name_) in pods.items():
            env = environment(pod, container(pod, name_))
            service_role = role.split()[-1]
            assert env["OTEL_SERVICE_NAME"] == telemetry.SERVICE_NAMES[service_role]
            attributes = telemetry.resource_attributes(service_role, env)
            assert attributes["k8s.pod.name"] == pod["metadata"]["name"]
            assert attributes["k8s.namespace.name"] == NAMESPACE
            if service_role == "learner":
                assert attributes[telemetry.POOL] == pod["metadata"]["labels"]["diloco/pool"]
            plan = telemetry.export_plan(env)
            if endpoint:
                assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint
                assert plan.traces == ("otlp",) and plan.metrics == ("otlp", "prometheus")
                assert attributes["deployment.environment"] == "prod east" and attributes["team"] == "ml"
                assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
            else:
                assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env
                assert plan.traces == () and plan.metrics == (), "nothing exported unless configured"


def _pod_labels(pod):
    return pod["metadata"]["labels"]


@pytest.mark.parametrize("name", PRESETS)
def test_network_policy_lets_learners_reach_shards_and_coordinator_and_nobody_else_the_shards(presets, launched, name):
    rendered = presets[name]
    policies = rendered.all("NetworkPolicy")
    shard = _pod_labels(statefulset_pod(rendered.one("StatefulSet"), 0))
    coordinator = _pod_labels(coordinator_pod(rendered))
    test_pod = _pod_labels(rendered.one("Pod", "-test-health"))
    learners = [_pod_labels(job_pod(rendered)), *(_pod_labels(p) for p in launched[name][0])]
    grpc_port = ("grpc", rendered.values["syncer"]["port"])
    coordinator_port = ("grpc", rendered.values["coordinator"]["port"])
    for learner in learners:
        assert ingress_allowed(policies, shard, learner, grpc_port)
        assert ingress_allowed(policies, coordinator, learner, coordinator_port)
        assert not ingress_allowed(policies, learner, shard, grpc_port), "learners accept no connections"
    assert ingress_allowed(policies, shard, coordinator, grpc_port), "snapshot markers"
    assert ingress_allowed(policies, coordinator, shard, coordinator_port), "membership stream"
    assert ingress_allowed(policies, shard, test_pod, grpc_port) and ingress_allowed(policies, coordinator, test_pod, coordinator_port)
    strangers = {
        "another release's learner": {**learners[0], "app.kubernetes.io/instance": "other"},
        "an unlabelled pod": {"app": "web"},
        "another shard of another release": {**shard, "app.kubernetes.io/instance": "other"},
    }
    for who, labels in strangers.items():
        assert not ingress_allowed(policies, shard, labels, grpc_port), who
        assert not ingress_allowed(policies, coordinator, labels, coordinator_port), who
    assert not ingress_allowed(policies, shard, learners[0], grpc_port, source_namespace="other"), "same labels, other namespace"
    assert not ingress_allowed(policies, shard, shard, grpc_port), "shards do not talk to each other"


def test_network_policy_admits_scrapers_only_to_metrics(variants):
    rendered = variants["observability"]
    policies = rendered.all("NetworkPolicy")
    shard = _pod_labels(statefulset_pod(rendered.one("StatefulSet"), 0))
    scraper = {"app.kubernetes.io/name": "collector"}
    gmp = {"kubernetes.io/metadata.name": "gmp-system"}
    assert ingress_allowed(policies, shard, scraper, ("metrics", 9464), "gmp-system", gmp)
    assert not ingress_allowed(policies, shard, scraper, ("grpc", 50052), "gmp-system", gmp)
    assert not ingress_allowed(policies, shard, scraper, ("metrics", 9464), "default")


# --- helm test ---------------------------------------------------------------------------


def test_helm_test_pod_checks_every_service(presets):
    rendered = presets["values-tpu-v6e.yaml"]
    pod = rendered.one("Pod", "-test-health")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = container(pod, "health")
    pairs = list(zip(c["args"][::2], c["args"][1::2]))
    coordinator = build_parser().parse_args(args(coordinator_pod(rendered), container(coordinator_pod(rendered), "coordinator")))
    assert pairs == [(coordinator.advertise_address, COORDINATOR_SERVICE)] + [
        (address, SYNCER_SERVICE) for address in coordinator.shards.split(",")
    ]
    assert len(pairs) == 1 + rendered.values["syncer"]["shards"]


def _run_health_script(c, targets):
    command = c["command"]
    assert command[:2] == ["python", "-c"]
    return subprocess.run([sys.executable, "-c", command[2], *targets], capture_output=True, text=True, timeout=60)


def test_helm_test_script_passes_only_when_every_service_serves(presets):
    """The test pod's script, run here against a real grpc.health.v1 server on port 0."""
    c = container(presets["values-cpu-dev.yaml"].one("Pod", "-test-health"), "health")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        for service in (COORDINATOR_SERVICE, SYNCER_SERVICE):
            servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        ok = _run_health_script(c, [address, COORDINATOR_SERVICE, address, SYNCER_SERVICE])
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert f"{address} {SYNCER_SERVICE}: SERVING" in ok.stdout
        servicer.set(SYNCER_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        draining = _run_health_script(c, [address, COORDINATOR_SERVICE, address, SYNCER_SERVICE])
        assert draining.returncode == 1 and "NOT_SERVING" in draining.stdout, draining.stdout + draining.stderr
    finally:
        server.stop(None)



def test_helm_test_script_speaks_mutual_tls_with_the_run_s_certificates(variants, tmp_path):
    """With tls.enabled the script, run here against a real mutual-TLS shard, passes with
    the run's certificates in DILOCO_TLS_DIR and fails without them."""
    import asyncio
    import os
    import threading

    from diloco import rpc
    from diloco.cli.certs import make_certs
    from tests.grpc.conftest import running_shard

    c = container(variants["tls"].one("Pod", "-test-health"), "health")
    make_certs(tmp_path / "tls")
    served, stop, ready = {}, threading.Event(), threading.Event()

    def serve():
        async def main():
            rpc.use_tls(rpc.Tls.from_dir(tmp_path / "tls"))
            try:
                async with running_shard(tmp_path / "shard") as (_, address):
                    served["address"] = address
                    ready.set()
                    await asyncio.to_thread(stop.wait, 120)
            finally:
                rpc.use_tls(None)
        asyncio.run(main())

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        assert ready.wait(60)
        targets = [served["address"], SYNCER_SERVICE]
        env = {**os.environ, "DILOCO_TLS_DIR": str(tmp_path / "tls")}
        ok = subprocess.run([sys.executable, "-c", c["command"][2], *targets], capture_output=True, text=True,
                            timeout=60, env=env)
        assert ok.returncode == 0 and f"{served['address']} {SYNCER_SERVICE}: SERVING" in ok.stdout, ok.stdout + ok.stderr
        env.pop("DILOCO_TLS_DIR")
        plain = subprocess.run([sys.executable, "-c", c["command"][2].replace("timeout=30", "timeout=3"), *targets],
                               capture_output=True, text=True, timeout=60, env=env)
        assert plain.returncode == 1 and "SERVING" not in plain.stdout.replace("NOT_SERVING", ""), plain.stdout
    finally:
        stop.set()
        thread.join(timeout=60)


@pytest.mark.parametrize("name", ["defaults", "scavenged-only", "custom-task", "restore-pinned"])
def test_the_owner_flag_and_the_role_name_the_rendered_configmap(variants, name):
    """Also under fullnameOverride: the coordinator's --owner-configmap, the Role's one
    resourceName and the pod-templates ConfigMap are one object."""
    rendered = variants[name]
    pod = coordinator_pod(rendered)
    parsed = build_parser().parse_args(args(pod, container(pod, "coordinator")))
    owner = rendered.one("ConfigMap", "-pod-templates")["metadata"]["name"]
    [role] = rendered.all("Role")
    [rule] = [r for r in role["rules"] if r["resources"] == ["configmaps"]]
    assert parsed.owner_configmap == owner and rule["resourceNames"] == [owner] and rule["verbs"] == ["get"]
    if name == "restore-pinned":
        assert owner == "run-b-pod-templates"


# --- the validator -----------------------------------------------------------------------


def test_the_validator_s_args_parse_and_name_every_shard_in_shard_order(variants):
    """What `diloco validator` makes of the rendered args: every shard's stable address at
    its shard id (the StatefulSet pod of that ordinal, as the coordinator lists them), the
    values' interval, steps and agreement in its config, the run config and the run secret
    from their mounts; and every shard runs with --validator."""
    rendered = variants["validator"]
    values = rendered.values["validator"]
    pod = validator_pod(rendered)
    c = container(pod, "validator")
    parsed = build_parser().parse_args(args(pod, c))
    assert parsed.command == "validator" and parsed.log_level == rendered.values["logLevel"]
    cfg = from_flags(parsed, ValidatorConfig)
    assert (cfg.interval_s, cfg.steps, cfg.agreement) == (values["intervalSeconds"], values["steps"], values["agreement"])
    sts = rendered.one("StatefulSet", "-syncer")
    shards = rendered.values["syncer"]["shards"]
    assert len(cfg.shards) == shards == 3
    coordinator = build_parser().parse_args(args(coordinator_pod(rendered), container(coordinator_pod(rendered), "coordinator")))
    assert list(cfg.shards) == coordinator.shards.split(",")
    for ordinal in range(shards):
        shard = statefulset_pod(sts, ordinal)
        shard_args = build_parser().parse_args(args(shard, container(shard, "syncer")))
        assert shard_args.shard_id == ordinal and shard_args.validator is True
        dns = f"{shard['spec']['hostname']}.{shard['spec']['subdomain']}.{NAMESPACE}.svc.{CLUSTER_DOMAIN}"
        assert cfg.shards[ordinal] == f"{dns}:{shard_args.port}"
    configmap = rendered.one("ConfigMap", "-run")
    assert mounted(pod, c, parsed.run_config) == Mounted("configMap", configmap["metadata"]["name"], "run-config.json")
    assert RunConfig.from_json(configmap["data"]["run-config.json"]).task_options["data"] == "/data/corpus"
    assert mounted(pod, c, "/data/corpus") == Mounted("csi", "corpus", "corpus"), "the task's data, as the learners read it"
    assert mounted(pod, c, parsed.secret_file) == Mounted("secret", rendered.values["auth"]["existingSecret"], "secret")


def test_the_validator_defaults_are_the_validator_s_own(chart):
    """The chart's defaults give the validator the config it has without flags."""
    rendered = chart.render(merge(VARIANTS["defaults"], {"validator": {"enabled": True}}))
    pod = validator_pod(rendered)
    cfg = from_flags(build_parser().parse_args(args(pod, container(pod, "validator"))), ValidatorConfig)
    assert cfg == ValidatorConfig(shards=cfg.shards) and len(cfg.shards) == rendered.values["syncer"]["shards"]


def test_the_validator_holds_the_run_secret_and_no_other_credential(variants):
    """It signs itself V with the run secret: of the auth Secret only that key is
    projected (not the join or the admin token), beside the TLS Secret."""
    rendered = variants["validator"]
    pod = validator_pod(rendered)
    secrets = {v["secret"]["secretName"]: v["secret"].get("items") for v in pod["spec"]["volumes"] if "secret" in v}
    assert secrets.pop(rendered.values["auth"]["existingSecret"]) == [{"key": "secret", "path": "secret"}]
    assert list(secrets) == [tls_secret_name(rendered)]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert "envFrom" not in container(pod, "validator")


def test_network_policy_lets_the_validator_reach_the_shards_only(variants, chart):
    rendered = variants["validator"]
    policies = rendered.all("NetworkPolicy")
    validator = _pod_labels(validator_pod(rendered))
    shard = _pod_labels(statefulset_pod(rendered.one("StatefulSet"), 0))
    coordinator = _pod_labels(coordinator_pod(rendered))
    learner = _pod_labels(job_pod(rendered))
    grpc_port = ("grpc", rendered.values["syncer"]["port"])
    assert ingress_allowed(policies, shard, validator, grpc_port)
    assert not ingress_allowed(policies, coordinator, validator, ("grpc", rendered.values["coordinator"]["port"]))
    for peer in (shard, coordinator, learner):
        assert not ingress_allowed(policies, validator, peer, grpc_port), "the validator accepts no connections"
    assert not ingress_allowed(policies, shard, {**validator, "app.kubernetes.io/instance": "other"}, grpc_port)
    assert not ingress_allowed(policies, shard, validator, grpc_port, source_namespace="other")
    # Without the validator the shards admit no pod labelled as one.
    disabled = chart.render(VARIANTS["defaults"]).all("NetworkPolicy")
    assert not ingress_allowed(disabled, shard, validator, grpc_port)
    assert ingress_allowed(disabled, shard, learner, grpc_port)


def test_the_validator_runs_from_its_rendered_args_and_scores_pushes_on_real_shards(chart, tmp_path):
    """The rendered container, run: `python -m diloco` with the Deployment's args and
    environment (the mounted files written where the args name them, under tmp_path; each
    shard's stable address swapped for a real shard on 127.0.0.1, plaintext as with
    tls.enabled false) reads the run config from the ConfigMap's JSON, signs itself with
    the run secret, and scores a learner's push on each shard: the shard's tape records
    its judgement. SIGTERM ends it with status 0."""
    import asyncio
    import os
    import signal

    from diloco.tape import read_tape
    from tests.grpc.conftest import SECRET, TINY, client_for, running_shard
    from tests.grpc.test_syncer_service import FakeLearner

    options = {k: v for k, v in TINY.task_options.items()}
    rendered = chart.render(merge(VARIANTS["plaintext"], {
        "run": {"taskOptions": options, "fragments": TINY.fragments}, "syncer": {"shards": 2},
        "validator": {"enabled": True, "intervalSeconds": 0.2, "steps": 1}}))
    run_json = rendered.one("ConfigMap", "-run")["data"]["run-config.json"]
    assert RunConfig.from_json(run_json) == TINY, "the shards below hold TINY's model"
    pod = validator_pod(rendered)
    c = container(pod, "validator")
    argv, env = args(pod, c), environment(pod, c)
    parsed = build_parser().parse_args(argv)
    files = {parsed.secret_file: SECRET, parsed.run_config: run_json}

    for shard in ("s0", "s1"):
        (tmp_path / shard).mkdir()

    async def scenario():
        async with running_shard(tmp_path / "s0", shard_id=0, num_shards=2, validator=True) as (s0, a0), \
                running_shard(tmp_path / "s1", shard_id=1, num_shards=2, validator=True) as (s1, a1):
            local = dict(zip(parsed.shards.split(","), [a0, a1]))
            assert len(local) == 2
            command = []
            for arg in argv:
                arg = local.get(arg, arg) if arg != parsed.shards else ",".join(local[a] for a in parsed.shards.split(","))
                if arg in files:
                    path = tmp_path / "pod" / arg.lstrip("/")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(files[arg])
                    arg = str(path)
                command.append(arg)
            learners = [FakeLearner.of(server, "L0", fragment=f) for f, server in enumerate((s0, s1))]
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "diloco", *command, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, **env, "HOME": str(tmp_path)})
            try:
                for server, address, learner, name in ((s0, a0, learners[0], "s0"), (s1, a1, learners[1], "s1")):
                    def scored():
                        return any(state.trust for state in server.runtime.core.fragments.values())

                    # A push every second: the validator judges those that arrive after its first
                    # pass (it judges by the direction it trained from values read before them).
                    for tick in range(600):
                        if scored():
                            break
                        if tick % 10 == 0:
                            async with client_for(address, "L0") as client:
                                await learner.push(client)
                        await asyncio.sleep(0.1)
                    assert scored(), f"shard {name} got no score"
            finally:
                process.send_signal(signal.SIGTERM)
                _, stderr = await asyncio.wait_for(process.communicate(), 60)
            return process.returncode, stderr.decode()

    code, log = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert code == 0, log[-3000:]
    assert "validator: 2 shards, 1 steps a pass, agreement 0.05, every 0.2 s" in log, log[-3000:]
    for shard in ("s0", "s1"):
        judged = [r for r in read_tape(tmp_path / shard / f"tape-S{shard[1]}.jsonl") if r["kind"] == "trust"]
        assert judged and {r["learner"] for r in judged} == {"L0"}, shard
