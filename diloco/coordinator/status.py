"""The coordinator's status page: the run at a glance for a person, over HTTP.

``GET /`` is one self-contained page (``status.html``: no script or style from anywhere
else) that fetches ``GET /status.json`` every two seconds and draws it: members, shards
and their fragments, snapshots, each learner's training-loss curve and the recent
events. The server is asyncio's, on an event loop of its own thread: a connection is a
coroutine, not a thread, and every request has a whole deadline (``REQUEST_DEADLINE_S``)
and a place among at most ``MAX_CONNECTIONS``, so clients that trickle their requests in
byte by byte hold neither threads nor the page. The document is gathered on the
coordinator's event loop (``status_document``), where the runtime lives, so it reads one
consistent state; requests that arrive while a gathering is under way share it.

It is read-only. On a loopback address it answers anyone on the host, as ``diloco local``
uses it; on any other address every request needs the admin token, as ``Authorization:
Bearer TOKEN`` or ``?token=TOKEN`` (the page passes its own on to ``status.json``), and
where the process speaks TLS (``diloco.rpc.use_tls``) the page is HTTPS with the run's
certificate, so the token never crosses the network in clear (a client trusts the run's
CA; the certificate names ``diloco`` and the hosts it was made for). Plain HTTP off
loopback only in a run that is plaintext anyway (``--insecure``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import resource
import socket
import ssl
import threading
from email.utils import formatdate
from http import HTTPStatus
from importlib import resources
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from diloco.coordinator.core.membership import LIVE, FailedLaunch
from diloco import rpc
from diloco.errors import Unavailable
from diloco.files import atomic_write

logger = logging.getLogger(__name__)

STATUS_URL_FILE = "status-url"
"""In the coordinator's data directory: the page's URL, once it serves."""
GATHER_TIMEOUT_S = 5.0
"""A request whose document is not gathered in this long (shards not answering) fails with 503."""
SHARD_TIMEOUT_S = 2.0
REQUEST_DEADLINE_S = 5.0
"""A connection's whole request (the TLS handshake, the request line and headers) must
arrive within this long, however slowly it trickles in, and its answer must be taken
within as long again; else the connection is closed."""
MAX_CONNECTIONS = 4096
"""Connections the page holds at once (fewer where the process may open few files: a
quarter of its RLIMIT_NOFILE, so the page never starves gRPC of descriptors). One more
closes the connection that has waited longest for its request to arrive (or, if every
one is being answered, the new one): slow clients can hold neither the page's memory and
descriptors nor its door."""
MAX_REQUEST_BYTES = 16384
"""The request line and headers together; a longer request is answered 431."""
_BACKLOG = 1024


async def status_document(runtime, shard_calls) -> dict:
    """What the page shows, as JSON: gathered on the event loop."""
    now = runtime.now()
    learners = runtime.list_learners(include_gone=True)
    statuses = await asyncio.gather(*(shard_calls.status(address, SHARD_TIMEOUT_S) for address in runtime.cfg.shards),
                                    return_exceptions=True)
    shards = []
    for m, (address, status) in enumerate(zip(runtime.cfg.shards, statuses)):
        entry = {"id": m, "address": address, "incarnation": runtime.incarnations.get(f"S{m}", ""),
                 "restarts": runtime.restarts(f"S{m}")}
        if isinstance(status, BaseException):
            entry["error"] = getattr(status, "details", lambda: str(status))() or type(status).__name__
        else:
            entry |= {"model_state": status.model_state, "rounds": status.rounds_closed, "pushes": status.pushes_received,
                      "bytes_in": status.bytes_received, "bytes_out": status.bytes_sent,
                      "fragments": [{"fragment": f.fragment, "version": f.version, "round": f.round_state,
                                     "open_pushes": f.open_round_pushes, "participants": f.last_round_participants,
                                     "last_round_age_s": f.last_round_age_s if f.HasField("last_round_age_s") else None}
                                    for f in status.fragments]}
        shards.append(entry)
    return {
        "now": now,
        "run": {"task": runtime.run.run.task, "fragments": runtime.run.run.fragments, "shards": len(runtime.cfg.shards),
                "tokens": runtime.membership.tokens_total, "restored_from": runtime.restored_from},
        "members": [{"id": l.id, "state": l.state, "pool": l.pool, "tokens": l.tokens, "tokens_per_s": l.tokens_per_s,
                     "inner_steps": l.inner_steps, "staleness": l.version_lag, "train_loss": l.train_loss,
                     "eval_loss": l.eval_loss, "loss_unit": l.loss_unit,
                     "heartbeat_age_s": max(now - l.heartbeat_s, 0.0) if l.state in LIVE else None,
                     "reason": l.reason} for l in learners],
        "launches": [{"launch_id": x.launch_id, "pool": x.pool, "failed": isinstance(x, FailedLaunch),
                      "detail": x.detail if isinstance(x, FailedLaunch) else ""} for x in runtime.list_launches()],
        "shards": shards,
        "snapshots": [{"id": s.id, "state": s.state, "age_s": max(now - s.started_s, 0.0), "detail": s.detail,
                       "reported": len(s.reports), "participants": len(s.participants) + len(s.dropped)}
                      for s in runtime.list_snapshots()[-10:]],
        "curves": runtime.curves.to_json(),
        "curves_kept": len(runtime.curves.curves),
        "events": runtime.recent.to_json()[:50],
    }


def _server_context(tls: rpc.Tls) -> ssl.SSLContext:
    """A TLS server context with the run's certificate and key, loaded from memory (ssl
    takes only paths: an anonymous in-memory file's), never written to disk."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    fd = os.memfd_create("diloco-status-tls")
    try:
        os.write(fd, tls.cert + b"\n" + tls.key)
        context.load_cert_chain(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)
    return context


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not known to be loopback
        return False


class _BadRequest(Exception):
    def __init__(self, status: HTTPStatus, text: str) -> None:
        super().__init__(text)
        self.status = status


def _parse(head: bytes) -> tuple[str, dict[str, str]]:
    """The target and headers (names in lower case) of a GET request's head."""
    request_line, *lines = head.decode("latin-1").split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise _BadRequest(HTTPStatus.BAD_REQUEST, "not an HTTP/1 request line")
    method, target, _ = parts
    headers = {}
    for line in filter(None, lines):
        name, colon, value = line.partition(":")
        if not colon:
            raise _BadRequest(HTTPStatus.BAD_REQUEST, "a header line without a colon")
        headers[name.strip().lower()] = value.strip()
    if method != "GET":
        raise _BadRequest(HTTPStatus.NOT_IMPLEMENTED, f"the page answers only GET, not {method[:16]!r}")
    return target, headers


class StatusPage:
    """The page's HTTP server, serving until ``stop``."""

    def __init__(self, runtime, shard_calls, host: str, port: int, admin_token: str, data_dir: Path) -> None:
        self._runtime, self._shard_calls = runtime, shard_calls
        self._token = admin_token
        self._open = _loopback(host)
        self._data_dir = data_dir
        self._html = resources.files(__package__).joinpath("status.html").read_bytes()
        self._loop: asyncio.AbstractEventLoop | None = None  # the coordinator's, where documents are gathered
        try:
            self._socket = socket.create_server(
                (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=_BACKLOG)
        except OSError as error:
            raise Unavailable(f"the status page cannot listen on {host}:{port}: {error.strerror or error}") from None
        self._https = not self._open and rpc.tls_enabled()
        self._tls = _server_context(rpc.current_tls()) if self._https else None
        self._page_loop = asyncio.new_event_loop()
        self._stopping = asyncio.Event()
        self._connections: dict[asyncio.Task, bool] = {}  # in the order accepted: still reading its request?
        self._gathering: asyncio.Task | None = None
        files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._cap = MAX_CONNECTIONS if files == resource.RLIM_INFINITY else max(min(MAX_CONNECTIONS, files // 4), 1)
        self._thread = threading.Thread(target=lambda: self._page_loop.run_until_complete(self._serve()),
                                        name="diloco-status-page", daemon=True)
        host, port = self._socket.getsockname()[:2]
        self.url = f"{'https' if self._https else 'http'}://{f'[{host}]' if ':' in host else host}:{port}/"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        atomic_write(self._data_dir / STATUS_URL_FILE, self.url + "\n")
        logger.info("status page on %s%s", self.url, "" if self._open else " (admin token required)")

    def stop(self) -> None:
        """Stop serving: close the listener and every connection (blocking: call off the coordinator's loop)."""
        self._page_loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join()
        self._page_loop.close()

    def close(self) -> None:
        """Let go of the port of a page that never started."""
        self._socket.close()
        self._page_loop.close()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._connection, sock=self._socket, backlog=_BACKLOG,
                                            limit=MAX_REQUEST_BYTES)
        try:
            await self._stopping.wait()
        finally:
            server.close()
            pending = [*self._connections, *([self._gathering] if self._gathering else [])]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await server.wait_closed()

    def _admit(self, task: asyncio.Task) -> bool:
        """Make room for one more connection: close the oldest still reading its request."""
        if len(self._connections) >= self._cap:
            oldest = next((t for t, reading in self._connections.items() if reading), None)
            if oldest is None:
                return False
            del self._connections[oldest]
            oldest.cancel()
        self._connections[task] = True
        return True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        try:
            if self._admit(task):
                await self._exchange(task, reader, writer)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, ssl.SSLError) as error:
            logger.debug("status page: a connection closed unanswered (%s)", type(error).__name__)
        except asyncio.CancelledError:  # closed to make room, or the page stopping: the task's end
            pass  # (not re-raised: 3.11's asyncio logs a connection task that ends cancelled as an error)
        finally:
            self._connections.pop(task, None)
            writer.transport.abort()  # a connection cut short; after a clean close, nothing

    async def _exchange(self, task: asyncio.Task, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request and its answer, each within ``REQUEST_DEADLINE_S``."""
        try:
            async with asyncio.timeout(REQUEST_DEADLINE_S):
                if self._tls is not None:
                    await writer.start_tls(self._tls, ssl_handshake_timeout=REQUEST_DEADLINE_S)
                try:
                    target, headers = _parse(await reader.readuntil(b"\r\n\r\n"))
                except asyncio.LimitOverrunError:
                    raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                                      f"the request's head is over {MAX_REQUEST_BYTES} bytes") from None
            self._connections[task] = False  # read: no longer the one to make room
            status, body, kind = await self._answer(target, headers)
        except _BadRequest as error:
            status, body, kind = error.status, f"{error}\n".encode(), "text/plain"
        async with asyncio.timeout(REQUEST_DEADLINE_S):
            writer.write(self._head(status, kind, len(body)) + body)
            await writer.drain()
            writer.close()
            await writer.wait_closed()

    async def _answer(self, target: str, headers: dict[str, str]) -> tuple[HTTPStatus, bytes, str]:
        url = urlsplit(target)
        if not self._allowed(headers, parse_qs(url.query)):
            return (HTTPStatus.UNAUTHORIZED, b"the status page needs the admin token "
                    b"(Authorization: Bearer TOKEN, or ?token=TOKEN)\n", "text/plain")
        if url.path == "/":
            return HTTPStatus.OK, self._html, "text/html; charset=utf-8"
        if url.path == "/status.json":
            try:
                return HTTPStatus.OK, await self._document(), "application/json"
            except Exception as error:  # the loop stopping, shards too slow: the page retries
                text = str(error) or type(error).__name__
                logger.warning("status page: %s", text)
                return HTTPStatus.SERVICE_UNAVAILABLE, f"{text}\n".encode(), "text/plain"
        return HTTPStatus.NOT_FOUND, b"not found: the page is / and its data /status.json\n", "text/plain"

    @staticmethod
    def _head(status: HTTPStatus, kind: str, length: int) -> bytes:
        return (f"HTTP/1.1 {status.value} {status.phrase}\r\n"
                f"Server: diloco-status\r\nDate: {formatdate(usegmt=True)}\r\n"
                f"Content-Type: {kind}\r\nContent-Length: {length}\r\nCache-Control: no-store\r\n"
                "Content-Security-Policy: default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'\r\n"
                "Connection: close\r\n\r\n").encode("latin-1")

    def _allowed(self, headers: dict[str, str], query: dict[str, list[str]]) -> bool:
        if self._open:
            return True
        given = headers.get("authorization", "").removeprefix("Bearer ").strip() or (query.get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), self._token.encode())

    async def _document(self) -> bytes:
        """The document as JSON; one gathering at a time, shared by the requests that wait on it."""
        if self._gathering is None or self._gathering.done():
            self._gathering = asyncio.create_task(self._gather())
            self._gathering.add_done_callback(lambda t: t.cancelled() or t.exception())  # each waiter logs its own
        async with asyncio.timeout(GATHER_TIMEOUT_S):
            return await asyncio.shield(self._gathering)

    async def _gather(self) -> bytes:
        future = asyncio.run_coroutine_threadsafe(status_document(self._runtime, self._shard_calls), self._loop)
        try:
            async with asyncio.timeout(GATHER_TIMEOUT_S):
                document = await asyncio.wrap_future(future)
        finally:
            future.cancel()
        return json.dumps(document, allow_nan=False).encode()
