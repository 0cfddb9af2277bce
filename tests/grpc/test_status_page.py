"""The coordinator's status page over real HTTP: its document follows the heartbeats, it
refuses a heartbeat whose loss is not finite, off loopback it needs the admin token, and
slow or many clients hold neither threads nor the page."""

import asyncio
import functools
import http.client
import itertools
import json
import math
import re
import select
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from diloco.coordinator import status
from diloco.coordinator.status import STATUS_URL_FILE
from diloco import rpc
from diloco.errors import InvalidArgument, Unavailable
from tests.grpc.coordinator_fixtures import ADMIN, joined, running_coordinator
from diloco.cli.certs import make_certs



def sync(test):
    """An async test run to its end on a loop of its own."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _get(url: str, headers: dict | None = None) -> tuple[int, str, bytes]:
    """GET off the event loop (the page gathers its document on this loop)."""
    def get():
        request = urllib.request.Request(url, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.headers["Content-Type"], reply.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers["Content-Type"], error.read()
    return await asyncio.to_thread(get)


@sync
async def test_document_follows_heartbeats(tmp_path):
    dead_shard = f"127.0.0.1:{_closed_port()}"
    async with running_coordinator(tmp_path, status_port=0, shards=(dead_shard,)) as server:
        url = (tmp_path / "coordinator" / STATUS_URL_FILE).read_text().strip()
        assert url == server.status_page.url and url.startswith("http://127.0.0.1:")
        a, b = await joined(server.address), await joined(server.address)
        await a.heartbeat(tokens=1000, inner_steps=10, tokens_per_s=500.0, train_loss=5.5, loss_unit="bits/byte")
        await b.heartbeat(tokens=800, inner_steps=8, tokens_per_s=400.0, train_loss=5.7, eval_loss=5.9)
        await a.heartbeat(tokens=2000, inner_steps=20, tokens_per_s=510.0, train_loss=4.25)
        await a.heartbeat(tokens=2000, inner_steps=20, tokens_per_s=510.0, train_loss=4.25)  # nothing new: no point
        status, kind, body = await _get(url + "status.json")
        assert (status, kind) == (200, "application/json")
        doc = json.loads(body)
        members = {m["id"]: m for m in doc["members"]}
        assert members[a.learner_id] | {"heartbeat_age_s": 0} == {
            "id": a.learner_id, "state": "active", "pool": "default", "tokens": 2000, "tokens_per_s": 510.0,
            "inner_steps": 20, "staleness": 0, "train_loss": 4.25, "eval_loss": None, "loss_unit": "bits/byte", "heartbeat_age_s": 0,
            "reason": ""}
        assert members[b.learner_id]["eval_loss"] == 5.9 and members[b.learner_id]["train_loss"] == 5.7
        assert 0 <= members[a.learner_id]["heartbeat_age_s"] < 10
        # The x of each point is the run's tokens (every learner's) when it was reported.
        assert doc["curves"] == {a.learner_id: [[1000, 5.5], [2800, 4.25]], b.learner_id: [[1800, 5.7]]}
        assert doc["curves_kept"] == 2
        assert doc["run"]["tokens"] == 2800 and doc["run"]["shards"] == 1
        (shard,) = doc["shards"]
        assert shard["address"] == dead_shard and shard["error"] and "fragments" not in shard
        texts = [e["text"] for e in doc["events"]]
        assert texts[:2] == [f"{b.learner_id} active: first heartbeat", f"{a.learner_id} active: first heartbeat"]
        assert any(t.startswith(f"{a.learner_id} joined") for t in texts)

        await b.leave("done", tokens=900, inner_steps=9)
        doc = json.loads((await _get(url + "status.json"))[2])
        assert {m["id"]: m["state"] for m in doc["members"]}[b.learner_id] == "left"
        assert doc["events"][0]["text"] == f"{b.learner_id} left: done" and doc["run"]["tokens"] == 2900
        for session in (a, b):
            await session.close()


@sync
async def test_page_and_unknown_paths(tmp_path):
    async with running_coordinator(tmp_path, status_port=0) as server:
        status, kind, body = await _get(server.status_page.url)
        assert status == 200 and kind.startswith("text/html")
        assert b"status.json" in body and b"<script" in body and b"src=" not in body  # self-contained
        status, _, body = await _get(server.status_page.url + "metrics")
        assert status == 404 and b"/status.json" in body


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
@sync
async def test_non_finite_loss_is_refused(tmp_path, loss):
    async with running_coordinator(tmp_path, status_port=0) as server:
        session = await joined(server.address)
        with pytest.raises(InvalidArgument, match="train_loss must be a finite number"):
            await session.heartbeat(tokens=10, train_loss=loss)
        with pytest.raises(InvalidArgument, match="eval_loss must be a finite number"):
            await session.heartbeat(tokens=10, eval_loss=loss)
        with pytest.raises(InvalidArgument, match="tokens_per_s"):
            await session.heartbeat(tokens=10, tokens_per_s=loss)
        with pytest.raises(InvalidArgument, match="loss_unit must be at most 32 printable characters"):
            await session.heartbeat(tokens=10, loss_unit="x" * 33)
        with pytest.raises(InvalidArgument, match="loss_unit must be at most 32 printable characters"):
            await session.heartbeat(tokens=10, loss_unit="bits\x1b[31m")
        await session.heartbeat(tokens=10, train_loss=3.0)  # the learner itself is not harmed
        doc = json.loads((await _get(server.status_page.url + "status.json"))[2])
        assert doc["curves"] == {session.learner_id: [[10, 3.0]]}
        await session.close()


@sync
async def test_off_loopback_needs_the_admin_token(tmp_path):
    # Bound to every interface; the test still talks only to 127.0.0.1.
    async with running_coordinator(tmp_path, status_port=0, status_host="0.0.0.0") as server:
        url = f"http://127.0.0.1:{server.status_page.url.rsplit(':', 1)[1]}"
        for path, headers in (("", {}), ("status.json", {}), ("status.json?token=wrong", {}),
                              ("status.json", {"Authorization": "Bearer wrong"})):
            status, _, body = await _get(url + path, headers)
            assert status == 401 and b"admin token" in body, path
        assert (await _get(url + "status.json", {"Authorization": f"Bearer {ADMIN}"}))[0] == 200
        assert (await _get(url + f"status.json?token={ADMIN}"))[0] == 200
        assert (await _get(url + f"?token={ADMIN}"))[0] == 200


@sync
async def test_off_loopback_in_a_tls_run_the_page_is_https_with_the_run_s_certificate(tmp_path):
    make_certs(tmp_path / "tls", ["127.0.0.1"])
    previous = rpc.use_tls(rpc.Tls.from_dir(tmp_path / "tls"))
    try:
        async with running_coordinator(tmp_path, status_port=0, status_host="0.0.0.0") as server:
            port = server.status_page.url.rsplit(":", 1)[1].rstrip("/")
            assert server.status_page.url.startswith("https://")
            trusting = ssl.create_default_context(cafile=str(tmp_path / "tls" / "ca.crt"))

            def get(url, context=None, token=ADMIN):
                request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
                try:
                    with urllib.request.urlopen(request, timeout=10, context=context) as reply:
                        return reply.status, reply.read()
                except urllib.error.HTTPError as error:
                    return error.code, error.read()

            status, body = await asyncio.to_thread(get, f"https://127.0.0.1:{port}/status.json", trusting)
            assert status == 200 and json.loads(body)["run"]["shards"] == 0
            assert (await asyncio.to_thread(get, f"https://127.0.0.1:{port}/status.json", trusting, "wrong"))[0] == 401
            # Plain HTTP gets no answer, and a client that does not trust the run's CA no page.
            for url, context in ((f"http://127.0.0.1:{port}/status.json", None),
                                 (f"https://127.0.0.1:{port}/status.json", ssl.create_default_context())):
                with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
                    await asyncio.to_thread(get, url, context)
            # The page still serves the run's own clients afterwards.
            assert (await asyncio.to_thread(get, f"https://127.0.0.1:{port}/", trusting))[0] == 200
    finally:
        rpc.use_tls(previous)


@sync
async def test_a_taken_port_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(Unavailable, match=r"the status page cannot listen on 127\.0\.0\.1:\d+: "):
            async with running_coordinator(tmp_path, status_port=taken.getsockname()[1]):
                pass


@sync
async def test_no_page_unless_asked(tmp_path):
    async with running_coordinator(tmp_path) as server:
        assert server.status_page is None and not (tmp_path / "coordinator" / STATUS_URL_FILE).exists()


def _port(server) -> int:
    return int(server.status_page.url.rsplit(":", 1)[1].rstrip("/"))


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Send ``trickle`` a byte at a time every 0.1 s until the server closes the connection:
    how long that took (None: still open after ``seconds``)."""
    start = time.monotonic()
    sock.setblocking(False)
    for i in itertools.count():
        if time.monotonic() - start > seconds:
            return None
        if select.select([sock], [], [], 0.1)[0]:
            try:
                if sock.recv(1024) == b"":
                    return time.monotonic() - start
            except ConnectionError:
                return time.monotonic() - start
        if i < len(trickle):
            try:
                sock.send(trickle[i:i + 1])
            except ConnectionError:
                return time.monotonic() - start


@sync
async def test_a_request_trickled_in_past_the_deadline_is_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "REQUEST_DEADLINE_S", 1.0)
    async with running_coordinator(tmp_path, status_port=0) as server:
        def trickle() -> float | None:
            # A byte every 0.1 s: never idle for long, and the head never ends.
            with socket.create_connection(("127.0.0.1", _port(server)), timeout=10) as slow:
                return _closed_within(slow, 10, b"GET /status.json HTTP/1.1\r\nX-Slow: " + b"a" * 200)

        took = await asyncio.to_thread(trickle)
        assert took is not None and 0.9 < took < 3, took
        assert (await _get(server.status_page.url + "status.json"))[0] == 200


def _threads() -> int:
    return int(re.search(r"^Threads:\s+(\d+)", Path("/proc/self/status").read_text(), re.MULTILINE)[1])


@sync
async def test_many_slow_connections_hold_no_threads_and_the_oldest_make_room(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "MAX_CONNECTIONS", 50)
    async with running_coordinator(tmp_path, status_port=0) as server:
        assert (await _get(server.status_page.url + "status.json"))[0] == 200
        threads = _threads()
        slow = []
        try:
            for _ in range(200):
                sock = socket.create_connection(("127.0.0.1", _port(server)), timeout=10)
                sock.sendall(b"GET /status.json HTTP/1.1\r\nHost: x\r\n")  # and never the end of the head
                slow.append(sock)

            def closed() -> list[int]:
                return [i for i, sock in enumerate(slow) if select.select([sock], [], [], 0)[0]]

            for _ in range(100):  # the first 150 make room for the last 50
                if len(closed()) >= 150:
                    break
                await asyncio.sleep(0.1)
            assert closed() == list(range(150))
            assert _threads() <= threads + 2, (threads, _threads())
            start = time.monotonic()
            status_code, _, body = await _get(server.status_page.url + "status.json")
            assert status_code == 200 and json.loads(body)["run"]["shards"] == 0
            assert time.monotonic() - start < 2
            await asyncio.sleep(0.2)
            assert closed() == list(range(151))  # the answered request made room too
            assert all(sock.recv(1) == b"" for sock in slow[:151])
        finally:
            for sock in slow:
                sock.close()


@sync
async def test_bad_requests_get_a_clear_status(tmp_path):
    async with running_coordinator(tmp_path, status_port=0) as server:
        def send(request: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", _port(server)), timeout=10) as sock:
                sock.sendall(request)
                return b"".join(iter(lambda: sock.recv(65536), b""))

        for request, expected in ((b"POST /status.json HTTP/1.1\r\n\r\n", b"HTTP/1.1 501 "),
                                  (b"hello\r\n\r\n", b"HTTP/1.1 400 "),
                                  (b"GET / HTTP/1.1\r\nno colon\r\n\r\n", b"HTTP/1.1 400 "),
                                  (b"GET / HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", b"HTTP/1.1 431 ")):
            reply = await asyncio.to_thread(send, request)
            assert reply.startswith(expected), (request[:40], reply[:200])
        reply = await asyncio.to_thread(send, b"GET /status.json HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nCache-Control: no-store\r\n" in head
        assert f"\r\nContent-Length: {len(body)}\r\n".encode() in head and json.loads(body)["run"]["shards"] == 0


@sync
async def test_a_tls_handshake_that_never_ends_is_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "REQUEST_DEADLINE_S", 1.0)
    make_certs(tmp_path / "tls", ["127.0.0.1"])
    previous = rpc.use_tls(rpc.Tls.from_dir(tmp_path / "tls"))
    try:
        async with running_coordinator(tmp_path, status_port=0, status_host="0.0.0.0") as server:
            def silent() -> float | None:
                with socket.create_connection(("127.0.0.1", _port(server)), timeout=10) as sock:
                    return _closed_within(sock, 10, b"\x16\x03\x01")  # a TLS record's start, and no more

            took = await asyncio.to_thread(silent)
            assert took is not None and 0.9 < took < 3, took
    finally:
        rpc.use_tls(previous)
