"""gRPC plumbing shared by every service: the error -> status table, standard services
(health, reflection), channel options with deadlines and retries, and the servers and
channels every process opens, instrumented with OpenTelemetry (trace context travels in
the call metadata; with no tracer provider installed the interceptors' spans are no-ops).

Transport security is the process's: after ``use_tls`` (the CLI's ``--tls-dir``) every
server listens with mutual TLS (a client must present a certificate of the run's CA) and
every channel presents the process's certificate and checks the server's against the
same CA. Certificates name the run by ``TLS_SERVER_NAME``, which channels verify whatever
address they dial (pods, loopback, load balancers): membership of the run's CA is the
identity, and the run secret's credentials still say which process is which.

This is the kernel's service layer; core modules never import it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import random
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor, client_interceptor
from opentelemetry.instrumentation.grpc.filters import service_prefix
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

from diloco import errors
from diloco.errors import InvalidArgument, Unavailable
from diloco.files import atomic_write

T = TypeVar("T")

logger = logging.getLogger(__name__)

# One table from domain errors to status codes; the first matching class wins.
STATUS_FOR_ERROR: tuple[tuple[type[errors.DilocoError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
)


def status_for(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for ``error``.

    Unexpected errors become INTERNAL with a generic message; their traceback goes to
    the log, never to the client.
    """
    for cls, code in STATUS_FOR_ERROR:
        if isinstance(error, cls):
            return code, str(error)
    logger.error("unexpected error in RPC handler", exc_info=error)
    return grpc.StatusCode.INTERNAL, "internal error; see the server log"


async def abort_with(context: grpc.aio.ServicerContext, error: BaseException) -> None:
    code, message = status_for(error)
    await context.abort(code, message)


def add_standard_services(server: grpc.aio.Server, service_names: Iterable[str],
                          with_reflection: bool = False) -> health.HealthServicer:
    """Register grpc.health.v1 and, when asked (``--reflection``: grpcurl without the
    .proto files), server reflection, which otherwise tells anyone every method."""
    names = list(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if with_reflection:
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def health_server(health_servicer, address: str) -> tuple[grpc.aio.Server, int]:
    """A plaintext server with grpc.health.v1 only, answering from ``health_servicer`` (the
    main server's statuses), for probes that cannot present a client certificate
    (kubelet's gRPC probes) while the main port requires mutual TLS."""
    _check_free(address, " for health probes")
    probe_server = grpc.aio.server(options=[*SERVER_OPTIONS, *keepalive_options(server=True)])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe_server)
    try:
        port = probe_server.add_insecure_port(address)
    except RuntimeError as error:
        raise Unavailable(f"cannot listen on {address} for health probes: {error}") from None
    if not port:
        raise Unavailable(f"cannot listen on {address} for health probes: the port is in use or not available")
    await probe_server.start()
    return probe_server, port


LISTEN_PORTS = range(20000, 32768)
"""Where ``free_ports`` looks: below Linux's ephemeral range (32768-60999 by default),
from which every outgoing connection of every process takes its local port."""


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct ports on ``host`` that nothing listens on, for servers to be told
    their address before they start. Chosen at random in ``LISTEN_PORTS``, not by the
    kernel's port 0: that gives an ephemeral port, which any process's next outgoing
    connection may take before the server binds it (a coordinator of the cluster suite
    once could not listen on 127.0.0.1:40495, "Address already in use"). Each is held
    until all are picked."""
    rng = random.SystemRandom()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for port in rng.sample(LISTEN_PORTS, min(len(LISTEN_PORTS), 64 * n)):
            probe = held.enter_context(socket.socket())
            try:
                probe.bind((host, port))
            except OSError:
                continue
            ports.append(port)
            if len(ports) == n:
                return ports
    raise errors.Unavailable(f"no {n} free ports on {host} in {LISTEN_PORTS.start}-{LISTEN_PORTS.stop - 1}")


def _check_free(address: str, purpose: str = "") -> None:
    """Unavailable, with the OS's reason, when no address ``address`` resolves to can be
    listened on, tried with a plain socket as gRPC binds (SO_REUSEADDR, no SO_REUSEPORT)
    and closed at once. Asked before gRPC binds: gRPC's core would log its own line for a
    port in use straight to stderr (``E... add_port.cc ... Failed to add port``), past the
    process's logging, beside the one line the command line prints."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return  # any free port, or an address gRPC itself explains
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return
    reasons = []
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
                return  # gRPC listens wherever one of them binds
            except OSError as error:
                reasons.append(error.strerror or str(error))
    if reasons:
        raise Unavailable(f"cannot listen on {address}{purpose}: {reasons[0]}")


async def mark_serving(health_servicer, service_names: Iterable[str], serving: bool = True) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


# Only the project's own services are traced: health probes and reflection would bury the
# spans that matter (a Kubernetes probe every few seconds per pod).
_TRACED = service_prefix("diloco.")


SERVER_OPTIONS = (
    # A busy port is an error at start, never a second server silently sharing it.
    ("grpc.so_reuseport", 0),
    # Bounded concurrency per connection: a client cannot hold unbounded streams open.
    ("grpc.max_concurrent_streams", 256),
)

KEEPALIVE_TIME_MS = 20_000
"""Every server and every channel pings a connection that has been quiet this long, calls
or none (HTTP/2 PING)..."""
KEEPALIVE_TIMEOUT_MS = 10_000
"""... and closes it when the ping is not answered within this: a peer that died behind a
network cut, or whose host stopped, leaves no half-open connection (and no stream, such
as a shard's membership watch, held by one) for longer than their sum."""


def keepalive_options(server: bool) -> list[tuple[str, object]]:
    """HTTP/2 keepalive for a server or a channel (``KEEPALIVE_TIME_MS``). A server takes
    its clients' pings as often as they send them (half the interval, so a ping that
    comes early is not a strike that closes the connection)."""
    options = [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),  # gRPC core waits 60 s for a ping's ack otherwise
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # else it stops pinging a quiet connection after 2
    ]
    if server:
        options.append(("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2))
    return options


TLS_SERVER_NAME = "diloco"
"""The DNS name every certificate of a run carries and every channel verifies."""
TLS_FILES = ("ca.crt", "tls.crt", "tls.key")
"""A TLS directory's files (the keys of a cert-manager Certificate's Secret)."""


@dataclass(frozen=True)
class Tls:
    """The run's CA and this process's certificate and key (PEM)."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tls:
        contents = []
        for name in TLS_FILES:
            path = Path(directory) / name
            try:
                data = path.read_bytes()
            except OSError as error:
                raise InvalidArgument(f"TLS directory {directory}: cannot read {name} ({error.strerror}); "
                                      "`diloco certs --out DIR` writes ca.crt, tls.crt and tls.key") from None
            if b"-----BEGIN " not in data:
                raise InvalidArgument(f"TLS directory {directory}: {name} is not PEM")
            contents.append(data)
        return cls(*contents)


_tls: Tls | None = None


def use_tls(tls: Tls | None) -> Tls | None:
    """Every server and channel this process opens from now on uses mutual TLS with
    ``tls`` (None: plaintext, the default). Returns the previous setting."""
    global _tls
    previous, _tls = _tls, tls
    return previous


def tls_enabled() -> bool:
    return _tls is not None


def current_tls() -> Tls | None:
    """What ``use_tls`` set (None: plaintext)."""
    return _tls


TLS_DIR_VARIABLE = "DILOCO_TLS_DIR"
INSECURE_VARIABLE = "DILOCO_INSECURE"


@dataclass(frozen=True)
class Transport:
    """A process's choice of transport: mutual TLS with ``tls``, or plaintext (None)."""

    tls: Tls | None
    flags: tuple[str, ...]
    """The same choice as ``diloco`` flags, for the processes this one launches."""


def choose_transport(tls_dir: str | Path | None, insecure: bool, environ: Mapping[str, str]) -> Transport | None:
    """The transport a process asked for: ``tls_dir`` or ``insecure`` (``--tls-dir``,
    ``--insecure``; ``Learner.join(tls_dir=, insecure=)``), else ``$DILOCO_TLS_DIR`` or
    ``$DILOCO_INSECURE`` (1, true or yes) in ``environ``, TLS winning; None when nothing
    chose (the caller refuses plaintext). The one place these settings are read: the CLI
    and ``Learner.join`` pass it their flags and the process environment."""
    if tls_dir and insecure:
        raise InvalidArgument("give a TLS directory or insecure, not both")
    if not tls_dir and not insecure:  # a flag wins over the environment
        tls_dir = environ.get(TLS_DIR_VARIABLE) or None
        insecure = environ.get(INSECURE_VARIABLE, "").lower() in ("1", "true", "yes")
    if tls_dir:
        directory = Path(tls_dir).resolve()
        return Transport(Tls.from_dir(directory), ("--tls-dir", str(directory)))
    if insecure:
        return Transport(None, ("--insecure",))
    return None


# What a call's UNAVAILABLE details say when the two ends disagree on TLS: a plaintext
# client to a TLS server sees "Socket closed"; a TLS client to a plaintext server, or to
# a server of another run's CA, "Tls handshake failed (...)".
_HANDSHAKE_SIGNS = ("handshake", "ssl", "socket closed", "certificate")


def handshake_failed(details: str) -> bool:
    """Whether a failed call's details look like the two ends disagree on TLS."""
    details = details.lower()
    return any(sign in details for sign in _HANDSHAKE_SIGNS)


def handshake_hint() -> str:
    """What to give when a handshake fails, for this process's transport."""
    if _tls is None:
        return ("this process speaks plaintext: if the server was started with --tls-dir, TLS is the likely cause; "
                "give the run's TLS directory (ca.crt, tls.crt, tls.key from `diloco certs`): "
                "Learner.join(..., tls_dir=DIR), $DILOCO_TLS_DIR, or `diloco --tls-dir DIR`")
    return ("the TLS handshake failed: the server is plaintext (started with --insecure: give insecure=True, "
            "$DILOCO_INSECURE=1 or `diloco --insecure`) or presents a certificate of another run's CA "
            "(give that run's TLS directory)")


def _tls_options(options: Iterable[tuple[str, object]]) -> list[tuple[str, object]]:
    return [*options, ("grpc.ssl_target_name_override", TLS_SERVER_NAME)] if _tls is not None else list(options)


def server(options: Iterable[tuple[str, object]] = ()) -> grpc.aio.Server:
    """A grpc.aio server whose handlers continue the caller's trace."""
    return grpc.aio.server(options=[*SERVER_OPTIONS, *keepalive_options(server=True), *options],
                           interceptors=[aio_server_interceptor(filter_=_TRACED)])


def bind(server: grpc.aio.Server, address: str) -> int:
    """Listen on ``address`` (port 0: any free port); a clear Unavailable if it cannot."""
    _check_free(address)
    try:
        if _tls is None:
            port = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(_tls.key, _tls.cert)], root_certificates=_tls.ca, require_client_auth=True)
            port = server.add_secure_port(address, credentials)
    except RuntimeError as error:
        raise Unavailable(f"cannot listen on {address}: the port is in use or not available ({error})") from None
    if not port:
        raise Unavailable(f"cannot listen on {address}: the port is in use or not available")
    return port


def _credentials() -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=_tls.ca, private_key=_tls.key, certificate_chain=_tls.cert)


def channel(address: str, options: Iterable[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel (mutual TLS after ``use_tls``) whose calls are client spans and
    carry the current trace context (every call kind, streams included: the aio
    interceptors cover all four)."""
    interceptors = aio_client_interceptors(filter_=_TRACED)
    if _tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    return grpc.aio.secure_channel(address, _credentials(), options=_tls_options(options), interceptors=interceptors)


def _on_daemon(fn: Callable[..., T], *args, lock: threading.Lock | None = None, **kwargs) -> concurrent.futures.Future:
    """``fn(*args, **kwargs)`` on a daemon thread of its own (holding ``lock`` while it runs),
    its outcome in the future returned. Daemon, not a pool's worker: a pool's workers are
    joined at the interpreter's exit, so a call an interrupt left running held a stopped
    ``diloco compare`` for its whole deadline after its last line (90 s and more, 3 of 10
    SIGTERMs on a loaded machine)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        with lock or contextlib.nullcontext():
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(error)

    threading.Thread(target=run, name="diloco-grpc-shield", daemon=True).start()
    return future


def shielded(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``, run on a worker thread when called from the main thread,
    which only waits for it. Python raises KeyboardInterrupt in the main thread at whatever
    Python line it is on, and gRPC's own Python code (starting a call, polling for its
    events, an asyncio channel's setup and teardown) cut in the middle leaves its C state
    inconsistent: a ``diloco local`` interrupted by Ctrl-C aborted later with a corrupted
    heap (glibc: "corrupted double-linked list", "unaligned tcache chunk") in about 1 of 70
    runs. An interrupt now lands in this wait; the work goes on to its deadline on the
    worker, untouched. Off the main thread ``fn`` runs where it is called."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    return _on_daemon(fn, *args, **kwargs).result()


def in_background(fn: Callable[..., object], *args) -> None:
    """``fn(*args)`` on a worker thread, not waited for (a call's cancel after an interrupt)."""
    _on_daemon(fn, *args)


_LOOP_LOCK = threading.Lock()


def shielded_run(coroutine: Callable[[], Awaitable[T]]) -> T:
    """``asyncio.run(coroutine())``, shielded as ``shielded`` is: from the main thread, on a
    worker thread, these event loops one after another (an interrupted one goes on to its
    end before the next starts, so grpc.aio never sees two loops at once)."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(coroutine())
    return _on_daemon(lambda: asyncio.run(coroutine()), lock=_LOOP_LOCK).result()


def blocking_channel(address: str, options: Iterable[tuple[str, object]] = ()) -> grpc.Channel:
    """The blocking counterpart of ``channel`` (the admin CLI)."""
    if _tls is None:
        raw = grpc.insecure_channel(address, options=list(options))
    else:
        raw = grpc.secure_channel(address, _credentials(), options=_tls_options(options))
    return intercept_channel(raw, client_interceptor(filter_=_TRACED))


MAX_RECONNECT_BACKOFF_MS = 1000


def channel_options(max_message_bytes: int, service: str) -> list[tuple[str, object]]:
    """Message limits, a retry policy that retries UNAVAILABLE only, and reconnects at
    most ``MAX_RECONNECT_BACKOFF_MS`` apart: gRPC's default backoff grows to 120 s, so a
    peer back from a restart was refused calls (UNAVAILABLE at once) for as long as the
    channel's backoff still ran (9 s measured for a coordinator's markers to a shard)."""
    service_config = {
        "methodConfig": [
            {
                "name": [{"service": service}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", json.dumps(service_config)),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        *keepalive_options(server=False),
    ]


async def announce_and_wait_for_signal(what: str, address: str, port_file: Path | None) -> None:
    """Write ``address`` to ``port_file`` (atomically: launchers poll for it), print it, and
    return once SIGTERM or SIGINT arrives."""
    if port_file is not None:
        atomic_write(port_file, f"{address}\n")
    print(f"{what} listening on {address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
