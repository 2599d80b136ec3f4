"""Talking to the balancer service from an engine: the one client implementation and its sync face.

The calls an engine makes (create a deployment, get a placement, ack, rebalance, report load,
watch placements, health) are written once, in ``Calls``, as generators that say what to do
next (``Rpc``, ``Health``, ``Watch``/``Read``, ``Failover``, ``Sleep``, ``Deliver``) and get each
outcome back (``Sent``): the request building, the retries of transient failures until the
deadline, the failover between addresses, the ``exist_ok`` rules and the response decoding all
live there. A face only runs those steps on its channels: ``ServiceClient`` here on ``grpc``
channels, ``AsyncServiceClient`` (aio.py) on ``grpc.aio`` ones, so the two raise the same errors
and retry, fail over and give up by the same rules.

``Endpoints`` holds one channel at a time, to the first address that answers; a call that
fails as unavailable moves it to the next address. ``LoadReporter`` (reporter.py) and
``PlacementWatcher`` (watcher.py) share an ``Endpoints`` with a ``ServiceClient``. Reads
(``GetPlacement``, ``WatchPlacements``, ``GetDeployment``, ``ListDeployments``) may go to
endpoints of their own (``reads=``: the service's reads-only instances, then the client's
addresses as a fallback), so that they never wait behind the reports an instance takes.
"""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc
from eplb_wire.parts import WATCH_PART_BYTES, PartAssembler

from . import wire

__all__ = [
    "Endpoints",
    "READ_METHODS",
    "read_endpoints",
    "is_read",
    "Backoff",
    "Retry",
    "Calls",
    "ServiceClient",
    "ACK_STATES",
    "transient",
    "pushback_s",
    "parse_addresses",
    "channel_options",
    "auth_metadata",
    "open_channel",
]

# Codes that say the call did not get through or lost a race, whatever its details: the replica
# is down or restarting (UNAVAILABLE), the attempt ran out of its time (DEADLINE_EXCEEDED), the
# stream was cut (CANCELLED), a concurrent change won (ABORTED, which the service raises for a
# retry). Another attempt, later or at another instance, can cure them.
_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
    }
)

# INTERNAL and UNKNOWN are the server's failure (a bug: the same request fails the same way), except
# where grpc itself makes them of a broken transport; those have these exact details, which no
# eplb servicer writes. "Internal error from Core": grpc.aio's client lost the status of a stream
# it was still writing (grpc/grpc#36066); "Received RST_STREAM with error code N": the peer or a
# proxy reset the HTTP/2 stream without a status; "Stream removed": the connection went mid-call.
_TRANSPORT_DETAILS = frozenset({"Internal error from Core", "Stream removed"})
_TRANSPORT_PREFIX = "Received RST_STREAM with error code "

# The server's hint (gRPC's retry design, A6): wait this many milliseconds before another attempt;
# a negative or unreadable value asks for no retry at all.
PUSHBACK_KEY = "grpc-retry-pushback-ms"


def pushback_s(error: grpc.RpcError) -> float | None:
    """The wait in seconds the server asked for in ``error``'s trailing metadata
    (``grpc-retry-pushback-ms``), None if it named none, -1.0 if it asked for no retry."""
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == PUSHBACK_KEY:
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return -1.0
            return -1.0 if ms < 0 else ms / 1000
    return None


def transient(error: grpc.RpcError) -> bool:
    """Whether another attempt of the call that failed with ``error`` can succeed: UNAVAILABLE,
    DEADLINE_EXCEEDED, CANCELLED and ABORTED; RESOURCE_EXHAUSTED only when the server said when
    to come back (``pushback_s``); INTERNAL and UNKNOWN only when grpc made them of a broken
    transport. Never when the server's hint asks for no retry. Anything else is the request's
    fault, or a server failure that would fail the same way again."""
    pushback = pushback_s(error)
    if pushback is not None and pushback < 0:
        return False
    code = error.code()
    if code in _TRANSIENT_CODES:
        return True
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return pushback is not None
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        details = error.details() or ""
        return details in _TRANSPORT_DETAILS or details.startswith(_TRANSPORT_PREFIX)
    return False


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


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def open_channel(
    target: str, root_certificates: bytes | None, options: list[tuple[str, int]], *, aio: bool = False
) -> grpc.Channel | grpc.aio.Channel:
    """A channel to ``target``: TLS with ``root_certificates`` (None: plaintext), ``grpc.aio``'s if ``aio``."""
    module = grpc.aio if aio else grpc
    if root_certificates is not None:
        return module.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=options)
    return module.insecure_channel(target, options=options)


class Retry:
    """The retry policy of one call, the same for both faces: attempts of at most 5 s each until
    ``timeout_s`` has passed, transient failures retried after a backoff. ``timeout_s`` None:
    one attempt without a deadline, its failure raised as is."""

    def __init__(self, timeout_s: float | None) -> None:
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.backoff = Backoff()

    def attempt_timeout(self) -> float | None:
        """Seconds the next attempt may take (at least 50 ms, so a last attempt is still made)."""
        if self.deadline is None:
            return None
        return max(0.05, min(self.deadline - time.monotonic(), 5.0))

    def retryable(self, error: grpc.RpcError) -> bool:
        """Whether ``error`` is worth another attempt (``transient``) that can start, after any
        wait the server asked for, before the deadline."""
        if self.deadline is None or not transient(error):
            return False
        return time.monotonic() + (pushback_s(error) or 0.0) + 0.05 < self.deadline

    def pause_s(self, error: grpc.RpcError) -> float:
        """The wait before the next attempt: the backoff, or the server's pushback if longer;
        never past the deadline."""
        wait = max(self.backoff.delay(), pushback_s(error) or 0.0)
        return min(wait, max(0.0, self.deadline - time.monotonic()))


# create_deployment(exist_ok=True) reads the deployment on these: it exists, or the token may not
# create it (an engine token), in which case it must already exist.
EXISTING_OK = (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED)


# -- the steps a face runs for ``Calls`` ---------------------------------------------------------


@dataclass(frozen=True)
class Rpc:
    """Call ``method`` on the current address; ``stream``: ``request`` is a list sent as a
    client stream (``ReportLoad``). Answered with ``Sent``."""

    method: str
    request: object
    timeout_s: float | None
    stream: bool = False


@dataclass(frozen=True)
class Health:
    """The gRPC health check of the current address. Answered with ``Sent`` (``response``: SERVING or not)."""

    timeout_s: float


@dataclass(frozen=True)
class Watch:
    """Open a ``WatchPlacements`` stream on the current address. Answered with ``Sent`` (``response``: the call)."""

    request: pb.WatchPlacementsRequest


@dataclass(frozen=True)
class Read:
    """The next message of the stream ``call``. Answered with ``Sent`` (``response`` None: it ended)."""

    call: object


@dataclass(frozen=True)
class Failover:
    """The call made on ``stub`` could not reach its replica: use the next address."""

    stub: object


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Deliver:
    """Hand ``item`` to the caller of a stream (``watch``) and go on when it asks for the next."""

    item: Any  # a decoded PublishedPlacement, or the wire Placement (watch(decode=False))


@dataclass(frozen=True)
class Sent:
    """The outcome of a step made on ``stub``: its ``response``, or the ``error`` it failed with."""

    stub: object
    response: object = None
    error: grpc.RpcError | None = None


Step = Rpc | Health | Watch | Read | Failover | Sleep | Deliver
_T = TypeVar("_T")
# A ``Calls`` method: the steps a face makes, then what the call returns.
Ops = Generator[Step, Sent | None, _T]


def create_request(
    name: str, topology: eplb.Topology, initial: eplb.Placement | None, options: dict[str, object]
) -> pb.CreateDeploymentRequest:
    """The ``CreateDeployment`` request of ``create_deployment``."""
    request = pb.CreateDeploymentRequest(deployment=wire.deployment_pb(name, topology, **options))
    if initial is not None:
        request.initial_phy2log.CopyFrom(wire.encode_array(initial.phy2log))
    return request


def _holds(stored: Message, asked: Message) -> bool:
    """Whether ``stored`` has every field set in ``asked`` with the same value (messages
    compared field by field the same way: the service fills in defaults beside them)."""
    for field, value in asked.ListFields():
        mine = getattr(stored, field.name)
        if field.type == field.TYPE_MESSAGE and not _repeated(field):
            if not stored.HasField(field.name) or not _holds(mine, value):
                return False
        elif mine != value:
            return False
    return True


def _repeated(field: object) -> bool:
    # protobuf 5+ has is_repeated; label is the older spelling.
    is_repeated = getattr(field, "is_repeated", None)
    return bool(is_repeated) if is_repeated is not None else field.label == field.LABEL_REPEATED  # type: ignore[attr-defined]


def same_topology(name: str, existing: pb.Deployment, topology: eplb.Topology) -> pb.Deployment:
    """``existing`` if it has ``topology``, else ``ValueError`` (``create_deployment(exist_ok=True)``)."""
    if wire.topology_from_pb(existing.topology) != topology:
        raise ValueError(f"deployment {name!r} exists with {wire.topology_from_pb(existing.topology)}, not {topology}")
    return existing


def ack_request(deployment: str, rank: int, version: int, state: str, step: int, error: str) -> pb.AckPlacementRequest:
    """The ``AckPlacement`` request of ``ack``; ``ValueError`` for an unknown ``state``."""
    if state not in ACK_STATES:
        raise ValueError(f"state {state!r} is not one of {', '.join(ACK_STATES)}")
    return pb.AckPlacementRequest(
        deployment=deployment, rank=rank, version=version, state=ACK_STATES[state], step=step, error=error[:1024]
    )


def report_request(
    deployment: str, rank: int, seq: int, counts: object, placement_version: int | None = None
) -> pb.ReportLoadRequest:
    """One ``ReportLoad`` message: ``counts`` ``[L, E]`` logical, or ``[L, P]`` physical recorded
    under ``placement_version``; ``seq`` must grow per rank (the service drops a seen one)."""
    msg = pb.ReportLoadRequest(deployment=deployment, rank=rank, seq=seq)
    if placement_version is None:
        msg.logical.CopyFrom(wire.encode_array(counts))
    else:
        msg.physical.counts.CopyFrom(wire.encode_array(counts))
        msg.physical.placement_version = placement_version
    return msg


class Calls:
    """The engine's calls, once for both faces: each method returns the steps (``Ops``) a face
    runs; the generator's return value is the call's result, and what it raises the call raises.

    ``timeout_s``: the default deadline of a call (None: one attempt, no deadline, no retry);
    ``addresses``: how many replicas ``healthy`` may try.
    """

    def __init__(self, timeout_s: float | None, addresses: int) -> None:
        self.timeout_s, self.addresses = timeout_s, addresses

    def call(self, method: str, request: object, timeout_s: float | None = None, *, stream: bool = False) -> Ops[Any]:
        """Unary (or client-streaming) ``method``: transient failures are retried, at the next
        address, until the deadline; any other failure (the request's fault) raises at once."""
        retry = Retry(self.timeout_s if timeout_s is None else timeout_s)
        while True:
            sent = yield Rpc(method, request, retry.attempt_timeout(), stream)
            if sent.error is None:
                return sent.response
            if not retry.retryable(sent.error):
                raise sent.error
            yield Failover(sent.stub)
            yield Sleep(retry.pause_s(sent.error))

    def create_deployment(
        self, name: str, topology: eplb.Topology, initial: eplb.Placement | None, exist_ok: bool, options: dict
    ) -> Ops[pb.Deployment]:
        request = create_request(name, topology, initial, options)
        retry = Retry(self.timeout_s)
        retried = False
        while True:
            sent = yield Rpc("CreateDeployment", request, retry.attempt_timeout(), False)
            if sent.error is None:
                return sent.response.deployment
            if retried and sent.error.code() == grpc.StatusCode.ALREADY_EXISTS:
                # An earlier attempt may have created it and lost its answer: ours if what is
                # stored is what we asked for (a create by someone else of the same deployment
                # is as good); else the refusal stands.
                ours = yield from self._created(name, request.deployment)
                if ours is not None:
                    return ours
            if not retry.retryable(sent.error):
                break
            retried = True
            yield Failover(sent.stub)
            yield Sleep(retry.pause_s(sent.error))
        refused = sent.error
        if not (exist_ok and refused.code() in EXISTING_OK):
            raise refused
        try:
            existing = yield from self.get_deployment(name)
        except grpc.RpcError:
            raise refused from None  # not there (or not visible either): the create's own error
        return same_topology(name, existing, topology)

    def _created(self, name: str, asked: pb.Deployment) -> Ops[pb.Deployment | None]:
        """The stored deployment ``name`` if it holds every field ``asked`` set, as asked (the
        service fills in the rest); None if it differs or cannot be read."""
        try:
            existing = yield from self.get_deployment(name)
        except grpc.RpcError:
            return None
        return existing if _holds(existing, asked) else None

    def get_deployment(self, name: str) -> Ops[pb.Deployment]:
        return (yield from self.call("GetDeployment", pb.GetDeploymentRequest(name=name))).deployment

    def topology(self, name: str) -> Ops[eplb.Topology]:
        return wire.topology_from_pb((yield from self.get_deployment(name)).topology)

    def get_placement(
        self, deployment: str, version: int, topology: eplb.Topology | None
    ) -> Ops[wire.PublishedPlacement]:
        reply = yield from self.call("GetPlacement", pb.GetPlacementRequest(deployment=deployment, version=version))
        return wire.placement_from_pb(reply.placement, topology or (yield from self.topology(deployment)))

    def ack(
        self, deployment: str, rank: int, version: int, state: str, step: int, error: str
    ) -> Ops[pb.AckPlacementResponse]:
        return (yield from self.call("AckPlacement", ack_request(deployment, rank, version, state, step, error)))

    def rebalance(self, deployment: str, dry_run: bool, force: bool) -> Ops[pb.RebalanceResponse]:
        request = pb.RebalanceRequest(deployment=deployment, dry_run=dry_run, force=force)
        return (yield from self.call("Rebalance", request))

    def delete_deployment(self, name: str) -> Ops[None]:
        yield from self.call("DeleteDeployment", pb.DeleteDeploymentRequest(name=name))

    def report(
        self, requests: Sequence[pb.ReportLoadRequest], timeout_s: float | None = None
    ) -> Ops[pb.ReportLoadResponse]:
        """One ``ReportLoad`` stream of ``requests``; a retry re-sends them with their seqs, which
        the service counts once."""
        return (yield from self.call("ReportLoad", list(requests), timeout_s, stream=True))

    def healthy(self, timeout_s: float) -> Ops[bool]:
        """The current address first, then each other in turn; the first SERVING one stays current."""
        for _ in range(self.addresses):
            sent = yield Health(timeout_s)
            if sent.response:
                return True
            yield Failover(sent.stub)
        return False

    def watch(
        self, deployment: str, since_version: int, topology: eplb.Topology | None, *, decode: bool = True
    ) -> Ops[None]:
        """Delivers each new version of ``deployment`` after ``since_version`` (decoded, or the
        wire ``Placement`` if not ``decode``); reconnects (at the next address after a transient
        failure) and resumes after the last version delivered. Ends only with an error that is
        the request's fault."""
        backoff = Backoff()
        version = since_version
        while True:
            if decode and topology is None:
                try:
                    topology = yield from self.topology(deployment)
                except grpc.RpcError as exc:
                    if not transient(exc):
                        raise
                    # (its retries failed over already) wait, then try again
                    yield Sleep(backoff.delay())
                    continue
            sent = yield Watch(
                pb.WatchPlacementsRequest(deployment=deployment, since_version=version, max_part_bytes=WATCH_PART_BYTES)
            )
            stub, error = sent.stub, sent.error
            if error is None:
                call = sent.response
                parts = PartAssembler()
                while True:
                    got = yield Read(call)
                    if got.error is not None or got.response is None:
                        error = got.error
                        break
                    backoff.reset()
                    msg = parts.feed(got.response)
                    if msg is not None and msg.version > version:
                        item = wire.placement_from_pb(msg, topology) if decode else msg
                        version = msg.version
                        yield Deliver(item)
            if error is not None:
                if not transient(error):
                    raise error
                yield Failover(stub)
            yield Sleep(backoff.delay())


class Endpoints:
    """Channels to the addresses of one service (its replicas), one in use at a time.

    ``stub()`` is the current address's stub; ``failover(stub)`` after a transient failure of a
    call made on ``stub`` moves to the next address (once per failed channel, so several
    threads that saw the same failure move it once). ``aio``: ``grpc.aio`` channels (the
    asyncio face, which closes a failed channel itself: ``detach``). ``Endpoints.over(channel)``:
    the caller's own channel, never closed or replaced. Thread-safe.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        max_message_bytes: int = 16 * 1024 * 1024,
        aio: bool = False,
    ) -> None:
        self.addresses = parse_addresses(addresses)
        self.metadata = auth_metadata(token)
        self.aio = aio
        self._root_certificates = root_certificates
        self._options = channel_options(max_message_bytes)
        self._lock = threading.Lock()
        self._index = 0
        self._channel: grpc.Channel | grpc.aio.Channel | None = None
        self._stub: pb_grpc.ExpertLoadBalancerServiceStub | None = None
        self._borrowed = False
        self.failovers = 0
        # Homing (read_endpoints): the first ``home`` addresses are where calls belong; after a
        # failover past them, ``homeward`` brings the next call back once ``home_after_s`` passed.
        self.home = 0
        self.home_after_s = 30.0
        self._left_home_at: float | None = None

    @classmethod
    def over(cls, channel: grpc.Channel | grpc.aio.Channel, *, token: str | None = None) -> Endpoints:
        """The one channel the caller opened (and closes): no failover, ``close`` leaves it open."""
        out = cls("(the caller's channel)", token=token, aio=isinstance(channel, grpc.aio.Channel))
        out._channel, out._borrowed = channel, True
        out._stub = pb_grpc.ExpertLoadBalancerServiceStub(channel)
        return out

    @property
    def address(self) -> str:
        return self.addresses[self._index]

    def prefer(self, key: str) -> None:
        """Starts at the address ``key`` (a deployment's name) hashes to, if no channel is open
        yet (a no-op after). The ranks and node agents of one deployment, given the same
        addresses, then report to the same instance: each instance process keeps a window per
        deployment it takes reports for and writes it to the store every second, so a
        deployment spread over every instance costs each of them (and the store) that much
        more, while deployments hashed over the instances spread the load as well. A failover
        moves on from there as from the first address.

        With ``home`` addresses (``read_endpoints``): starts at the home address ``key`` hashes
        to, and the addresses after them (the fallback) are turned to start at the one it hashes
        to, so that deployments fall back over all of them."""
        with self._lock:
            if self._channel is None and not self._borrowed:
                at = zlib.crc32(key.encode())
                if not self.home:
                    self._index = at % len(self.addresses)
                    return
                own, rest = self.addresses[: self.home], self.addresses[self.home :]
                if rest:
                    rest = rest[at % len(rest) :] + rest[: at % len(rest)]
                self.addresses = own + rest
                self._index = at % self.home

    def _open(self) -> pb_grpc.ExpertLoadBalancerServiceStub:
        self._channel = open_channel(self.addresses[self._index], self._root_certificates, self._options, aio=self.aio)
        self._stub = pb_grpc.ExpertLoadBalancerServiceStub(self._channel)
        return self._stub

    def stub(self) -> pb_grpc.ExpertLoadBalancerServiceStub:
        with self._lock:
            return self._open() if self._stub is None else self._stub

    def channel(self) -> grpc.Channel | grpc.aio.Channel:
        with self._lock:
            if self._channel is None:
                self._open()
            return self._channel

    def detach(self, failed: object) -> grpc.Channel | grpc.aio.Channel | None:
        """Moves to the next address if ``failed`` is the current stub; returns the channel the
        caller must close (None: already moved on, or a borrowed channel)."""
        with self._lock:
            if failed is not self._stub or self._channel is None or self._borrowed:
                return None
            channel, self._channel, self._stub = self._channel, None, None
            self._index = (self._index + 1) % len(self.addresses)
            self.failovers += 1
            if self._index < self.home:
                self._left_home_at = None
            elif self._left_home_at is None:
                self._left_home_at = time.monotonic()
            return channel

    def away(self) -> bool:
        """Whether calls go to a fallback address (past the ``home`` ones) for now."""
        return bool(self.home) and self._index >= self.home

    def homeward(self) -> grpc.Channel | grpc.aio.Channel | None:
        """Back to the first home address once ``home_after_s`` passed since calls left them
        (the next call tries it, failing over again if it still does not answer); returns the
        fallback channel for the caller to close (None: nothing to do)."""
        with self._lock:
            if not self.away() or self._borrowed or self._left_home_at is None:
                return None
            if time.monotonic() - self._left_home_at < self.home_after_s:
                return None
            channel, self._channel, self._stub = self._channel, None, None
            self._index, self._left_home_at = 0, None
            return channel

    def failover(self, failed: pb_grpc.ExpertLoadBalancerServiceStub) -> None:
        """The call made on ``failed`` could not reach its replica: use the next address (sync channels)."""
        channel = self.detach(failed)
        if channel is not None:
            channel.close()

    def take(self) -> grpc.Channel | grpc.aio.Channel | None:
        """Forgets the current channel and returns it for the caller to close (None: borrowed or none)."""
        with self._lock:
            channel = None if self._borrowed else self._channel
            if not self._borrowed:
                self._channel = self._stub = None
            return channel

    def close(self) -> None:
        channel = self.take()
        if channel is not None:
            channel.close()


# The unary calls a reads-only instance (``eplb serve --reads-only``) is for; WatchPlacements too.
READ_METHODS = frozenset({"GetPlacement", "GetDeployment", "ListDeployments"})


def is_read(step: Rpc | Watch) -> bool:
    """Whether ``step`` goes to the reads' endpoints (both faces route by this)."""
    return isinstance(step, Watch) or step.method in READ_METHODS


def read_endpoints(
    reads: str | Sequence[str] | Endpoints | None, endpoints: Endpoints, home_after_s: float = 30.0
) -> Endpoints:
    """Where reads go: ``endpoints`` itself when ``reads`` is None; ``reads`` when it is an
    ``Endpoints`` (shared, e.g. a ``ServiceClient``'s ``reads`` handed to a watcher); else the
    addresses of ``reads`` (reads-only instances, the ``home`` ones) followed by ``endpoints``'
    own, with its token, certificates and message size: reads fail over to the instances that
    take reports when no reads-only one answers, and go back to the reads-only ones
    ``home_after_s`` later (``Endpoints.homeward``; a watch reconnects there)."""
    if reads is None:
        return endpoints
    if isinstance(reads, Endpoints):
        if reads.aio != endpoints.aio:
            raise ValueError("reads= must be Endpoints of the same face (aio=) as the client's")
        return reads
    try:
        own = parse_addresses(reads)
    except ValueError:
        raise ValueError(f"reads= must name at least one host:port (or be None), got {reads!r}") from None
    if endpoints._borrowed:
        raise ValueError("reads= addresses need a client that owns its channels, not one over the caller's channel")
    out = Endpoints(
        own + tuple(a for a in endpoints.addresses if a not in own),
        root_certificates=endpoints._root_certificates,
        aio=endpoints.aio,
    )
    out.metadata, out._options = endpoints.metadata, endpoints._options
    out.home, out.home_after_s = len(own), home_after_s
    return out


class ServiceClient:
    """The sync face: calls to the balancer with failover between ``addresses`` and retries of
    transient failures for up to ``timeout_s`` per call (None: one attempt, no deadline).

    Errors that are the request's fault (``INVALID_ARGUMENT``, ``NOT_FOUND``,
    ``FAILED_PRECONDITION``, ``ALREADY_EXISTS``, auth) raise ``grpc.RpcError`` at once; bad
    arguments raise ``ValueError`` before anything is sent. ``AsyncServiceClient`` is the same
    client for a coroutine.

    ``reads``: addresses of reads-only instances (``eplb serve --reads-only``) that
    ``get_placement``, ``watch``, ``get_deployment`` and ``topology`` use first, then
    ``addresses`` (``eplb_engine.client.read_endpoints``); None: every call goes to ``addresses``.
    """

    def __init__(
        self,
        addresses: str | Sequence[str] | Endpoints,
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout_s: float | None = 10.0,
        max_message_bytes: int = 16 * 1024 * 1024,
        reads: str | Sequence[str] | Endpoints | None = None,
    ) -> None:
        if isinstance(addresses, Endpoints):
            self.endpoints, self._owned = addresses, False
        else:
            self.endpoints = Endpoints(
                addresses, token=token, root_certificates=root_certificates, max_message_bytes=max_message_bytes
            )
            self._owned = True
        self.reads = read_endpoints(reads, self.endpoints)
        self._owns_reads = reads is not None and not isinstance(reads, Endpoints)
        self.timeout_s = timeout_s
        self.calls = Calls(timeout_s, len(self.endpoints.addresses))

    def _on(self, step: Rpc | Watch) -> Endpoints:
        """The endpoints ``step`` goes to: the reads' for placements (back to a reads-only
        instance once it is time to try one again), the client's for the rest."""
        if is_read(step):
            old = self.reads.homeward()
            if old is not None:
                old.close()
            return self.reads
        return self.endpoints

    # -- running the steps ----------------------------------------------------------------

    def _run(self, ops: Ops[_T]) -> _T:
        answer = None
        while True:
            try:
                step = ops.send(answer)
            except StopIteration as done:
                return done.value
            answer = self._do(step)

    def _do(self, step: Step) -> Sent | None:
        if isinstance(step, Rpc):
            on = self._on(step)
            stub = on.stub()
            request = iter(step.request) if step.stream else step.request
            try:
                response = getattr(stub, step.method)(request, timeout=step.timeout_s, metadata=on.metadata)
            except grpc.RpcError as exc:
                return Sent(stub, error=exc)
            return Sent(stub, response)
        if isinstance(step, Health):
            stub = self.endpoints.stub()
            return Sent(stub, wire.check_health(self.endpoints.channel(), step.timeout_s))
        if isinstance(step, Watch):
            stub = self._on(step).stub()
            return Sent(stub, stub.WatchPlacements(step.request, metadata=self.reads.metadata))
        if isinstance(step, Read):
            try:
                return Sent(None, next(step.call, None))
            except grpc.RpcError as exc:
                return Sent(None, error=exc)
        if isinstance(step, Failover):
            # Only the endpoints whose stub it is move (the other's is a different stub).
            self.endpoints.failover(step.stub)
            if self.reads is not self.endpoints:
                self.reads.failover(step.stub)
        elif isinstance(step, Sleep):
            time.sleep(step.seconds)
        else:
            raise TypeError(f"not a step of a unary call: {step!r}")
        return None

    # -- the calls --------------------------------------------------------------------------

    def call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        """Calls unary ``method`` (e.g. ``"GetPlacement"``), failing over and retrying transient
        failures until ``timeout_s`` (default: the client's) has passed."""
        return self._run(self.calls.call(method, request, timeout_s))

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
        return self._run(self.calls.create_deployment(name, topology, initial, exist_ok, options))

    def get_deployment(self, name: str) -> pb.Deployment:
        return self._run(self.calls.get_deployment(name))

    def topology(self, name: str) -> eplb.Topology:
        return self._run(self.calls.topology(name))

    def get_placement(
        self, deployment: str, version: int = 0, topology: eplb.Topology | None = None
    ) -> wire.PublishedPlacement:
        """The current placement (``version`` 0) or a recent version, decoded."""
        return self._run(self.calls.get_placement(deployment, version, topology))

    def ack(
        self, deployment: str, rank: int, version: int, state: str = "switched", *, step: int = 0, error: str = ""
    ) -> pb.AckPlacementResponse:
        """Says where ``rank`` stands with ``version``: ``"prepared"``, ``"switched"`` or
        ``"failed"`` (with ``error``, cut to 1024 characters); returns the rollout as the service
        sees it (ranks prepared, switch step once all did, aborted)."""
        return self._run(self.calls.ack(deployment, rank, version, state, step, error))

    def rebalance(self, deployment: str, *, dry_run: bool = False, force: bool = False) -> pb.RebalanceResponse:
        return self._run(self.calls.rebalance(deployment, dry_run, force))

    def delete_deployment(self, name: str) -> None:
        self._run(self.calls.delete_deployment(name))

    def report(self, requests: Sequence[pb.ReportLoadRequest], timeout_s: float | None = None) -> pb.ReportLoadResponse:
        """Sends ``requests`` (``report_request``'s) in one ``ReportLoad`` stream, retried whole
        on a transient failure (their seqs make the retry count once). ``LoadReporter`` is the
        background reporter an engine step uses."""
        return self._run(self.calls.report(requests, timeout_s))

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether a replica answers the gRPC health check as SERVING: the current address
        first, then each other in turn (``timeout_s`` each); the first that does becomes the
        current address, as after a failover."""
        return self._run(self.calls.healthy(timeout_s))

    def watch(
        self, deployment: str, since_version: int = 0, topology: eplb.Topology | None = None, *, decode: bool = True
    ) -> Iterator[wire.PublishedPlacement]:
        """Each new version of ``deployment`` after ``since_version``, decoded (the wire
        ``Placement`` if not ``decode``), on the caller's thread; reconnects (at the next address
        after a transient failure) and resumes after the last version yielded, as
        ``AsyncServiceClient.watch``. ``PlacementWatcher`` is the background watcher an engine uses."""
        ops = self.calls.watch(deployment, since_version, topology, decode=decode)
        open_calls: list[object] = []
        answer = None
        try:
            while True:
                step = ops.send(answer)
                if isinstance(step, Deliver):
                    yield step.item
                    answer = None
                    continue
                answer = self._do(step)
                if isinstance(step, Watch):
                    for call in open_calls:
                        call.cancel()
                    open_calls = [answer.response]
        finally:
            for call in open_calls:
                call.cancel()
            ops.close()

    def close(self) -> None:
        if self._owned:
            self.endpoints.close()
        if self._owns_reads:
            self.reads.close()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
