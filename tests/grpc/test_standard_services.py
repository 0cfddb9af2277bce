"""Every server gets grpc.health.v1, and reflection only when asked; domain errors map to
status codes."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from diloco import errors, rpc


async def _serve_standard(with_reflection=True):
    server = grpc.aio.server()
    servicer = rpc.add_standard_services(server, ["diloco.v1.Syncer"], with_reflection)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await rpc.mark_serving(servicer, ["diloco.v1.Syncer"])
    return server, port


def test_health_and_reflection_over_a_real_server():
    async def scenario():
        server, port = await _serve_standard()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                reply = await health.Check(health_pb2.HealthCheckRequest(service="diloco.v1.Syncer"), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND

                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                async for response in stub.ServerReflectionInfo(iter([request]), timeout=5):
                    names = {s.name for s in response.list_services_response.service}
                    assert {"diloco.v1.Syncer", "grpc.health.v1.Health"} <= names
                    break
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_reflection_is_off_unless_asked():
    async def scenario():
        server, port = await _serve_standard(with_reflection=False)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.ServerReflectionInfo(iter([request]), timeout=5):
                        pass
                assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop(None)

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "error,code",
    [
        (errors.CodecError("bad checksum"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.Unauthenticated("no credential"), grpc.StatusCode.UNAUTHENTICATED),
        (errors.PermissionDenied("admin only"), grpc.StatusCode.PERMISSION_DENIED),
        (errors.NotFound("unknown learner"), grpc.StatusCode.NOT_FOUND),
        (errors.FailedPrecondition("future version"), grpc.StatusCode.FAILED_PRECONDITION),
        (errors.AlreadyExists("snapshot running"), grpc.StatusCode.ALREADY_EXISTS),
        (errors.ResourceExhausted("too big"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unavailable("draining"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_status_table(error, code):
    assert rpc.status_for(error) == (code, str(error))


def test_unexpected_errors_hide_details():
    code, message = rpc.status_for(KeyError("secret internals"))
    assert code == grpc.StatusCode.INTERNAL
    assert "secret" not in message
