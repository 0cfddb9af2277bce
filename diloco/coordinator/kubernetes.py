"""``KubernetesLauncher``: learners as pods, created from a pod template through the
official ``kubernetes`` client (an optional dependency, imported only here). A pool whose
template is a JobSet (``jobset.x-k8s.io/v1alpha2``) gets a JobSet per learner instead:
a multi-host TPU slice, one pod per host, created through the custom objects API; the
JobSet controller makes its Job and pods, and the rules below hold for the JobSet.

Every pod it creates is labelled ``app.kubernetes.io/name=diloco``, ``diloco/pool``,
``diloco/owner`` (the release) and ``diloco/launch-id``, so the launcher can count its
own pods (the cap also holds for pods a restarted coordinator no longer remembers) and
delete them on remove.

Pods outlive the coordinator: a restarted one finds its learners re-joining. They do not
outlive the release: with ``owner_configmap`` set (the chart sets it to its ConfigMap of
pod templates), every pod carries an ``ownerReferences`` entry naming that ConfigMap, so
when ``helm uninstall`` deletes it the garbage collector deletes the pods too. The
owner's UID is read once, when the launcher starts (``get`` on that one ConfigMap); a
missing or unreadable owner stops it with ``NotFound`` / ``FailedPrecondition``. The
reference has ``controller: false`` (the ConfigMap reconciles nothing) and
``blockOwnerDeletion: false`` (deleting the release need not wait for the pods, and
``true`` would need ``update`` on ``configmaps/finalizers`` under the
OwnerReferencesPermissionEnforcement admission plugin). The owner is neither the
coordinator's pod, which a restart replaces, nor its Deployment, which an operator may
delete to restart the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from diloco.coordinator.config import KubernetesLauncherConfig
from diloco.coordinator.launcher import LINK_OVERRIDE, ExitCallback, LaunchResult, learner_args
from diloco.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

logger = logging.getLogger(__name__)

NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
POOL_LABEL = "diloco/pool"
OWNER_LABEL = "diloco/owner"
LAUNCH_LABEL = "diloco/launch-id"
JOBSET_GROUP, JOBSET_VERSION, JOBSETS = "jobset.x-k8s.io", "v1alpha2", "jobsets"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"


def load_template(path: Path) -> dict:
    """A pod template from YAML or JSON: a Pod, a PodTemplate, or a bare
    PodTemplateSpec (``{metadata, spec}``) as a Helm chart renders into a ConfigMap; or
    a JobSet template (``kind: JobSet``, no name) of one replicated job, one replica:
    one learner on a multi-host slice."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise NotFound(f"cannot read pod template {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise InvalidArgument(f"pod template {path} is not YAML or JSON: {error}") from None
    if isinstance(raw, dict) and raw.get("kind") == "JobSet":
        return _jobset_template(path, raw)
    if isinstance(raw, dict) and raw.get("kind") == "PodTemplate":
        raw = raw.get("template")
    if not isinstance(raw, dict) or not isinstance(raw.get("spec"), dict) or not raw["spec"].get("containers"):
        raise InvalidArgument(f"pod template {path} needs a spec with at least one container")
    return {"metadata": raw.get("metadata") or {}, "spec": raw["spec"]}


def _jobset_template(path: Path, raw: dict) -> dict:
    if raw.get("apiVersion") != f"{JOBSET_GROUP}/{JOBSET_VERSION}":
        raise InvalidArgument(f"JobSet template {path} must be {JOBSET_GROUP}/{JOBSET_VERSION}, got {raw.get('apiVersion')!r}")
    jobs = (raw.get("spec") or {}).get("replicatedJobs") or []
    if len(jobs) != 1 or jobs[0].get("replicas", 1) != 1:
        raise InvalidArgument(f"JobSet template {path} needs one replicated job of one replica (one learner)")
    pod = (((jobs[0].get("template") or {}).get("spec") or {}).get("template") or {})
    if not isinstance(pod.get("spec"), dict) or not pod["spec"].get("containers"):
        raise InvalidArgument(f"JobSet template {path} needs a pod spec with at least one container")
    return {"apiVersion": raw["apiVersion"], "kind": "JobSet", "metadata": raw.get("metadata") or {}, "spec": raw["spec"]}


def _is_jobset(template: dict) -> bool:
    return template.get("kind") == "JobSet"


def _default_api_client(kube_config: str):
    from kubernetes import client, config

    configuration = client.Configuration()
    if kube_config == "in-cluster":
        config.load_incluster_config(client_configuration=configuration)
    elif kube_config == "auto":
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    else:
        config.load_kube_config(config_file=kube_config, client_configuration=configuration)
    return client.ApiClient(configuration)


def _api_error(error) -> str:
    """The Kubernetes Status message if the API sent one, else the HTTP reason."""
    try:
        message = json.loads(error.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        message = ""
    return f"{error.status} {error.reason}" + (f": {message}" if message else "")


class KubernetesLauncher:
    def __init__(
        self,
        cfg: KubernetesLauncherConfig,
        release: str,
        coordinator: str,
        max_learners: int,
        api_client=None,
        core_api=None,
        on_exit: ExitCallback | None = None,
        custom_api=None,
    ) -> None:
        """``core_api`` (a ``CoreV1Api`` or a stand-in with its methods) and ``custom_api``
        (a ``CustomObjectsApi``, used only with JobSet templates) win over ``api_client``;
        without them, the client comes from ``cfg.kube_config``. With
        ``cfg.owner_configmap`` set, this reads that ConfigMap (blocking, once).
        ``on_exit(launch id, how it ended, cleanly)``: called once for each launched pod or JobSet
        seen finished (listed every ``cfg.watch_interval_s`` once this launcher has launched)."""
        self.cfg = cfg
        self.on_exit = on_exit
        self._reported: set[str] = set()
        self._watcher: asyncio.Task | None = None
        self.release = release
        self.coordinator = coordinator
        self.max_learners = max_learners
        self.templates = {pool: load_template(path) for pool, path in cfg.pod_templates}
        # Only the kinds some template makes are listed and deleted (the chart's RBAC grants no more).
        self.launches_pods = any(not _is_jobset(t) for t in self.templates.values())
        self.launches_jobsets = any(_is_jobset(t) for t in self.templates.values())
        if core_api is None or (self.launches_jobsets and custom_api is None):
            from kubernetes import client

            api_client = api_client if api_client is not None else _default_api_client(cfg.kube_config)
            core_api = core_api if core_api is not None else client.CoreV1Api(api_client)
            custom_api = custom_api if custom_api is not None else client.CustomObjectsApi(api_client)
        self.api = core_api
        self.custom_api = custom_api
        self.owner_reference = self._owner_reference()

    def _owner_reference(self) -> dict | None:
        """The ownerReferences entry of every launched pod: the owner ConfigMap, by the
        UID the API reports now (a ConfigMap recreated under the same name is another owner)."""
        name = self.cfg.owner_configmap
        if not name:
            logger.warning("no owner ConfigMap: launched pods are not garbage-collected with the release")
            return None
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        what = f"owner ConfigMap {self.cfg.namespace}/{name}"
        try:
            configmap = self.api.read_namespaced_config_map(name, self.cfg.namespace)
        except ApiException as error:
            if error.status == 404:
                raise NotFound(f"{what} does not exist: launched pods would have no owner ({_api_error(error)})") from None
            raise FailedPrecondition(f"cannot read {what} to own launched pods: {_api_error(error)}") from None
        except (HTTPError, OSError) as error:
            raise FailedPrecondition(f"cannot read {what} to own launched pods: {error}") from None
        metadata = getattr(configmap, "metadata", None)
        uid = getattr(metadata, "uid", None)
        if not uid:
            raise FailedPrecondition(f"{what} has no uid")
        logger.info("launched pods are owned by %s (uid %s)", what, uid)
        return {"apiVersion": "v1", "kind": "ConfigMap", "name": name, "uid": uid,
                "controller": False, "blockOwnerDeletion": False}

    def object_name(self, launch_id: str) -> str:
        """The name of the pod or JobSet of a launch."""
        return f"{self.release}-learner-{launch_id}"

    def manifest(self, launch_id: str, pool: str, overrides: Mapping[str, str]) -> dict:
        """The Pod, or for a JobSet template the JobSet, that runs learner ``launch_id``."""
        template = self.templates.get(pool) or self.templates.get("")
        if template is None:
            raise NotFound(f"no pod template for pool {pool!r}")
        if _is_jobset(template):
            spec = copy.deepcopy(template["spec"])
            job = spec["replicatedJobs"][0]["template"]["spec"]
            job["template"] = self._learner_pod(job["template"], launch_id, pool, overrides)
            return {"apiVersion": template["apiVersion"], "kind": "JobSet",
                    "metadata": self._metadata(template["metadata"], launch_id, pool), "spec": spec}
        pod = self._learner_pod(template, launch_id, pool, overrides)
        return {"apiVersion": "v1", "kind": "Pod", "metadata": self._metadata(pod["metadata"], launch_id, pool),
                "spec": pod["spec"]}

    def _labels(self, metadata: dict, launch_id: str, pool: str) -> dict:
        return {
            **(metadata.get("labels") or {}),
            NAME_LABEL: "diloco",
            COMPONENT_LABEL: "learner",
            POOL_LABEL: pool,
            OWNER_LABEL: self.release,
            LAUNCH_LABEL: launch_id,
        }

    def _learner_pod(self, template: dict, launch_id: str, pool: str, overrides: Mapping[str, str]) -> dict:
        """A pod template's copy, labelled, whose learner container joins as ``launch_id``."""
        metadata = copy.deepcopy(template.get("metadata") or {})
        spec = copy.deepcopy(template["spec"])
        containers = spec["containers"]
        container = next((c for c in containers if c.get("name") == self.cfg.container), containers[0])
        container["args"] = [
            *(container.get("args") or []),
            *learner_args(self.coordinator, self.cfg.join_token_path, pool, launch_id, overrides),
        ]
        spec.setdefault("restartPolicy", "Never")
        return {"metadata": {**metadata, "labels": self._labels(metadata, launch_id, pool)}, "spec": spec}

    def _metadata(self, metadata: dict, launch_id: str, pool: str) -> dict:
        """A launched object's metadata: the template's, with its name, namespace, labels and owner."""
        out = {
            **{k: v for k, v in metadata.items() if k not in ("name", "generateName", "namespace", "ownerReferences")},
            "name": self.object_name(launch_id),
            "namespace": self.cfg.namespace,
            "labels": self._labels(metadata, launch_id, pool),
        }
        if self.owner_reference is not None:
            out["ownerReferences"] = [dict(self.owner_reference)]
        return out

    def _selector(self) -> str:
        return f"{NAME_LABEL}=diloco,{OWNER_LABEL}={self.release},{LAUNCH_LABEL}"

    def _pod_selector(self) -> str:
        """Launched pods, not the hosts of launched JobSets (which carry the same labels)."""
        return f"{self._selector()},!{JOBSET_NAME_LABEL}"

    def running(self) -> list[str]:
        """Names of this release's launched pods and JobSets (one learner each) that still run."""
        return [*(self.running_pods() if self.launches_pods else ()),
                *(self.running_slices() if self.launches_jobsets else ())]

    def running_pods(self) -> list[str]:
        """Names of this release's launched pods that are not finished or being deleted."""
        pods = self.api.list_namespaced_pod(self.cfg.namespace, label_selector=self._pod_selector())
        return [
            p.metadata.name
            for p in pods.items
            if p.metadata.deletion_timestamp is None and (p.status is None or p.status.phase not in ("Succeeded", "Failed"))
        ]

    def ended_pods(self) -> list[tuple[str, str, bool]]:
        """(launch id, how it ended, cleanly: Succeeded) of this release's launched pods
        that finished: the learner container's exit code, reason and termination message
        (its last log lines with the chart's FallbackToLogsOnError), else the pod's phase
        and reason."""
        pods = self.api.list_namespaced_pod(self.cfg.namespace, label_selector=self._pod_selector())
        ended = []
        for pod in pods.items:
            phase = pod.status.phase if pod.status is not None else None
            if phase not in ("Succeeded", "Failed"):
                continue
            launch_id = (pod.metadata.labels or {}).get(LAUNCH_LABEL, "")
            detail = f"pod {pod.metadata.name} {phase}"
            statuses = {c.name: c for c in (pod.status.container_statuses or [])}
            container = statuses.get(self.cfg.container) or next(iter(statuses.values()), None)
            terminated = container.state.terminated if container is not None and container.state is not None else None
            if terminated is not None:
                detail += f": exit code {terminated.exit_code}" + (f" ({terminated.reason})" if terminated.reason else "")
                message = " | ".join(line.strip() for line in (terminated.message or "").splitlines() if line.strip())
                detail += f": {message[-400:]}" if message else ""
            elif pod.status.reason or pod.status.message:
                detail += f": {pod.status.reason or ''} {pod.status.message or ''}".rstrip()
            ended.append((launch_id, detail, phase == "Succeeded"))
        return ended

    def _jobsets(self) -> list[dict]:
        listing = self.custom_api.list_namespaced_custom_object(
            JOBSET_GROUP, JOBSET_VERSION, self.cfg.namespace, JOBSETS, label_selector=self._selector())
        return listing["items"]

    def running_slices(self) -> list[str]:
        """Names of this release's launched JobSets that have not ended and are not being deleted."""
        return [j["metadata"]["name"] for j in self._jobsets()
                if not j["metadata"].get("deletionTimestamp") and not (j.get("status") or {}).get("terminalState")]

    def ended_slices(self) -> list[tuple[str, str, bool]]:
        """(launch id, how it ended, cleanly: Completed) of this release's launched JobSets
        that ended: the terminal state and its condition's reason and message (a slice
        fails when a host failed once more than its failurePolicy's restarts allow)."""
        ended = []
        for jobset in self._jobsets():
            status = jobset.get("status") or {}
            state = status.get("terminalState")
            if not state:
                continue
            condition = next((c for c in status.get("conditions") or [] if c.get("type") == state), {})
            why = ": ".join(filter(None, (condition.get("reason"), condition.get("message"))))
            detail = f"jobset {jobset['metadata']['name']} {state}" + (f": {why}" if why else "")
            ended.append((jobset["metadata"].get("labels", {}).get(LAUNCH_LABEL, ""), detail, state == "Completed"))
        return ended

    def ended(self) -> list[tuple[str, str, bool]]:
        return [*(self.ended_pods() if self.launches_pods else ()), *(self.ended_slices() if self.launches_jobsets else ())]

    async def _watch(self) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        while True:
            try:
                for launch_id, detail, clean in await asyncio.to_thread(self.ended):
                    if launch_id and launch_id not in self._reported:
                        self._reported.add(launch_id)
                        logger.info("learner of launch %s ended: %s", launch_id, detail)
                        self.on_exit(launch_id, detail, clean)
            except (ApiException, HTTPError, OSError) as error:
                logger.warning("cannot list launched learners: %s", error)
            await asyncio.sleep(self.cfg.watch_interval_s)

    async def launch(self, launch_ids: Sequence[str], pool: str, overrides: Mapping[str, str]) -> list[LaunchResult]:
        from kubernetes.client.exceptions import ApiException

        if LINK_OVERRIDE in overrides:
            raise InvalidArgument(f"{LINK_OVERRIDE}: emulated sites are the local launcher's; pods run on the "
                                  "cluster's own network")
        if self.on_exit is not None and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        manifests = [self.manifest(i, pool, overrides) for i in launch_ids]
        try:
            existing = await asyncio.to_thread(self.running)
        except ApiException as error:
            return [LaunchResult(i, False, f"cannot list launched learners: {_api_error(error)}") for i in launch_ids]
        if len(existing) + len(launch_ids) > self.max_learners:
            raise ResourceExhausted(
                f"cannot add {len(launch_ids)} learner pods: {len(existing)} of the cap of {self.max_learners} exist"
            )
        results = []
        for launch_id, body in zip(launch_ids, manifests):
            what, name = body["kind"].lower(), body["metadata"]["name"]
            try:
                if body["kind"] == "JobSet":
                    await asyncio.to_thread(self.custom_api.create_namespaced_custom_object,
                                            JOBSET_GROUP, JOBSET_VERSION, self.cfg.namespace, JOBSETS, body)
                else:
                    await asyncio.to_thread(self.api.create_namespaced_pod, self.cfg.namespace, body)
            except ApiException as error:
                results.append(LaunchResult(launch_id, False, f"{what} {name}: {_api_error(error)}"))
                continue
            logger.info("created %s %s/%s (pool %s)", what, self.cfg.namespace, name, pool)
            results.append(LaunchResult(launch_id, True, f"{what} {self.cfg.namespace}/{name}"))
        return results

    async def stop(self, launch_ids: Sequence[str], gently: bool = False) -> None:
        """Delete the pods or JobSets (a launch id does not say which: each kind a
        template makes is tried; the JobSet's Jobs and pods go with it). Deletion is
        graceful either way (the pods' termination grace period), so ``gently`` changes
        nothing here."""
        from kubernetes.client.exceptions import ApiException

        deletes = []
        if self.launches_pods:
            deletes.append(("pod", lambda name: self.api.delete_namespaced_pod(name, self.cfg.namespace)))
        if self.launches_jobsets:
            deletes.append(("jobset", lambda name: self.custom_api.delete_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.cfg.namespace, JOBSETS, name, propagation_policy="Background")))
        for launch_id in launch_ids:
            name = self.object_name(launch_id)
            for what, delete in deletes:
                try:
                    await asyncio.to_thread(delete, name)
                except ApiException as error:
                    if error.status != 404:
                        logger.warning("cannot delete %s %s: %s", what, name, _api_error(error))

    def settled(self) -> None:
        """No warm pods: a pod pool is not built."""

    def reaped_on_close(self) -> list[str]:
        return []

    async def close(self) -> None:
        """Pods are not the coordinator's children: they keep training while it restarts
        (their owner is the release's ConfigMap, see the module docstring)."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
