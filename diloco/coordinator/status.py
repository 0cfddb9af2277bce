"""The coordinator's status page: the run at a glance for a person, over HTTP.

``GET /`` is one self-contained page (``status.html``: no script or style from anywhere
else) that fetches ``GET /status.json`` every two seconds and draws it: members, shards
and their fragments, snapshots, each learner's training-loss curve and the recent
events. The server is the standard library's, on a thread of its own; each request's
document is gathered on the coordinator's event loop (``status_document``), where the
runtime lives, so it reads one consistent state.

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
import ssl
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
REQUEST_TIMEOUT_S = 10.0
"""A connection that sends nothing (or no complete request) for this long is closed: an
idle or slow client cannot hold a thread."""


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A connection that failed (a plain HTTP client at the HTTPS page, a reset): one
        debug line, not the standard library's traceback on stderr."""
        logger.debug("status page: a connection from %s failed", client_address[0], exc_info=True)


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


class StatusPage:
    """The page's HTTP server, serving until ``stop``."""

    def __init__(self, runtime, shard_calls, host: str, port: int, admin_token: str, data_dir: Path) -> None:
        self._runtime, self._shard_calls = runtime, shard_calls
        self._token = admin_token
        self._open = _loopback(host)
        self._data_dir = data_dir
        self._html = resources.files(__package__).joinpath("status.html").read_bytes()
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            self._server = _Server((host, port), self._handler())
        except OSError as error:
            raise Unavailable(f"the status page cannot listen on {host}:{port}: {error.strerror or error}") from None
        self._https = not self._open and rpc.tls_enabled()
        if self._https:
            # The handshake on each connection's thread, not in the accepting one.
            self._server.socket = _server_context(rpc.current_tls()).wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False)
        self._thread = threading.Thread(target=self._server.serve_forever, name="diloco-status-page", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{'https' if self._https else 'http'}://{f'[{host}]' if ':' in host else host}:{port}/"

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()
        atomic_write(self._data_dir / STATUS_URL_FILE, self.url + "\n")
        logger.info("status page on %s%s", self.url, "" if self._open else " (admin token required)")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def close(self) -> None:
        """Let go of the port of a page that never started (``stop`` would wait for it to serve)."""
        self._server.server_close()

    def _allowed(self, headers, query: dict[str, list[str]]) -> bool:
        if self._open:
            return True
        given = headers.get("Authorization", "").removeprefix("Bearer ").strip() or (query.get("token") or [""])[0]
        return hmac.compare_digest(given.encode(), self._token.encode())

    def _document(self) -> bytes:
        future = asyncio.run_coroutine_threadsafe(status_document(self._runtime, self._shard_calls), self._loop)
        return json.dumps(future.result(GATHER_TIMEOUT_S), allow_nan=False).encode()

    def _handler(self):
        page = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "diloco-status"
            timeout = REQUEST_TIMEOUT_S

            def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
                url = urlsplit(self.path)
                if not page._allowed(self.headers, parse_qs(url.query)):
                    return self._send(HTTPStatus.UNAUTHORIZED, b"the status page needs the admin token "
                                      b"(Authorization: Bearer TOKEN, or ?token=TOKEN)\n", "text/plain")
                if url.path == "/":
                    return self._send(HTTPStatus.OK, page._html, "text/html; charset=utf-8")
                if url.path == "/status.json":
                    try:
                        body = page._document()
                    except Exception as error:  # the loop stopping, shards too slow: the page retries
                        logger.warning("status page: %s", error or type(error).__name__)
                        return self._send(HTTPStatus.SERVICE_UNAVAILABLE, f"{error or type(error).__name__}\n".encode(),
                                          "text/plain")
                    return self._send(HTTPStatus.OK, body, "application/json")
                self._send(HTTPStatus.NOT_FOUND, b"not found: the page is / and its data /status.json\n", "text/plain")

            def _send(self, status: HTTPStatus, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("Content-Security-Policy", "default-src 'self'; script-src 'unsafe-inline'; "
                                 "style-src 'unsafe-inline'")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args) -> None:
                logger.debug("status page: " + format, *args)

        return Handler
