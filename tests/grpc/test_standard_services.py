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


def test_a_channel_reaches_a_peer_back_from_an_outage_within_about_a_second():
    """gRPC's reconnect backoff grows to 120 s by default: a channel kept failing calls at
    once for seconds after its peer came back (a coordinator's markers to a restarted
    shard failed for 9 s). Channels here try to reconnect at least once a second."""
    request = health_pb2.HealthCheckRequest(service="diloco.v1.Syncer")

    async def scenario():
        loop = asyncio.get_running_loop()
        server, port = await _serve_standard(with_reflection=False)
        async with rpc.channel(f"127.0.0.1:{port}", rpc.channel_options(1 << 20, "grpc.health.v1.Health")) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(request, timeout=5)
            await server.stop(None)
            down_until = loop.time() + 10  # failing calls all along: the backoff grows
            while loop.time() < down_until:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await health.Check(request, timeout=1)
                assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                await asyncio.sleep(0.2)
            server = grpc.aio.server()
            servicer = rpc.add_standard_services(server, ["diloco.v1.Syncer"], False)
            assert server.add_insecure_port(f"127.0.0.1:{port}") == port
            await server.start()
            await rpc.mark_serving(servicer, ["diloco.v1.Syncer"])
            back = loop.time()
            while True:
                try:
                    reply = await health.Check(request, timeout=1)
                    break
                except grpc.aio.AioRpcError:
                    assert loop.time() - back < 10, "the channel never reconnected"
                    await asyncio.sleep(0.05)
            waited = loop.time() - back
        await server.stop(None)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert waited < 2.5, f"calls failed for {waited:.1f} s after the peer was back"

    asyncio.run(scenario())
