"""Process wiring of the coordinator: state from its data directory, gRPC with health
and reflection, the launcher, Marker calls to the shards, clean shutdown on SIGTERM.

Files in the data directory: ``coordinator-state.json`` (members, snapshots, counters;
written atomically on every change), ``join-token`` (what launched learners present to
Join), ``learners/<launch id>.log`` (local learners' output) and, unless configured
elsewhere, ``snapshots/``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from diloco.coordinator import convert
from diloco.clients.coordinator import error_from_rpc
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.launcher import Launcher, LocalProcessLauncher
from diloco.coordinator.runtime import CoordinatorRuntime, RunInfo
from diloco.coordinator.service import CoordinatorServicer
from diloco.coordinator.status import StatusPage
from diloco import auth, rpc
from diloco.clock import VectorClock
from diloco.config import RunConfig
from diloco.errors import FailedPrecondition
from diloco.convert import initialize_requests
from diloco.files import atomic_write, private_dir
from diloco.coordinator.pin import PIN_FILE, ModelPin, build_pin
from diloco.v1 import coordinator_pb2_grpc, syncer_pb2, syncer_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = "diloco.v1.Coordinator"
JOIN_TOKEN_FILE = "join-token"
"""In the data dir: the run's join credential (``RUN_CREDENTIAL``), for learners that join
by themselves (own-loop scripts, static learners): ``join_learners`` at once, credited at
most ``join_tokens_per_s`` each."""
RUN_CREDENTIAL = "run"
LAUNCH_CREDENTIAL_PREFIX = "launch-"
"""Names of the credentials the coordinator mints itself (``diloco admin join-credential``
refuses them)."""
_MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# (server, address learners should use) -> the launcher, or None for --launcher none.
LauncherFactory = Callable[["CoordinatorServer", str], Launcher | None]


def default_launcher(server: CoordinatorServer, address: str) -> Launcher | None:
    cfg = server.cfg
    if cfg.launcher == "none":
        return None
    if cfg.launcher == "local":
        return LocalProcessLauncher(
            cfg.local, address, server.launch_credential, cfg.data_dir / "learners", server.runtime.launch_ended
        )
    from diloco.coordinator.kubernetes import KubernetesLauncher

    return KubernetesLauncher(cfg.kubernetes, cfg.release, address, cfg.max_learners, on_exit=server.runtime.launch_ended)


def write_secret_file(path: Path, value: str) -> None:
    """Owner-only, written whole: learners may read it the moment it appears."""
    atomic_write(path, value + "\n", mode=0o600)


def pinned_model(run: RunConfig, data_dir: Path) -> ModelPin:
    """The pin kept in the data directory for this run config (``diloco local`` writes it
    from the model it builds anyway), else the run's model built now and kept there. Slow
    the first time (torch, the task's model): off the event loop."""
    path = data_dir / PIN_FILE
    pin = ModelPin.read(path, run)
    if pin is None:
        started = time.monotonic()
        pin = build_pin(run)
        pin.save(path, run)
        logger.info("built the run's model to pin it in %.1f s (kept in %s)", time.monotonic() - started, path)
    return pin


SEED_TIMEOUT_S = 60.0
"""Deadline of each call that seeds a shard (a Status, a fragment's Initialize)."""
SEED_RETRY_MAX_S = 1.0
"""The longest wait between tries to seed a shard that is not up yet: learners that find
it empty wait for the seed."""


class ShardCalls:
    """The coordinator's calls to its shards, made as the coordinator (credential ``C``)
    over one channel per shard."""

    def __init__(self, secret: str) -> None:
        self._secret = secret
        self._channels: dict[str, grpc.aio.Channel] = {}

    def stub(self, address: str) -> syncer_pb2_grpc.SyncerStub:
        channel = self._channels.get(address)
        if channel is None:
            options = rpc.channel_options(_MAX_MESSAGE_BYTES, "diloco.v1.Syncer")
            channel = self._channels[address] = rpc.channel(address, options)
        return syncer_pb2_grpc.SyncerStub(channel)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (
            (auth.LEARNER_METADATA, auth.COORDINATOR_ID),
            (auth.CREDENTIAL_METADATA, auth.sign(self._secret, auth.COORDINATOR_ID)),
        )

    async def status(self, address: str, timeout_s: float) -> syncer_pb2.StatusReply:
        return await self.stub(address).Status(syncer_pb2.StatusRequest(), metadata=self.metadata, timeout=timeout_s)

    def bootstrap(self, address: str, timeout_s: float):
        """A shard's Bootstrap stream (every fragment it owns)."""
        return self.stub(address).Bootstrap(syncer_pb2.BootstrapRequest(), metadata=self.metadata, timeout=timeout_s)

    async def initialize(self, address: str, fragment: int, manifest_json: str, plan_hash: str, encoded,
                         timeout_s: float) -> bool:
        """Offer a fragment's initial values as the coordinator; True if the shard took them."""
        requests = await asyncio.to_thread(initialize_requests, auth.COORDINATOR_ID, fragment, manifest_json, plan_hash,
                                           encoded)
        reply = await self.stub(address).Initialize(iter(requests), metadata=self.metadata, timeout=timeout_s)
        return reply.initialized

    async def accept_initial_values(self, address: str, reason: str, timeout_s: float) -> syncer_pb2.AcceptInitialValuesReply:
        return await self.stub(address).AcceptInitialValues(
            syncer_pb2.AcceptInitialValuesRequest(reason=reason), metadata=self.metadata, timeout=timeout_s)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()


class CoordinatorServer:
    def __init__(
        self,
        run: RunConfig,
        cfg: CoordinatorConfig,
        secret: str,
        admin_token: str,
        launcher_factory: LauncherFactory = default_launcher,
        clock: Callable[[], float] = time.time,
        pin: ModelPin | None = None,
    ) -> None:
        """``pin``: the run's model, already built (``run_coordinator`` builds it in a worker
        thread); with ``cfg.pin_model`` and none given, it is built here."""
        self.cfg = cfg
        self._secret = secret
        private_dir(cfg.data_dir)
        if cfg.pin_model and pin is None:
            pin = pinned_model(run, cfg.data_dir)
        info = RunInfo(run, pin=pin, manifest_sha256=cfg.model_sha256.lower())
        self.runtime = CoordinatorRuntime(cfg, info, self._send_marker, clock, secret=secret)
        if pin is not None:
            logger.info("the run's model is pinned: %d tensors, manifest sha256 %s, plan %s, initial values of %d "
                        "fragments", len(info.manifest.entries), pin.manifest_sha256[:16], info.plan_hash[:12],
                        len(pin.initial_values))
        elif cfg.model_sha256:
            logger.info("the run's model manifest is pinned: sha256 %s", cfg.model_sha256.lower()[:16])
        self.server = rpc.server(
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ]
        )
        self.shard_calls = ShardCalls(secret)
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
            CoordinatorServicer(self.runtime, secret, admin_token, self.shard_calls), self.server
        )
        self.health = rpc.add_standard_services(self.server, [SERVICE_NAME], cfg.reflection)
        self._launcher_factory = launcher_factory
        self._admin_token = admin_token
        self._probes: grpc.aio.Server | None = None
        self.status_page: StatusPage | None = None
        self.port = 0
        self._stopped = False
        self._seeding: asyncio.Task | None = None
        self.seeded: dict[int, list[int]] = {}
        """Shard -> the fragments it took from this coordinator's seed (empty: it had them all)."""

    def launch_credential(self, launch_id: str) -> str:
        """The join credential of the learner of one launch: it admits that learner alone,
        and its claims are credited as made (the coordinator started it, with the run's code)."""
        name = f"{LAUNCH_CREDENTIAL_PREFIX}{launch_id.lower()}"
        if not auth.JOIN_NAME.match(name):
            name = f"{LAUNCH_CREDENTIAL_PREFIX}{hashlib.sha256(launch_id.encode()).hexdigest()[:16]}"
        return auth.join_credential(self._secret, name, 1)

    @property
    def address(self) -> str:
        return f"{self.cfg.host}:{self.port}"

    async def start(self) -> int:
        """Listen and serve. A start that fails (a port taken) lets go of what it opened."""
        try:
            if self.cfg.status_port is not None:  # first: a port taken fails the start before anything runs
                self.status_page = StatusPage(self.runtime, self.shard_calls, self.cfg.status_host, self.cfg.status_port,
                                              self._admin_token, self.cfg.data_dir)
            self.port = rpc.bind(self.server, f"{self.cfg.host}:{self.cfg.port}")
            write_secret_file(self.cfg.data_dir / JOIN_TOKEN_FILE, auth.join_credential(
                self._secret, RUN_CREDENTIAL, self.cfg.join_learners, self.cfg.join_tokens_per_s))
            self.runtime.launcher = self._launcher_factory(self, self.cfg.advertise_address or self.address)
            await self.server.start()
            if self.cfg.health_port is not None:
                self._probes, _ = await rpc.health_server(self.health, f"{self.cfg.host}:{self.cfg.health_port}")
        except BaseException:
            self._stopped = True
            if self.status_page is not None:
                self.status_page.close()
            await self.server.stop(None)
            # Dropped now: a grpc.aio server that lives on to the interpreter's exit (its
            # servicers refer back here, a cycle the collector cannot see through gRPC's
            # objects) keeps gRPC's poller thread running through the teardown, which then
            # prints a stray "Error in sys.excepthook" after the command's one line.
            self.server = None
            raise
        await rpc.mark_serving(self.health, [SERVICE_NAME])
        if self.status_page is not None:
            self.status_page.start()
        self.runtime.start()
        if self.runtime.run.seeds_shards and self.cfg.shards:
            self._seeding = asyncio.get_running_loop().create_task(self._seed_shards())
        logger.info("coordinator listening on %s (%d shards)", self.address, len(self.cfg.shards))
        return self.port

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        await rpc.mark_serving(self.health, [SERVICE_NAME], serving=False)
        if self._seeding is not None:
            self._seeding.cancel()
        if self.status_page is not None:
            await asyncio.to_thread(self.status_page.stop)  # its requests wait on this loop
        await self.runtime.close()
        await self.server.stop(self.cfg.shutdown_grace_s)
        if self._probes is not None:
            await self._probes.stop(0)
        await self.shard_calls.close()

    async def _seed_shards(self) -> None:
        """Every shard takes the pinned initial values of the fragments it owns and lacks
        from here, as soon as it serves, so that no learner sends them over its own link
        (and none downloads them: its seed model has them bit for bit). A shard that is not
        up yet is tried again until it is. One that recovers its fragments from the
        learners' anchors, or refuses the seed, is left to the learners (logged); a
        fragment that already has values is not touched (Initialize takes none then)."""
        run = self.runtime.run
        pending = dict(enumerate(self.cfg.shards))
        backoff = 0.1
        while pending:
            for m, address in list(pending.items()):
                try:
                    self.seeded[m] = await self._seed(m, address, run)
                except grpc.aio.AioRpcError as error:
                    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        continue
                    logger.warning("shard %d refused the pinned initial values (%s: %s): its learners offer theirs",
                                   m, error.code().name, error.details())
                except FailedPrecondition as error:
                    logger.warning("shard %d not seeded with the pinned initial values: %s", m, error)
                del pending[m]
            if pending:
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, SEED_RETRY_MAX_S)

    async def _seed(self, m: int, address: str, run: RunInfo) -> list[int]:
        status = await self.shard_calls.status(address, SEED_TIMEOUT_S)
        if status.shard_id != m:
            raise FailedPrecondition(f"{address} is shard {status.shard_id}, not shard {m}: the shard list is wrong")
        if status.anchors_only:
            logger.info("shard %d recovers its fragments from the learners' anchors: not seeded", m)
            return []
        have = {f.fragment for f in status.fragments}
        taken = []
        for fragment in run.plan.owned_by(m, len(self.cfg.shards)):
            if fragment.id in have:
                continue
            encoded = await asyncio.to_thread(run.pin.encoded, run.plan, fragment.id)
            if await self.shard_calls.initialize(address, fragment.id, run.manifest_json, run.plan_hash, encoded,
                                                 SEED_TIMEOUT_S):
                taken.append(fragment.id)
        if taken:
            logger.info("shard %d seeded with the pinned initial values of fragments %s", m, taken)
        return taken

    async def _send_marker(
        self, name: str, address: str, snapshot_id: int, directory: str, learners: list[str], clock: VectorClock
    ) -> str:
        """Send the marker; the process that recorded it (its incarnation) comes back."""
        request = syncer_pb2.MarkerRequest(
            snapshot_id=snapshot_id, directory=directory, learners=learners, clock=convert.clock_to_proto(clock)
        )
        try:
            reply = await self.shard_calls.stub(address).Marker(
                request, metadata=self.shard_calls.metadata, timeout=self.cfg.snapshot_timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc(error, f"marker to {name}") from None
        self.runtime.received(convert.clock_from_proto(reply.clock))
        logger.info("snapshot %d: %s recorded its state", snapshot_id, name)
        return reply.incarnation


async def run_coordinator(
    run: RunConfig, cfg: CoordinatorConfig, secret: str, admin_token: str, port_file: Path | None = None
) -> int:
    """Serve until SIGTERM/SIGINT; then stop launched children, save the state, exit 0."""
    pin = None
    if cfg.pin_model:
        private_dir(cfg.data_dir)
        pin = await asyncio.to_thread(pinned_model, run, cfg.data_dir)
    coordinator = CoordinatorServer(run, cfg, secret, admin_token, pin=pin)
    await coordinator.start()
    await rpc.announce_and_wait_for_signal("coordinator", coordinator.address, port_file)
    logger.info("coordinator shutting down")
    await coordinator.stop()
    return 0
