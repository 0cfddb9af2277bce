"""The KubernetesLauncher against a local HTTP server (127.0.0.1:0, in this process) that
implements the pod and JobSet create / list / delete paths and the ConfigMap get path of
the Kubernetes API. The official ``kubernetes`` client does the talking; every pod it
sends is checked with kubernetes-validate against the API's own schema, every JobSet
against the JobSet CRD's schema (tests/k8s/crds) and its Job against the core one."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import grpc
import pytest

pytest.importorskip("kubernetes")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from kubernetes import client  # noqa: E402

from diloco.coordinator.config import KubernetesLauncherConfig  # noqa: E402
from diloco.coordinator.core.membership import FailedLaunch, Launch  # noqa: E402
from diloco.coordinator.kubernetes import KubernetesLauncher, load_template  # noqa: E402
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted  # noqa: E402
from diloco.v1 import coordinator_pb2  # noqa: E402
from tests.grpc.conftest import run  # noqa: E402
from tests.grpc.coordinator_fixtures import admin_stub, joined, running_coordinator, wait_for  # noqa: E402
from tests.k8s.chart import jobset_pods, validate_jobset  # noqa: E402

TEMPLATE = """
apiVersion: v1
kind: PodTemplate
metadata:
  name: diloco-learner
template:
  metadata:
    labels:
      app.kubernetes.io/instance: run-a
    annotations:
      example.com/team: ml-infra
  spec:
    serviceAccountName: diloco-learner
    nodeSelector:
      cloud.google.com/gke-spot: "true"
      cloud.google.com/gke-tpu-accelerator: tpu-v5-lite-podslice
    tolerations:
      - {key: google.com/tpu, operator: Exists, effect: NoSchedule}
    containers:
      - name: learner
        image: ghcr.io/example/diloco:0.1.0
        command: [diloco, learner]
        args: [--device, xla]
        resources:
          limits: {google.com/tpu: "4"}
        volumeMounts:
          - {name: join-token, mountPath: /var/run/diloco, readOnly: true}
    volumes:
      - name: join-token
        secret: {secretName: diloco-join-token}
"""
# A multi-host slice as the chart renders it into the pod-templates ConfigMap (trimmed).
JOBSET_TEMPLATE = """
apiVersion: jobset.x-k8s.io/v1alpha2
kind: JobSet
metadata:
  annotations:
    alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool
spec:
  failurePolicy: {maxRestarts: 3}
  network: {enableDNSHostnames: true}
  replicatedJobs:
    - name: slice
      replicas: 1
      template:
        spec:
          completionMode: Indexed
          completions: 2
          parallelism: 2
          backoffLimit: 0
          template:
            metadata:
              labels:
                app.kubernetes.io/instance: run-a
            spec:
              restartPolicy: Never
              nodeSelector:
                cloud.google.com/gke-tpu-accelerator: tpu-v6e-slice
                cloud.google.com/gke-tpu-topology: 2x4
              containers:
                - name: learner
                  image: ghcr.io/example/diloco-tpu:0.1.0
                  args: [learner, --device, xla, --slice-hosts, "2", --slice-index, $(SLICE_INDEX)]
                  env:
                    - name: SLICE_INDEX
                      valueFrom:
                        fieldRef: {fieldPath: "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                  resources:
                    limits: {google.com/tpu: "4"}
"""
# path -> (the server's store of those objects, their kind)
COLLECTIONS = {
    re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?$"): ("pods", "Pod"),
    re.compile(r"^/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets(?:/([^/]+))?$"): ("jobsets", "JobSet"),
}
CONFIGMAP = re.compile(r"^/api/v1/namespaces/([^/]+)/configmaps/([^/]+)$")
OWNER = "run-a-pod-templates"
OWNER_UID = "6f1c2d4e-0b7a-4c1e-9a55-3d2f8e1b7c90"


class FakeKubernetesAPI(ThreadingHTTPServer):
    """Pods and JobSets: POST (create), GET with labelSelector (list), DELETE (delete).
    ConfigMaps: GET by name (the launcher's owner); names in `forbidden` answer 403 as
    RBAC would."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.pods: dict[tuple[str, str], dict] = {}
        self.jobsets: dict[tuple[str, str], dict] = {}
        self.configmaps: dict[tuple[str, str], dict] = {}
        self.forbidden: set[str] = set()
        self.configmap_reads: list[tuple[str, str]] = []
        self.received: list[dict] = []
        self.deleted: list[str] = []
        self.lock = threading.Lock()

    def add_configmap(self, namespace, name, uid):
        self.configmaps[(namespace, name)] = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": "7",
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "data": {"spot.yaml": "{}"},
        }

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"

    def api_client(self):
        configuration = client.Configuration()
        configuration.host = self.url
        return client.ApiClient(configuration)


def _status(code, reason, message):
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


def _matches(labels, selector):
    """Equality ("k=v"), existence ("k") and absence ("!k") terms, all of which must hold."""
    for term in filter(None, (selector or "").split(",")):
        if term.startswith("!"):
            if term[1:] in labels:
                return False
            continue
        key, eq, value = term.partition("=")
        if (eq and labels.get(key) != value) or (not eq and key not in labels):
            return False
    return True


class _Handler(BaseHTTPRequestHandler):
    server: FakeKubernetesAPI

    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _collection(self, path):
        """(the store, its kind, namespace, name or None) of a pods or jobsets path, else None."""
        for pattern, (store, kind) in COLLECTIONS.items():
            match = pattern.match(path)
            if match:
                return getattr(self.server, store), kind, match.group(1), match.group(2)
        return None

    def do_POST(self):
        found = self._collection(urlparse(self.path).path)
        if not found or found[3]:
            return self._reply(404, _status(404, "NotFound", "no such path"))
        store, kind, namespace, _ = found
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        name = body["metadata"]["name"]
        with self.server.lock:
            self.server.received.append(body)
            if (namespace, name) in store:
                return self._reply(409, _status(409, "AlreadyExists", f'{kind.lower()}s "{name}" already exists'))
            created = {**body, "metadata": {**body["metadata"], "uid": f"uid-{name}", "creationTimestamp": "2026-01-01T00:00:00Z"},
                       "status": {"phase": "Pending"} if kind == "Pod" else {"restarts": 0}}
            store[(namespace, name)] = created
        self._reply(201, created)

    def do_GET(self):
        url = urlparse(self.path)
        configmap = CONFIGMAP.match(url.path)
        if configmap:
            key = (configmap.group(1), configmap.group(2))
            with self.server.lock:
                self.server.configmap_reads.append(key)
                found = self.server.configmaps.get(key)
            if key[1] in self.server.forbidden:
                return self._reply(403, _status(403, "Forbidden", f'configmaps "{key[1]}" is forbidden: User '
                                                f'"system:serviceaccount:{key[0]}:run-a-coordinator" cannot get '
                                                f'resource "configmaps" in API group "" in the namespace "{key[0]}"'))
            if found is None:
                return self._reply(404, _status(404, "NotFound", f'configmaps "{key[1]}" not found'))
            return self._reply(200, found)
        found = self._collection(url.path)
        if not found or found[3]:
            return self._reply(404, _status(404, "NotFound", "no such path"))
        store, kind, namespace, _ = found
        selector = parse_qs(url.query).get("labelSelector", [""])[0]
        with self.server.lock:
            items = [o for (ns, _), o in store.items()
                     if ns == namespace and _matches(o["metadata"].get("labels", {}), selector)]
        self._reply(200, {"apiVersion": "v1", "kind": f"{kind}List", "metadata": {"resourceVersion": "1"}, "items": items})

    def do_DELETE(self):
        found = self._collection(urlparse(self.path).path)
        if not found or not found[3]:
            return self._reply(404, _status(404, "NotFound", "no such path"))
        store, kind, namespace, name = found
        with self.server.lock:
            deleted = store.pop((namespace, name), None)
            self.server.deleted.append(name)
        if deleted is None:
            return self._reply(404, _status(404, "NotFound", f'{kind.lower()}s "{name}" not found'))
        self._reply(200, deleted)


@pytest.fixture
def api():
    server = FakeKubernetesAPI()
    server.add_configmap("training", OWNER, OWNER_UID)
    server.add_configmap("elsewhere", OWNER, "uid-of-another-namespace")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def template(tmp_path):
    path = tmp_path / "learner-pod.yaml"
    path.write_text(TEMPLATE)
    return path


def launcher_for(api, template, max_learners=8, pools=("",), owner=OWNER):
    """`template` for every pool of `pools`, or (pool, template) pairs."""
    templates = template if isinstance(template, tuple) else tuple((p, template) for p in pools)
    cfg = KubernetesLauncherConfig(namespace="training", pod_templates=templates, owner_configmap=owner)
    return KubernetesLauncher(cfg, "run-a", "coordinator.training:7000", max_learners, api.api_client())


OWNER_REFERENCE = {"apiVersion": "v1", "kind": "ConfigMap", "name": OWNER, "uid": OWNER_UID,
                   "controller": False, "blockOwnerDeletion": False}


def assert_valid(manifest):
    """Raises kubernetes_validate.ValidationError naming the field if the pod is invalid."""
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_the_validator_rejects_a_broken_pod():
    broken = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": {"containers": [{"name": "c", "args": "--oops"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        assert_valid(broken)


def test_launch_creates_labelled_valid_pods_and_stop_deletes_them(api, template):
    async def scenario():
        launcher = launcher_for(api, template)
        results = await launcher.launch(["a1", "a2"], "spot", {"lr": "3e-4"})
        assert [(r.launch_id, r.ok, r.detail) for r in results] == [
            ("a1", True, "pod training/run-a-learner-a1"), ("a2", True, "pod training/run-a-learner-a2"),
        ]
        assert len(api.received) == 2
        for manifest in api.received:
            assert_valid(manifest)
        pod = api.received[0]
        assert pod["metadata"]["name"] == "run-a-learner-a1" and pod["metadata"]["namespace"] == "training"
        assert pod["metadata"]["labels"] == {
            "app.kubernetes.io/instance": "run-a",
            "app.kubernetes.io/name": "diloco",
            "app.kubernetes.io/component": "learner",
            "diloco/pool": "spot",
            "diloco/owner": "run-a",
            "diloco/launch-id": "a1",
        }
        assert pod["metadata"]["annotations"] == {"example.com/team": "ml-infra"}
        # Owned by the release's ConfigMap (its UID as the API reported it), so deleting
        # the release garbage-collects the pods; not by anything a restart replaces.
        assert [m["metadata"]["ownerReferences"] for m in api.received] == [[OWNER_REFERENCE]] * 2
        assert api.pods[("training", "run-a-learner-a2")]["metadata"]["ownerReferences"] == [OWNER_REFERENCE]
        assert api.configmap_reads == [("training", OWNER)], "the owner is looked up once, when the launcher starts"
        (container,) = pod["spec"]["containers"]
        assert container["command"] == ["diloco", "learner"]
        assert container["args"] == [
            "--device", "xla", "--coordinator", "coordinator.training:7000",
            "--join-token-file", "/var/run/diloco/join-token", "--pool", "spot", "--launch-id", "a1",
            "--lr", "3e-4",
        ]
        assert pod["spec"]["restartPolicy"] == "Never"
        assert pod["spec"]["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
        assert sorted(launcher.running_pods()) == ["run-a-learner-a1", "run-a-learner-a2"]

        await launcher.stop(["a1", "never-launched"])  # a pod already gone is no error
        assert api.deleted == ["run-a-learner-a1", "run-a-learner-never-launched"]
        assert launcher.running_pods() == ["run-a-learner-a2"]
        assert launcher.reaped_on_close() == []  # pods outlive the coordinator

    run(scenario())


def test_the_cap_counts_existing_pods_and_api_errors_come_back_as_results(api, template):
    async def scenario():
        launcher = launcher_for(api, template, max_learners=2)
        assert [r.ok for r in await launcher.launch(["b1"], "default", {})] == [True]
        (again,) = await launcher.launch(["b1"], "default", {})  # the same pod name twice
        assert not again.ok and again.detail == 'pod run-a-learner-b1: 409 Conflict: pods "run-a-learner-b1" already exists'
        # A restarted coordinator does not remember b1, the list API does.
        fresh = launcher_for(api, template, max_learners=2)
        with pytest.raises(ResourceExhausted, match="cannot add 2 learner pods: 1 of the cap of 2 exist"):
            await fresh.launch(["b2", "b3"], "default", {})

    run(scenario())


def test_add_and_remove_learners_through_the_coordinator(api, template, tmp_path):
    async def scenario():
        def factory(server, address):
            cfg = KubernetesLauncherConfig(namespace="training", pod_templates=(("spot", template),),
                                           owner_configmap=OWNER)
            return KubernetesLauncher(cfg, "run-a", address, server.cfg.max_learners, api.api_client())

        async with running_coordinator(
            tmp_path, launcher="kubernetes", launcher_factory=factory, pools=("default", "spot")
        ) as server:
            async with admin_stub(server.address) as (stub, md):
                reply = await stub.AddLearners(coordinator_pb2.AddLearnersRequest(count=1, pool="spot"), metadata=md)
                (launch,) = reply.launches
                assert launch.ok and launch.detail.startswith("pod training/run-a-learner-")
                args = api.received[0]["spec"]["containers"][0]["args"]
                assert api.received[0]["metadata"]["ownerReferences"] == [OWNER_REFERENCE]
                assert args[args.index("--coordinator") + 1] == server.address
                # The pod's learner joins with its launch id; removing it deletes the pod.
                session = await joined(server.address, pool="spot", launch_id=launch.launch_id)
                await stub.RemoveLearners(coordinator_pb2.RemoveLearnersRequest(learner_ids=[session.learner_id]), metadata=md)
                await wait_for(lambda: api.deleted == [f"run-a-learner-{launch.launch_id}"], "the pod to be deleted")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.AddLearners(coordinator_pb2.AddLearnersRequest(count=1, pool="default"), metadata=md)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert info.value.details() == "no pod template for pool 'default'"
                assert server.runtime.membership.occupied() == 0
            await session.close()

    run(scenario())


def test_a_missing_owner_stops_the_launcher_with_its_name(api, template):
    with pytest.raises(NotFound) as info:
        launcher_for(api, template, owner="run-b-pod-templates")
    assert str(info.value) == (
        "owner ConfigMap training/run-b-pod-templates does not exist: launched pods would have no owner "
        '(404 Not Found: configmaps "run-b-pod-templates" not found)'
    )
    assert api.configmap_reads == [("training", "run-b-pod-templates")] and api.received == []


def test_an_unreadable_owner_is_a_failed_precondition_naming_it(api, template):
    api.forbidden.add(OWNER)
    with pytest.raises(FailedPrecondition, match=r"^cannot read owner ConfigMap training/run-a-pod-templates to own "
                                                 r'launched pods: 403 Forbidden: configmaps "run-a-pod-templates" is forbidden'):
        launcher_for(api, template)


def test_an_unreachable_api_is_a_failed_precondition_naming_the_owner(template):
    configuration = client.Configuration()
    configuration.host = "http://127.0.0.1:9"  # nothing listens there
    configuration.retries = 0
    cfg = KubernetesLauncherConfig(namespace="training", pod_templates=(("", template),), owner_configmap=OWNER)
    with pytest.raises(FailedPrecondition, match="^cannot read owner ConfigMap training/run-a-pod-templates to own launched pods: "):
        KubernetesLauncher(cfg, "run-a", "coordinator.training:7000", 8, client.ApiClient(configuration))


def test_without_an_owner_pods_have_no_owner_reference(api, template):
    async def scenario():
        launcher = launcher_for(api, template, owner="")
        [result] = await launcher.launch(["c1"], "spot", {})
        assert result.ok and "ownerReferences" not in api.received[0]["metadata"]
        assert api.configmap_reads == []

    run(scenario())


def test_a_template_cannot_smuggle_its_own_owner(api, template, tmp_path):
    path = tmp_path / "owned.yaml"
    path.write_text(TEMPLATE.replace("  metadata:\n    labels:", "  metadata:\n    ownerReferences: [{apiVersion: v1, kind: "
                                      "Node, name: n, uid: u}]\n    labels:", 1))
    assert "ownerReferences" in path.read_text()

    async def scenario():
        launcher = launcher_for(api, path)
        await launcher.launch(["d1"], "spot", {})
        assert api.received[0]["metadata"]["ownerReferences"] == [OWNER_REFERENCE]

    run(scenario())


@pytest.mark.parametrize("name", ["Run-A", "-x", "a..b", "x" * 254])
def test_the_owner_name_must_be_a_configmap_name(name):
    with pytest.raises(InvalidArgument, match="owner ConfigMap must be a DNS subdomain"):
        KubernetesLauncherConfig(owner_configmap=name)


def test_a_launched_pod_that_fails_is_reported_with_its_exit_and_last_log_lines(api, template, tmp_path):
    """The pod's learner dies before joining: the launcher sees the pod Failed, and the
    coordinator lists the launch as failed with the container's exit code and its
    termination message (the chart's FallbackToLogsOnError puts the last log lines there)."""
    async def scenario():
        def factory(server, address):
            cfg = KubernetesLauncherConfig(namespace="training", pod_templates=(("spot", template),),
                                           owner_configmap=OWNER, watch_interval_s=0.1)
            return KubernetesLauncher(cfg, "run-a", address, server.cfg.max_learners, api.api_client(),
                                      on_exit=server.runtime.launch_ended)

        async with running_coordinator(
            tmp_path, launcher="kubernetes", launcher_factory=factory, pools=("default", "spot")
        ) as server:
            async with admin_stub(server.address) as (stub, md):
                reply = await stub.AddLearners(coordinator_pb2.AddLearnersRequest(count=2, pool="spot"), metadata=md)
            failing, running = (x.launch_id for x in reply.launches)
            with api.lock:
                api.pods[("training", f"run-a-learner-{failing}")]["status"] = {
                    "phase": "Failed",
                    "containerStatuses": [{"name": "learner", "ready": False, "restartCount": 0, "image": "i", "imageID": "",
                                           "state": {"terminated": {"exitCode": 2, "reason": "Error",
                                                                    "message": "loading the task\ndiloco: error: no such task\n"}}}],
                }
            def failed_launches():
                return [x.launch_id for x in server.runtime.list_launches() if isinstance(x, FailedLaunch)]

            await wait_for(lambda: failed_launches() == [failing], "the failed launch")
            [failed] = [x for x in server.runtime.list_launches() if x.launch_id == failing]
            assert failed.detail == (f"ended before joining: pod run-a-learner-{failing} Failed: exit code 2 (Error): "
                                     "loading the task | diloco: error: no such task")
            assert [x.launch_id for x in server.runtime.list_launches() if isinstance(x, Launch)] == [running]

    run(scenario())


@pytest.fixture
def slice_template(tmp_path):
    path = tmp_path / "learner-slice.yaml"
    path.write_text(JOBSET_TEMPLATE)
    return path


def test_a_multi_host_pool_gets_one_valid_labelled_jobset_per_learner_and_stop_deletes_them(api, slice_template):
    async def scenario():
        launcher = launcher_for(api, slice_template, pools=("slices",))
        results = await launcher.launch(["s1", "s2"], "slices", {"steps": "2000"})
        assert [(r.launch_id, r.ok, r.detail) for r in results] == [
            ("s1", True, "jobset training/run-a-learner-s1"), ("s2", True, "jobset training/run-a-learner-s2"),
        ]
        assert api.pods == {} and len(api.received) == 2
        for manifest in api.received:
            validate_jobset(manifest, kubernetes_validate.latest_version())
        jobset = api.received[0]
        labels = {"app.kubernetes.io/name": "diloco", "app.kubernetes.io/component": "learner", "diloco/pool": "slices",
                  "diloco/owner": "run-a", "diloco/launch-id": "s1"}
        assert jobset["metadata"]["name"] == "run-a-learner-s1" and jobset["metadata"]["namespace"] == "training"
        assert jobset["metadata"]["labels"] == labels
        assert jobset["metadata"]["annotations"] == {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
        assert jobset["metadata"]["ownerReferences"] == [OWNER_REFERENCE], "deleting the release deletes the slice"
        [replicated] = jobset["spec"]["replicatedJobs"]
        assert replicated["replicas"] == 1
        job = replicated["template"]["spec"]
        assert (job["completions"], job["parallelism"]) == (2, 2), "the template's hosts"
        # Every host's pod carries the launch's labels (NetworkPolicy, listing) and joins as the launch.
        pod = job["template"]
        assert pod["metadata"]["labels"] == {"app.kubernetes.io/instance": "run-a", **labels}
        (container,) = pod["spec"]["containers"]
        assert container["args"] == [
            "learner", "--device", "xla", "--slice-hosts", "2", "--slice-index", "$(SLICE_INDEX)",
            "--coordinator", "coordinator.training:7000", "--join-token-file", "/var/run/diloco/join-token",
            "--pool", "slices", "--launch-id", "s1", "--steps", "2000",
        ]
        assert sorted(launcher.running()) == ["run-a-learner-s1", "run-a-learner-s2"]

        await launcher.stop(["s1", "never-launched"])
        assert api.deleted == ["run-a-learner-s1", "run-a-learner-never-launched"], "JobSets only: no pod template"
        assert launcher.running() == ["run-a-learner-s2"]

    run(scenario())


def test_slices_count_once_against_the_cap_beside_pods(api, template, slice_template):
    """A slice is one learner however many hosts it has: the hosts' pods (labelled by the
    JobSet controller) are not counted as learners, their JobSet is."""
    async def scenario():
        launcher = launcher_for(api, (("spot", template), ("slices", slice_template)), max_learners=3)
        assert [r.ok for r in await launcher.launch(["p1"], "spot", {})] == [True]
        assert [r.ok for r in await launcher.launch(["s1"], "slices", {})] == [True]
        with api.lock:  # what the JobSet and Job controllers make of s1: its two hosts' pods
            for pod in jobset_pods(api.jobsets[("training", "run-a-learner-s1")], 0):
                api.pods[("training", pod["metadata"]["name"])] = {**pod, "status": {"phase": "Running"}}
        assert len(api.pods) == 3
        assert sorted(launcher.running()) == ["run-a-learner-p1", "run-a-learner-s1"]
        with pytest.raises(ResourceExhausted, match="cannot add 2 learner pods: 2 of the cap of 3 exist"):
            await launcher.launch(["p2", "s2"], "slices", {})
        # A launch id does not say its kind: stop tries both, and each 404 is no error.
        await launcher.stop(["s1"])
        assert api.deleted == ["run-a-learner-s1", "run-a-learner-s1"] and ("training", "run-a-learner-s1") not in api.jobsets

    run(scenario())


def test_a_failed_slice_is_reported_as_a_failed_launch_with_its_reason(api, slice_template, tmp_path):
    """A host of the slice failed more often than the JobSet's failurePolicy allows: the
    JobSet ends Failed, and the coordinator lists the launch as failed with the JobSet's
    terminal state and its condition's reason and message. An ended slice frees its place."""
    async def scenario():
        def factory(server, address):
            cfg = KubernetesLauncherConfig(namespace="training", pod_templates=(("slices", slice_template),),
                                           owner_configmap=OWNER, watch_interval_s=0.1)
            return KubernetesLauncher(cfg, "run-a", address, server.cfg.max_learners, api.api_client(),
                                      on_exit=server.runtime.launch_ended)

        async with running_coordinator(
            tmp_path, launcher="kubernetes", launcher_factory=factory, pools=("default", "slices")
        ) as server:
            async with admin_stub(server.address) as (stub, md):
                reply = await stub.AddLearners(coordinator_pb2.AddLearnersRequest(count=2, pool="slices"), metadata=md)
            failing, running = (x.launch_id for x in reply.launches)
            assert all(x.ok and x.detail.startswith("jobset training/run-a-learner-") for x in reply.launches)
            with api.lock:
                api.jobsets[("training", f"run-a-learner-{failing}")]["status"] = {
                    "restarts": 3, "terminalState": "Failed",
                    "conditions": [{"type": "Failed", "status": "True", "reason": "ReachedMaxRestarts",
                                    "message": "jobset failed due to reaching max number of restarts",
                                    "lastTransitionTime": "2026-01-01T00:10:00Z"}],
                }

            def failed_launches():
                return [x.launch_id for x in server.runtime.list_launches() if isinstance(x, FailedLaunch)]

            await wait_for(lambda: failed_launches() == [failing], "the failed launch")
            [failed] = [x for x in server.runtime.list_launches() if x.launch_id == failing]
            assert failed.detail == (f"ended before joining: jobset run-a-learner-{failing} Failed: ReachedMaxRestarts: "
                                     "jobset failed due to reaching max number of restarts")
            assert [x.launch_id for x in server.runtime.list_launches() if isinstance(x, Launch)] == [running]
            launcher = factory(server, server.address)
            assert launcher.running() == [f"run-a-learner-{running}"], "an ended slice no longer counts"

    run(scenario())


@pytest.mark.parametrize("change, message", [
    (("replicas: 1", "replicas: 2"), "needs one replicated job of one replica"),
    (("jobset.x-k8s.io/v1alpha2", "jobset.x-k8s.io/v1alpha1"), "must be jobset.x-k8s.io/v1alpha2, got 'jobset.x-k8s.io/v1alpha1'"),
    (("              containers:", "              initContainers:"), "needs a pod spec with at least one container"),
])
def test_a_jobset_template_must_be_one_slice_of_a_known_version(tmp_path, change, message):
    path = tmp_path / "slice.yaml"
    path.write_text(JOBSET_TEMPLATE.replace(*change))
    assert path.read_text() != JOBSET_TEMPLATE
    with pytest.raises(InvalidArgument, match="^" + re.escape(f"JobSet template {path} {message}")):
        load_template(path)
