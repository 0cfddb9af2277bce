"""A real coordinator on 127.0.0.1:0 for the grpc tests, and small helpers around it."""

import asyncio
import contextlib

import grpc

from diloco.clients.coordinator import LearnerSession
from diloco.coordinator.config import CoordinatorConfig
from diloco.coordinator.server import CoordinatorServer, default_launcher
from diloco import auth
from diloco.v1 import coordinator_pb2_grpc
from tests.grpc.conftest import SECRET, TINY

ADMIN = "admin-token"


@contextlib.asynccontextmanager
async def running_coordinator(tmp_path, launcher_factory=default_launcher, clock=None, **cfg):
    cfg.setdefault("launcher", "none")
    cfg.setdefault("data_dir", tmp_path / "coordinator")
    kwargs = {"clock": clock} if clock is not None else {}
    server = CoordinatorServer(TINY, CoordinatorConfig(**cfg), SECRET, ADMIN, launcher_factory, **kwargs)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class _Deadline(grpc.aio.UnaryUnaryClientInterceptor):
    """Every call without a timeout gets one: a test never waits on a server forever."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def intercept_unary_unary(self, continuation, details, request):
        if details.timeout is None:
            details = grpc.aio.ClientCallDetails(details.method, self.timeout_s, details.metadata, details.credentials,
                                                 details.wait_for_ready)
        return await continuation(details, request)


@contextlib.asynccontextmanager
async def admin_stub(address, token=ADMIN, timeout_s=20.0):
    """Admin calls on an async channel: ``await stub.ListLearners(request, metadata=md)``,
    each with a deadline of ``timeout_s`` unless it gives its own."""
    async with grpc.aio.insecure_channel(address, interceptors=[_Deadline(timeout_s)]) as channel:
        yield coordinator_pb2_grpc.CoordinatorStub(channel), ((auth.ADMIN_METADATA, token),)


async def joined(address, pool="", launch_id=""):
    session = LearnerSession(address, timeout_s=10)
    await session.join(auth.join_credential(SECRET, "test", 64), pool=pool, address="test", launch_id=launch_id)
    return session


async def wait_for(predicate, what, timeout_s=20.0):
    """Poll with a deadline (never a bare sleep to let something happen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def reconnect(session: LearnerSession, address: str) -> None:
    """Point a learner's session at a restarted coordinator (a new port)."""
    await session.channel.close()
    session.channel = grpc.aio.insecure_channel(address)
    session.stub = coordinator_pb2_grpc.CoordinatorStub(session.channel)
