"""Configuration of the coordinator: leases, caps, pools, snapshots and the launcher."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from diloco import auth
from diloco.errors import InvalidArgument
from diloco.coordinator.sites import check_mbit

LAUNCHERS = ("local", "kubernetes", "none")
# Pool and release names end up in pod names and label values: keep them DNS labels.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MAX_RELEASE_CHARS = 40  # leaves room for "-learner-<launch id>" within 63 characters


def check_dns_label(what: str, value: str, max_chars: int = 63) -> None:
    if not _DNS_LABEL.match(value) or len(value) > max_chars:
        raise InvalidArgument(
            f"{what} must be lowercase letters, digits and '-' (at most {max_chars} characters), got {value!r}"
        )


MAX_LEARNERS = 2048
"""The largest ``max_learners``, and ``MAX_SHARDS`` the most shards: the coordinator's
vector clock names every learner it lists (live, and up to 1000 gone), every shard and
itself, and a clock on the wire holds at most 4096 entries."""
MAX_SHARDS = 1024


@dataclass(frozen=True)
class LocalLauncherConfig:
    """Learners as child processes of the coordinator (the embedded default)."""

    command: tuple[str, ...] = ()
    """Argv that starts a learner, before the launcher's own flags. Empty: this Python's
    ``-m diloco learner``. Tests put a small fake learner script here."""
    terminate_timeout_s: float = 10.0
    """After SIGTERM, wait this long for the learner to exit before SIGKILL."""
    fork_server: bool = True
    """Fork learners from a fork server (``diloco.coordinator.forks``: the learner's command with
    ``--fork-server``, started with the coordinator, loads Python, torch and the learner's
    code once): no launch pays that load, learners starting together do not pay it each
    on a few cores, a replacement starts in a fraction of a second. False (or where fork
    is missing): every launch starts a process."""

    site_hub: str = ""
    """Emulated sites (``diloco.coordinator.sites``, needs root): ``TAG/NETWORK`` of a hub another
    process made (``diloco local --link-mbit``); each learner then runs in a network
    namespace of its own joined to that hub by a shaped link. Empty: learners run in this
    process's namespace."""
    link_mbit: float = 1000.0
    """The rate of each site's link, each way, Mbit/s (with ``site_hub``); a launch's
    ``link_mbit`` override sets its own."""

    @property
    def isolation_hold_s(self) -> float:
        """``isolation_hold_leases`` in seconds."""
        return self.isolation_hold_leases * self.lease_s

    def __post_init__(self) -> None:
        if not (math.isfinite(self.terminate_timeout_s) and self.terminate_timeout_s > 0):
            raise InvalidArgument(f"terminate timeout must be > 0 s, got {self.terminate_timeout_s}")
        if self.site_hub and not re.fullmatch(r"[0-9a-f]{4}/198\.1[89]\.\d{1,3}\.0/24", self.site_hub):
            raise InvalidArgument(f"site hub must be TAG/198.18-19.X.0/24 (diloco.coordinator.sites), got {self.site_hub!r}")
        check_mbit(self.link_mbit)


@dataclass(frozen=True)
class KubernetesLauncherConfig:
    """Learners as pods created from a pod template through the Kubernetes API."""

    namespace: str = "default"
    pod_templates: tuple[tuple[str, Path], ...] = ()
    """(pool, template file) pairs; pool "" is the template of every pool without its own."""
    container: str = "learner"
    """Name of the learner container in the template (the first container if absent)."""
    join_token_path: str = "/var/run/diloco/join-token"
    """Where a learner pod reads the join token (the chart mounts a Secret there)."""
    kube_config: str = "auto"
    """"in-cluster", "auto" (in-cluster, else ~/.kube/config) or a kubeconfig path."""
    owner_configmap: str = ""
    """A ConfigMap in ``namespace`` that owns every launched pod (``ownerReferences``),
    so deleting it (``helm uninstall``) garbage-collects them; the chart names its pod
    templates' ConfigMap. Empty: pods have no owner and outlive everything."""
    watch_interval_s: float = 5.0
    """How often launched pods are listed to notice the ones that ended (and why)."""

    @property
    def isolation_hold_s(self) -> float:
        """``isolation_hold_leases`` in seconds."""
        return self.isolation_hold_leases * self.lease_s

    def __post_init__(self) -> None:
        check_dns_label("namespace", self.namespace)
        if not (math.isfinite(self.watch_interval_s) and self.watch_interval_s > 0):
            raise InvalidArgument(f"pod watch interval must be > 0 s, got {self.watch_interval_s}")
        if self.owner_configmap and (
            len(self.owner_configmap) > 253
            or not all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", part) for part in self.owner_configmap.split("."))
        ):
            raise InvalidArgument(
                f"owner ConfigMap must be a DNS subdomain (lowercase letters, digits, '-' and '.'), got {self.owner_configmap!r}"
            )
        for pool, _ in self.pod_templates:
            if pool:
                check_dns_label("pool", pool)


@dataclass(frozen=True)
class CoordinatorConfig:
    data_dir: Path
    """Holds the coordinator's state file, tokens, learner logs and (by default) snapshots."""
    shards: tuple[str, ...] = ()
    """host:port of every syncer shard; shard id = position."""
    pools: tuple[str, ...] = ("default",)
    """Pools learners may join and be launched into; the first is the default."""
    lease_s: float = 5.0
    """A learner that has not heartbeated for this long is marked failed. Learners heartbeat
    every fifth of it unless told an interval: thousands of learners want a longer one
    (at 2,048, 45 s: docs/results/heartbeat/)."""
    isolation_hold_leases: float = 6.0
    """Hearing from no learner for three quarters of a lease when two or more were members,
    the coordinator suspects that it is the one cut off and fails none of them for lease
    expiry, for up to this many leases from the last learner it heard (6: 30 s at the
    default lease); once one is heard again, every lease moves on by the silence (0: off;
    docs/ARCHITECTURE.md, "Partitions")."""
    idle_timeout_s: float = 300.0
    """A learner whose heartbeats report no new trained token or step for this long is
    marked failed, as a dead one (a slow start, an XLA compile, fit in it; 0: never)."""
    credential_lifetime_s: float = auth.CREDENTIAL_LIFETIME_S
    """Learner credentials are issued for this long; every heartbeat reply renews them."""
    max_learners: int = 64
    """Cap on learners joined or being launched; AddLearners beyond it is refused."""
    join_learners: int = 4
    """How many learners the run's join credential (data_dir/join-token, for learners that
    join by themselves) admits at once; the learners the coordinator launches each get one
    of their own, and ``diloco admin join-credential`` mints more."""
    join_tokens_per_s: float = 0.0
    """The most tokens per second credited to each learner the run's join credential
    admits, over its time in the run (0: their claims count for nothing; the learners the
    coordinator launches are credited as they report)."""
    drain_timeout_s: float = 60.0
    """A draining learner that has not left after this long is stopped."""
    join_timeout_s: float = 300.0
    """A launched learner that has not joined after this long frees its slot under the cap."""
    snapshot_timeout_s: float = 120.0
    """A snapshot whose participants have not all reported after this long is marked failed."""
    snapshot_dir: str | None = None
    """Where snapshots are written (one directory per snapshot): a directory or an fsspec
    URL (``s3://bucket/prefix``); None: data_dir/snapshots."""
    snapshot_every_s: float = 0.0
    """Take a snapshot this often once the run has a model (0: only on demand)."""
    snapshot_keep: int = 0
    """Keep the newest this many complete snapshots, delete older ones and older unfinished
    ones after each completes (0: keep every snapshot)."""
    restore: str | None = None
    """"latest" or a snapshot id: the run restarts from it (learners re-join)."""
    pin_model: bool = False
    """Build the run's model from the run config (task, task options, seed, ``--init``)
    once at start and pin it (``diloco.coordinator.pin``): RegisterModel accepts only its manifest and
    the shards only its initial values, which the coordinator seeds them with itself (no
    learner sends them). Off: the first learner that registers fixes the manifest, and the
    first to reach a shard a fragment's values."""
    model_sha256: str = ""
    """Pin only the manifest, by the hex SHA-256 of its JSON: for a coordinator that cannot
    build the task (its code is only in the learner image). The first manifest with this
    digest becomes the run's; initial values stay the first learner's."""
    host: str = "127.0.0.1"
    """Address the coordinator's gRPC server binds."""
    port: int = 0
    """Port of the coordinator's gRPC server (0: any free port, written to the port file)."""
    health_port: int | None = None
    """Also answer grpc.health.v1 in plaintext on this port (probes that cannot do mutual
    TLS); None: only on the main port."""
    status_port: int | None = None
    """Serve the status page (``diloco.coordinator.status``: members, shards, snapshots, loss
    curves, recent events) over HTTP on this port (0: any free one; the URL is written to
    data_dir/status-url); None: no page."""
    status_host: str = "127.0.0.1"
    """Where the status page listens. On a loopback address anyone on the host may read
    it (it is read-only); on any other it requires the admin token, over HTTPS with the
    run's certificate where the process speaks TLS."""
    reflection: bool = False
    """Serve gRPC reflection (off: it lists every method to anyone who connects)."""
    advertise_address: str = ""
    """Address learners are told to reach the coordinator at; empty: host:port."""
    release: str = "diloco"
    """Owner label of launched pods (the Helm release name)."""
    launcher: str = "local"
    """How AddLearners starts learners: local (processes on this host) or kubernetes (pods
    from a template)."""
    local: LocalLauncherConfig = field(default_factory=LocalLauncherConfig)
    kubernetes: KubernetesLauncherConfig = field(default_factory=KubernetesLauncherConfig)
    shutdown_grace_s: float = 5.0

    @property
    def isolation_hold_s(self) -> float:
        """``isolation_hold_leases`` in seconds."""
        return self.isolation_hold_leases * self.lease_s

    def __post_init__(self) -> None:
        for name in ("lease_s", "drain_timeout_s", "join_timeout_s", "snapshot_timeout_s", "shutdown_grace_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.credential_lifetime_s) and self.credential_lifetime_s >= 2 * self.lease_s):
            raise InvalidArgument(f"credential lifetime must be at least two leases ({2 * self.lease_s:g} s: a learner "
                                  f"renews it with its heartbeats), got {self.credential_lifetime_s}")
        if not (math.isfinite(self.isolation_hold_leases) and (self.isolation_hold_leases == 0
                                                                or self.isolation_hold_leases >= 1)):
            raise InvalidArgument(f"isolation hold must be 0 leases (off) or at least 1 (a shorter one holds no "
                                  f"failure), got {self.isolation_hold_leases}")
        if not (math.isfinite(self.idle_timeout_s) and self.idle_timeout_s >= 0):
            raise InvalidArgument(f"idle timeout must be a finite number of seconds >= 0, got {self.idle_timeout_s}")
        if not (math.isfinite(self.snapshot_every_s) and self.snapshot_every_s >= 0):
            raise InvalidArgument(f"snapshot every must be a finite number of seconds >= 0, got {self.snapshot_every_s}")
        if self.snapshot_keep < 0:
            raise InvalidArgument(f"snapshot keep must be >= 0, got {self.snapshot_keep}")
        if not 1 <= self.max_learners <= MAX_LEARNERS:
            raise InvalidArgument(f"max learners must be in [1, {MAX_LEARNERS}], got {self.max_learners}")
        if not 1 <= self.join_learners <= auth.MAX_JOIN_LIMIT:
            raise InvalidArgument(f"join learners must be in [1, {auth.MAX_JOIN_LIMIT}], got {self.join_learners}")
        if not (math.isfinite(self.join_tokens_per_s) and self.join_tokens_per_s >= 0):
            raise InvalidArgument(f"join tokens per second must be a finite number >= 0, got {self.join_tokens_per_s}")
        if len(self.shards) > MAX_SHARDS:
            raise InvalidArgument(f"at most {MAX_SHARDS} shards, got {len(self.shards)}")
        if not self.pools:
            raise InvalidArgument("at least one pool is needed")
        if len(set(self.pools)) != len(self.pools):
            raise InvalidArgument(f"pools must be unique, got {list(self.pools)}")
        for pool in self.pools:
            check_dns_label("pool", pool)
        check_dns_label("release", self.release, _MAX_RELEASE_CHARS)
        if self.launcher not in LAUNCHERS:
            raise InvalidArgument(f"launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        for address in self.shards:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit():
                raise InvalidArgument(f"shard address must be HOST:PORT, got {address!r}")
        if self.restore is not None and self.restore != "latest" and not self.restore.isdigit():
            raise InvalidArgument(f"restore must be 'latest' or a snapshot id, got {self.restore!r}")
        if self.model_sha256:
            from diloco.coordinator.pin import check_sha256

            check_sha256(self.model_sha256)
            if self.pin_model:
                raise InvalidArgument("pin the model either by building it (pin_model) or by its manifest's SHA-256, not both")
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        if self.status_port is not None and not 0 <= self.status_port < 65536:
            raise InvalidArgument(f"status port must be in [0, 65535], got {self.status_port}")

    @property
    def default_pool(self) -> str:
        return self.pools[0]

    @property
    def snapshots_path(self) -> str:
        return self.snapshot_dir if self.snapshot_dir is not None else str(self.data_dir / "snapshots")
