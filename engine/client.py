"""Talking to the balancer service from an engine (sync face): channels to several service
addresses with failover, retries with backoff, and the unary calls an engine makes.

``Endpoints`` holds one channel at a time, to the first address that answers; a call that
fails as unavailable moves it to the next address. ``ServiceClient`` wraps the unary RPCs
(create a deployment, get a placement, ack, rebalance, health) with that failover and retries
transient failures until its deadline. ``LoadReporter`` (reporter.py) and
``PlacementWatcher`` (watcher.py) share an ``Endpoints`` the same way.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

import grpc

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from . import wire

__all__ = [
    "Endpoints",
    "Backoff",
    "Retry",
    "ServiceClient",
    "ACK_STATES",
    "TRANSIENT",
    "parse_addresses",
    "channel_options",
]

# Failures that another attempt (later, or at another replica) can cure: the replica is down or
# restarting, the stream was cut, or its store is away. Everything else is the request's fault.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

ACK_STATES: dict[str, int] = {
    "prepared": pb.ACK_STATE_PREPARED,
    "switched": pb.ACK_STATE_SWITCHED,
    "failed": pb.ACK_STATE_FAILED,
}


def parse_addresses(addresses: str | Sequence[str]) -> tuple[str, ...]:
    """``"host:port,host:port"`` or a sequence of ``host:port`` → a tuple; ``ValueError`` if empty."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    out = tuple(a.strip() for a in items if a and a.strip())
    if not out:
        raise ValueError(f"addresses must name at least one host:port, got {addresses!r}")
    return out


class Backoff:
    """Exponential backoff with full jitter: ``initial_s`` doubling up to ``max_s``."""

    def __init__(self, initial_s: float = 0.05, max_s: float = 2.0) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self._next = initial_s

    def reset(self) -> None:
        self._next = self.initial_s

    def delay(self) -> float:
        """The next wait in seconds (and doubles the one after)."""
        out = random.uniform(self._next / 2, self._next)
        self._next = min(self.max_s, self._next * 2)
        return out


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """The gRPC options of every engine channel (sync and asyncio): message limits, keepalive,
    and quick reconnects."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        # Reconnect quickly after a replica restarts instead of gRPC's default (up to 2 min).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
    ]


class Retry:
    """The retry policy of one unary call, shared by the sync and asyncio faces: attempts of at
    most 5 s each until ``timeout_s`` has passed, transient failures retried after a backoff."""

    def __init__(self, timeout_s: float) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.backoff = Backoff()

    def attempt_timeout(self) -> float:
        """Seconds the next attempt may take (at least 50 ms, so a last attempt is still made)."""
        return max(0.05, min(self.deadline - time.monotonic(), 5.0))

    def retryable(self, code: grpc.StatusCode) -> bool:
        """Whether a failure with ``code`` is worth another attempt before the deadline."""
        return code in TRANSIENT and time.monotonic() + 0.05 < self.deadline

    def pause_s(self) -> float:
        """The wait before the next attempt, never past the deadline."""
        return min(self.backoff.delay(), max(0.0, self.deadline - time.monotonic()))


# create_deployment(exist_ok=True) reads the deployment on these: it exists, or the token may not
# create it (an engine token), in which case it must already exist.
EXISTING_OK = (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED)


def create_request(
    name: str, topology: eplb.Topology, initial: eplb.Placement | None, options: dict[str, object]
) -> pb.CreateDeploymentRequest:
    """The ``CreateDeployment`` request of ``create_deployment`` (both faces)."""
    request = pb.CreateDeploymentRequest(deployment=wire.deployment_pb(name, topology, **options))
    if initial is not None:
        request.initial_phy2log.CopyFrom(wire.encode_array(initial.phy2log))
    return request


def same_topology(name: str, existing: pb.Deployment, topology: eplb.Topology) -> pb.Deployment:
    """``existing`` if it has ``topology``, else ``ValueError`` (``create_deployment(exist_ok=True)``)."""
    if wire.topology_from_pb(existing.topology) != topology:
        raise ValueError(f"deployment {name!r} exists with {wire.topology_from_pb(existing.topology)}, not {topology}")
    return existing


def ack_request(deployment: str, rank: int, version: int, state: str, step: int, error: str) -> pb.AckPlacementRequest:
    """The ``AckPlacement`` request of ``ack`` (both faces); ``ValueError`` for an unknown ``state``."""
    if state not in ACK_STATES:
        raise ValueError(f"state {state!r} is not one of {', '.join(ACK_STATES)}")
    return pb.AckPlacementRequest(
        deployment=deployment, rank=rank, version=version, state=ACK_STATES[state], step=step, error=error[:1024]
    )


class Endpoints:
    """Channels to the addresses of one service (its replicas), one in use at a time.

    ``stub()`` is the current address's stub; ``failover(stub)`` after a transient failure of a
    call made on ``stub`` moves to the next address (once per failed channel, so several
    threads that saw the same failure move it once). Thread-safe.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.addresses = parse_addresses(addresses)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._root_certificates = root_certificates
        self._options = channel_options(max_message_bytes)
        self._lock = threading.Lock()
        self._index = 0
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.ExpertLoadBalancerServiceStub | None = None
        self.failovers = 0

    @property
    def address(self) -> str:
        return self.addresses[self._index]

    def _open(self) -> None:
        target = self.addresses[self._index]
        if self._root_certificates is not None:
            creds = grpc.ssl_channel_credentials(self._root_certificates)
            self._channel = grpc.secure_channel(target, creds, options=self._options)
        else:
            self._channel = grpc.insecure_channel(target, options=self._options)
        self._stub = pb_grpc.ExpertLoadBalancerServiceStub(self._channel)

    def stub(self) -> pb_grpc.ExpertLoadBalancerServiceStub:
        with self._lock:
            if self._stub is None:
                self._open()
            return self._stub

    def channel(self) -> grpc.Channel:
        with self._lock:
            if self._channel is None:
                self._open()
            return self._channel

    def failover(self, failed: pb_grpc.ExpertLoadBalancerServiceStub) -> None:
        """The call made on ``failed`` could not reach its replica: use the next address."""
        with self._lock:
            if failed is not self._stub or self._channel is None:
                return
            self._channel.close()
            self._channel = self._stub = None
            self._index = (self._index + 1) % len(self.addresses)
            self.failovers += 1

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = self._stub = None


class ServiceClient:
    """Unary calls to the balancer with failover between ``addresses`` and retries of transient
    failures for up to ``timeout_s`` per call.

    Errors that are the request's fault (``INVALID_ARGUMENT``, ``NOT_FOUND``,
    ``FAILED_PRECONDITION``, ``ALREADY_EXISTS``, auth) raise ``grpc.RpcError`` at once.
    """

    def __init__(
        self,
        addresses: str | Sequence[str] | Endpoints,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        if isinstance(addresses, Endpoints):
            self.endpoints, self._owned = addresses, False
        else:
            self.endpoints, self._owned = Endpoints(addresses, token=token, root_certificates=root_certificates), True
        self.timeout_s = timeout_s

    def call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        """Calls unary ``method`` (e.g. ``"GetPlacement"``), failing over and retrying transient
        failures until ``timeout_s`` (default: the client's) has passed."""
        retry = Retry(self.timeout_s if timeout_s is None else timeout_s)
        while True:
            stub = self.endpoints.stub()
            try:
                return getattr(stub, method)(request, timeout=retry.attempt_timeout(), metadata=self.endpoints.metadata)
            except grpc.RpcError as exc:
                if not retry.retryable(exc.code()):
                    raise
                self.endpoints.failover(stub)
                time.sleep(retry.pause_s())

    def create_deployment(
        self,
        name: str,
        topology: eplb.Topology,
        *,
        initial: eplb.Placement | None = None,
        exist_ok: bool = False,
        **options: object,
    ) -> pb.Deployment:
        """Creates deployment ``name`` for ``topology`` (``options``: ``wire.deployment_pb``'s) and
        returns it as stored. ``exist_ok``: an existing deployment of the same topology is
        returned instead of ``ALREADY_EXISTS`` (a different topology raises ``ValueError``); so
        it is for an engine token, which may not create (``PERMISSION_DENIED``) but may read the
        deployment an admin created."""
        try:
            return self.call("CreateDeployment", create_request(name, topology, initial, options)).deployment
        except grpc.RpcError as exc:
            if not (exist_ok and exc.code() in EXISTING_OK):
                raise
            refused = exc
        try:
            existing = self.get_deployment(name)
        except grpc.RpcError:
            raise refused from None  # not there (or not visible either): the create's own error
        return same_topology(name, existing, topology)

    def get_deployment(self, name: str) -> pb.Deployment:
        return self.call("GetDeployment", pb.GetDeploymentRequest(name=name)).deployment

    def topology(self, name: str) -> eplb.Topology:
        return wire.topology_from_pb(self.get_deployment(name).topology)

    def get_placement(
        self, deployment: str, version: int = 0, topology: eplb.Topology | None = None
    ) -> wire.PublishedPlacement:
        """The current placement (``version`` 0) or a recent version, decoded."""
        msg = self.call("GetPlacement", pb.GetPlacementRequest(deployment=deployment, version=version)).placement
        return wire.placement_from_pb(msg, topology or self.topology(deployment))

    def ack(
        self, deployment: str, rank: int, version: int, state: str = "switched", *, step: int = 0, error: str = ""
    ) -> pb.AckPlacementResponse:
        """Says where ``rank`` stands with ``version``: ``"prepared"``, ``"switched"`` or
        ``"failed"`` (with ``error``, cut to 1024 characters); returns the rollout as the service
        sees it (ranks prepared, switch step once all did, aborted)."""
        return self.call("AckPlacement", ack_request(deployment, rank, version, state, step, error))

    def rebalance(self, deployment: str, *, dry_run: bool = False, force: bool = False) -> pb.RebalanceResponse:
        return self.call("Rebalance", pb.RebalanceRequest(deployment=deployment, dry_run=dry_run, force=force))

    def delete_deployment(self, name: str) -> None:
        self.call("DeleteDeployment", pb.DeleteDeploymentRequest(name=name))

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether a replica answers the gRPC health check as SERVING: the current address
        first, then each other in turn (``timeout_s`` each); the first that does becomes the
        current address, as after a failover."""
        for _ in range(len(self.endpoints.addresses)):
            stub = self.endpoints.stub()
            if wire.check_health(self.endpoints.channel(), timeout_s):
                return True
            self.endpoints.failover(stub)
        return False

    def close(self) -> None:
        if self._owned:
            self.endpoints.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
