"""Server lifecycle: grpc.aio server, health, reflection, interceptors, limits, graceful stop.

Shutdown (``RunningServer.stop``, what ``eplb serve`` does on SIGTERM or SIGINT), in order:

1. health goes NOT_SERVING for every service; ``Health/Watch`` streams get it at once;
2. new calls are refused with UNAVAILABLE; after ``_HEALTH_FLUSH_S`` open server streams (placement
   and health watches) end with UNAVAILABLE, so watchers reconnect to another instance;
3. unary calls and ``ReportLoad`` streams get half the grace period to finish; a report stream
   still open then ends with UNAVAILABLE once the message in hand is processed (what it accepted
   stays accepted; the status says how many messages were processed, and the client resends the
   rest, with the same seqs, elsewhere); messages still arriving are dropped for up to a quarter
   of the grace period first, so the status reaches a client that has finished writing;
4. whatever still runs at the end of the grace period is cancelled;
5. the balancer stops its loops and flushes again, so nothing accepted during the grace is lost;
6. the store connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import ssl
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .audit import AuditLog
from .auth import Access, AuthFileError, AuthInterceptor, ScopedHealth
from .balancer import Balancer, BalancerConfig
from .call_metrics import CallMetrics
from .calls import ErrorInterceptor
from .decoding import BadMessages
from .draining import Draining
from .errors import ServiceError
from .log_throttle import LogThrottle
from .memory_store import MemoryStore
from .metrics import Metrics
from .metrics_http import serve_metrics
from .redis_store import RedisStore
from .servicer import BalancerServicer, add_to_server
from .store import Store
from .timed_store import TimedStore

__all__ = [
    "SERVICE_NAME",
    "RunningServer",
    "ServerConfig",
    "StartError",
    "check_certificate_dates",
    "grpc_options",
    "start_server",
]

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ExpertLoadBalancerService"].full_name

# Time for NOT_SERVING to reach Health/Watch streams before server streams are ended.
_HEALTH_FLUSH_S = 0.1
# A certificate expiring sooner than this is warned about at start.
CERT_WARN_DAYS = 14


class StartError(Exception):
    """The server cannot start as configured; ``field`` names the ``ServerConfig`` field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``eplb serve`` takes (see docs/service.md for flags and ``EPLB_*`` variables)."""

    host: str = "127.0.0.1"
    port: int = 50051
    redis_url: str | None = None
    key_prefix: str = "eplb"
    token: str | None = None
    # JSON scoped tokens (auth.py); reloaded by ``RunningServer.reload_auth`` (SIGHUP).
    auth_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Largest message either way; a v3-sized [58, 288] int64 report is ~134 KB.
    max_message_bytes: int = 16 * 1024 * 1024
    metrics_port: int | None = None
    grace_s: float = 5.0
    balancer: BalancerConfig = field(default_factory=BalancerConfig)
    # Serving processes of this instance (``eplb serve --processes``, :mod:`.processes`); a
    # serving process itself has ``reuse_port``: it shares the port with its siblings.
    processes: int = 1
    reuse_port: bool = False


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    """The gRPC server options of ``eplb serve`` (also the bench's bare server's, so that its
    floor is measured under the same transport settings)."""
    return [
        # One server per port: without this gRPC sets SO_REUSEPORT, and a second server on a
        # taken port starts too, the kernel splitting clients between two unrelated states.
        # Only the serving processes of one instance share it (--processes: :mod:`.processes`).
        ("grpc.so_reuseport", int(config.reuse_port)),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # Engines hold watch streams for hours: ping idle connections so dead peers are noticed,
        # and accept clients' pings no more often than every 10 s.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_connection_age_grace_ms", 5_000),
    ]


@dataclass
class RunningServer:
    server: grpc.aio.Server
    balancer: Balancer
    store: Store
    health: health.aio.HealthServicer
    metrics: Metrics
    port: int
    grace_s: float
    calls: ErrorInterceptor
    metrics_httpd: object | None = None
    access: Access | None = None
    _refusals_task: asyncio.Task | None = None
    _stopped: bool = False

    def reload_auth(self) -> bool:
        """Re-reads the auth file (``eplb serve`` on SIGHUP): True when the new one is in force;
        a bad file keeps the old tokens and logs an ERROR."""
        return self.access.reload() if self.access is not None else False

    @property
    def metrics_port(self) -> int | None:
        return self.metrics_httpd.server_port if self.metrics_httpd is not None else None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains and stops (the steps in the module docstring); a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.grace_s if grace_s is None else grace_s
        await self.health.enter_graceful_shutdown()
        stopping = asyncio.create_task(self.server.stop(grace))
        await asyncio.sleep(min(_HEALTH_FLUSH_S, grace))
        self.calls.end_server_streams()
        done, _ = await asyncio.wait({stopping}, timeout=grace / 2)
        if not done:
            self.calls.end_client_streams(discard_s=grace / 4)
            await stopping
        # Stops the loops and flushes what the calls of the grace period accepted.
        await self.balancer.stop()
        with contextlib.suppress(ServiceError):
            await self.store.close()
        if self.metrics_httpd is not None:
            self.metrics_httpd.shutdown()
            self.metrics_httpd.server_close()
        if self._refusals_task is not None:
            self._refusals_task.cancel()
        if self.access is not None:
            self.access.refusals.flush(everything=True)
        log.info("stopped")

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def start_server(config: ServerConfig, store: Store | None = None) -> RunningServer:
    """Starts serving; ``port`` 0 picks a free port (``RunningServer.port`` says which).

    Raises ``StartError`` (what was started so far stopped again) when the Redis URL is malformed,
    the auth file is unreadable or malformed, the gRPC or metrics address cannot be bound, or the
    TLS files cannot be read or the certificate is expired or not yet valid.
    """
    access = None
    if config.token or config.auth_file is not None:
        try:
            access = Access(config.token, config.auth_file)
        except AuthFileError as exc:
            raise StartError("auth_file", str(exc)) from None
    if store is None:
        try:
            store = RedisStore(config.redis_url, config.key_prefix) if config.redis_url else MemoryStore()
        except ValueError as exc:  # redis-py's message names the schemes it takes
            raise StartError("redis_url", str(exc)) from None
    metrics = Metrics()
    store = TimedStore(store, metrics)
    # Per-deployment entries only for callers who may see the deployment (no oracle of names).
    health_servicer = ScopedHealth(access, f"{SERVICE_NAME}/")

    def on_health(ok: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            asyncio.ensure_future(health_servicer.set(service, status))

    balancer_config = replace(config.balancer, max_message_bytes=config.max_message_bytes)

    def on_deployment_health(name: str, ok: bool) -> None:
        # One master of a Redis Cluster down: only its deployments say so, as <service>/<name>.
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        asyncio.ensure_future(health_servicer.set(f"{SERVICE_NAME}/{name}", status))

    balancer = Balancer(store, metrics, balancer_config, on_health=on_health, on_deployment_health=on_deployment_health)
    # First, so it also counts (and maps) the calls auth refuses. One grpc interceptor; its
    # collaborators each do one job. Lines about what callers sent share one throttle.
    throttle = LogThrottle()
    calls = ErrorInterceptor(
        (CallMetrics(metrics), AuditLog(throttle)), bad_messages=BadMessages(throttle), draining=Draining()
    )
    interceptors: list[grpc.aio.ServerInterceptor] = [calls]
    tls = bool(config.tls_cert and config.tls_key)
    if access is not None:
        interceptors.append(AuthInterceptor(access))
        if not tls:
            log.warning(
                "a bearer token is required but TLS is off: the token crosses the network in clear text "
                "(set --tls-cert and --tls-key)"
            )
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options(config))
    add_to_server(BalancerServicer(balancer, access), server)  # WatchPlacements sends pre-serialized bytes
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    httpd = None
    try:
        port = _bind(server, config, tls)
        # Bound before anything runs, so a taken port leaves nothing to stop but the store.
        if config.metrics_port is not None:
            try:
                # Tokens guard /metrics only with an auth file: a --token alone keeps it open, as before.
                metrics_access = access if config.auth_file is not None else None
                httpd = serve_metrics(config.host, config.metrics_port, metrics.registry, metrics_access)
            except OSError as exc:
                raise StartError(
                    "metrics_port",
                    f"cannot serve /metrics on {config.host}:{config.metrics_port} ({exc.strerror or exc})",
                ) from None
    except StartError:
        await server.stop(None)
        with contextlib.suppress(ServiceError):
            await store.close()
        raise
    await balancer.start()
    ok = True
    try:
        await store.ping()
    except ServiceError as exc:
        # Serve anyway: health says NOT_SERVING until the store answers, and the balancer retries.
        log.warning("store unreachable at start (%s); serving with health NOT_SERVING until it answers", exc)
        ok = False
    balancer.healthy = ok
    on_health(ok)
    await server.start()
    log.info(
        "serving eplb.v1 on %s:%d (%s store%s%s)",
        config.host,
        port,
        "redis" if config.redis_url else "in-memory",
        (", TLS" if tls else "") + (", reads only" if config.balancer.reads_only else ""),
        f", auth file {config.auth_file}: {access.describe()}" if config.auth_file is not None else "",
    )
    if httpd is not None:
        # --metrics-port 0 picks a port: this line is the only place that says which.
        log.info(
            "serving /metrics on http://%s:%d/metrics%s",
            f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host,
            httpd.server_port,
            " (Authorization: Bearer of an admin or reader token)" if config.auth_file is not None else "",
            extra={"metrics_port": httpd.server_port},
        )
    running = RunningServer(
        server, balancer, store, health_servicer, metrics, port, config.grace_s, calls, httpd, access
    )
    if access is not None:
        running._refusals_task = asyncio.create_task(_flush_refusals(access), name="auth-refusals")
    return running


async def _flush_refusals(access: Access) -> None:
    """Writes the counts of refused calls whose one-minute window ended (auth.RefusalLog)."""
    while True:
        await asyncio.sleep(min(1.0, access.refusals.window_s / 4))
        access.refusals.flush()


def check_certificate_dates(path: Path, pem: bytes, now: datetime | None = None) -> None:
    """``StartError`` naming ``path`` and the dates when a certificate of the chain ``pem`` is
    expired or not yet valid (every client would fail the handshake); a WARNING when one expires
    within ``CERT_WARN_DAYS`` days."""
    from cryptography import x509  # only for TLS; a service dependency (pyproject)

    now = now or datetime.now(UTC)
    try:
        chain = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise StartError("tls_cert", f"{path} is not a PEM certificate chain ({exc})") from None
    for i, cert in enumerate(chain):
        which = "the certificate" if i == 0 else f"certificate {i + 1} of the chain"
        subject = cert.subject.rfc4514_string() or "(no subject)"
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        dates = f"valid from {start:%Y-%m-%d %H:%M:%S} UTC to {end:%Y-%m-%d %H:%M:%S} UTC"
        if now < start:
            raise StartError("tls_cert", f"{path}: {which} ({subject}) is not valid yet: {dates}")
        if now > end:
            raise StartError("tls_cert", f"{path}: {which} ({subject}) has expired: {dates}")
        if end - now < timedelta(days=CERT_WARN_DAYS):
            log.warning(
                "%s: %s (%s) expires in %.1f days (%s): renew it before clients fail the handshake",
                path,
                which,
                subject,
                (end - now).total_seconds() / 86400,
                dates,
            )


def _bind(server: grpc.aio.Server, config: ServerConfig, tls: bool) -> int:
    """Adds the listening port; ``StartError`` when it is taken or the address is not this host's."""
    # An IPv6 literal such as :: needs brackets, or gRPC reads ":::50051" as a malformed name.
    host = f"[{config.host}]" if ":" in config.host and not config.host.startswith("[") else config.host
    address = f"{host}:{config.port}"
    if tls:
        try:
            key, cert = Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes()
        except OSError as exc:
            which = "tls_key" if exc.filename == str(config.tls_key) else "tls_cert"
            raise StartError(which, f"cannot read {exc.filename} ({exc.strerror})") from None
        try:
            # gRPC refuses bad PEM only when binding, as a bare "Failed to bind"; ssl says why.
            # (An empty password: a key that needs one fails here, as gRPC cannot take one.)
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(config.tls_cert, config.tls_key, "")
        except ssl.SSLError as exc:
            raise StartError(
                "tls_cert",
                f"{config.tls_cert} and {config.tls_key} are not a PEM certificate chain "
                f"and its unencrypted private key ({exc.reason or exc})",
            ) from None
        check_certificate_dates(Path(config.tls_cert), cert)
        add = lambda: server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
    else:
        add = lambda: server.add_insecure_port(address)
    if not config.reuse_port:  # a serving process: its supervisor probed the port
        _probe(config.host.strip("[]"), config.port)
    try:
        port = add()
    except RuntimeError:  # "Failed to bind", the reason only in gRPC's own log
        port = 0
    if port == 0:  # taken between the probe and here
        raise StartError(
            "port", f"cannot listen on {address}: the port is in use or {config.host} is not an address of this host"
        )
    return port


def _probe(host: str, port: int) -> None:
    """Binds ``host:port`` the way gRPC does (SO_REUSEADDR), to refuse a taken port with its reason
    before gRPC fails with a bare "Failed to bind" and logs the reason to stderr itself."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartError("host", f"cannot resolve {host!r} ({exc.strerror})") from None
    errors = []
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(addr)
            return  # gRPC serves if any resolved address binds
        except OSError as exc:  # e.g. an IPv6 address on a host without IPv6
            errors.append(exc)
    first = errors[0]
    which = "host" if first.errno == errno.EADDRNOTAVAIL else "port"
    raise StartError(which, f"cannot listen on {host}:{port} ({first.strerror or first})")
