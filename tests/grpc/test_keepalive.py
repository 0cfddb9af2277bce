"""A client that dies behind a network cut leaves no half-open connection on a server:
every server pings its connections (HTTP/2 keepalive, ``diloco.rpc.keepalive_options``)
and closes one whose ping goes unanswered. The cut is a TCP relay on 127.0.0.1 that stops
carrying bytes either way without closing anything, as a dropped link does."""

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diloco import rpc
from tests.grpc.coordinator_fixtures import running_coordinator


class CuttableRelay:
    """127.0.0.1:port relaying to ``target``; ``cut()`` drops every byte from then on, both
    ways, and keeps the sockets open. ``server_closed_at``: when the target closed its end."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.cut_at: float | None = None
        self.server_closed_at: float | None = None
        self.connections = 0

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def cut(self) -> None:
        self.cut_at = time.monotonic()

    async def _pump(self, reader, writer, from_server: bool) -> None:
        while data := await reader.read(65536):
            if self.cut_at is None:
                writer.write(data)
                await writer.drain()
        if from_server:
            self.server_closed_at = time.monotonic()

    async def _relay(self, client_reader, client_writer) -> None:
        self.connections += 1
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pump(client_reader, server_writer, False),
                             self._pump(server_reader, client_writer, True), return_exceptions=True)

    async def close(self) -> None:
        self.server.close()


def test_a_server_closes_a_connection_whose_client_is_gone_behind_a_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(rpc, "KEEPALIVE_TIME_MS", 500)
    monkeypatch.setattr(rpc, "KEEPALIVE_TIMEOUT_MS", 500)

    async def main():
        async with running_coordinator(tmp_path) as server:
            relay = CuttableRelay(server.port)
            port = await relay.start()
            try:
                channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")  # a client with no keepalive of its own
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                relay.cut()
                deadline = time.monotonic() + 10
                while relay.server_closed_at is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert relay.server_closed_at is not None, "the server kept the half-open connection for 10 s"
                # a ping every 0.5 s, unanswered within 0.5 s: closed within about a second of the cut
                assert relay.server_closed_at - relay.cut_at < 3.0, relay.server_closed_at - relay.cut_at
                await channel.close()
            finally:
                await relay.close()

    asyncio.run(main())


def test_every_channel_and_server_pings_with_the_same_interval():
    server = dict(rpc.keepalive_options(server=True))
    client = dict(rpc.channel_options(1 << 20, "diloco.v1.Syncer"))
    assert server["grpc.keepalive_time_ms"] == client["grpc.keepalive_time_ms"] == rpc.KEEPALIVE_TIME_MS
    # A server that took its clients' pings as strikes would close their connections.
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"]
