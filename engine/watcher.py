"""``PlacementWatcher``: follows a deployment's published placements in a background thread.

It holds a ``WatchPlacements`` stream, decodes each version to an ``eplb.Placement`` and calls
the engine's callback with it. When the stream breaks (a replica restarts, the network drops,
a replica is drained) it reconnects, at the next address if the one in use is unreachable,
and resumes after the last version it handed on (``since_version``), so no version is
delivered twice and none is skipped unless the service itself coalesced versions for a slow
watcher (the latest wins). With a ``rank`` and ``ack=True`` it acknowledges a version as
switched only after the callback returned, and as failed (with the error) when it raised.
An engine that applies placements through ``Rollout`` passes ``ack=False``: the rollout acks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import grpc

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.parts import WATCH_PART_BYTES, PartAssembler

from . import wire
from .client import Backoff, Endpoints, ServiceClient, transient

__all__ = ["PlacementWatcher"]

log = logging.getLogger(__name__)

# The service refused the caller's credentials: the same token would be refused again.
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# Each attempt to reach the service: short, so that a service that is down is said so (and
# retried, at the next address) within a second, not after the client's 10 s of retries.
_ATTEMPT_S = 1.0


class PlacementWatcher:
    """Calls ``callback(PublishedPlacement)`` for each new version of ``deployment``.

    ``since_version``: versions up to it are not delivered (0: the current one first). The
    callback runs on the watcher's thread; keep it short (hand the placement to the engine's
    step loop, e.g. ``Rollout.offer``). ``version`` is the last version handed on.

    A token the service refuses (``UNAUTHENTICATED``, ``PERMISSION_DENIED``) will not get
    better by retrying: the watcher stops, logs it once and keeps it in ``last_error``, and
    ``gave_up`` is True. Any other failure is retried (a missing deployment may be created):
    ``last_error`` says why the watcher is not connected ("" once it is again; a service that
    is down reads ``UNAVAILABLE: ...`` within a second), ``connected`` whether the last call
    reached the service, ``reconnects`` counts the attempts after a failure, and a WARNING is
    logged on the first failure of an outage and one on recovery (not one per attempt).
    """

    def __init__(
        self,
        addresses: str | Sequence[str] | Endpoints,
        deployment: str,
        callback: Callable[[wire.PublishedPlacement], object],
        *,
        topology: eplb.Topology | None = None,
        rank: int | None = None,
        ack: bool = True,
        since_version: int = 0,
        token: str | None = None,
        start: bool = True,
        reads: str | Sequence[str] | Endpoints | None = None,
    ) -> None:
        if isinstance(addresses, Endpoints):
            self.endpoints, self._owned = addresses, False
        else:
            self.endpoints, self._owned = Endpoints(addresses, token=token), True
        # The watch on reads-only instances first, the acks to ``addresses`` (ServiceClient's reads=).
        self.client = ServiceClient(self.endpoints, reads=reads)
        self.watching = self.client.reads
        self._homing = False  # the watch at a fallback address was ended to go back to a reads-only one
        self.deployment, self.callback, self.topology = deployment, callback, topology
        self.rank, self.ack = rank, ack and rank is not None
        self.version = since_version
        self.delivered = 0
        self.failed = 0
        self.reconnects = 0
        self.last_error = ""
        self.connected = False
        self.gave_up = False
        self._failing = False  # in an outage: its first failure was logged, recovery not yet
        self._outage_from = 0  # reconnects when the outage began
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name=f"eplb-watcher-{deployment}", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def wait_for(self, version: int, timeout_s: float = 10.0) -> bool:
        """Waits until a version >= ``version`` was handed on; False on timeout (at once if the
        watcher gave up)."""
        with self._changed:
            return self._changed.wait_for(lambda: self.version >= version or self.gave_up, timeout_s) and (
                self.version >= version
            )

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        self.client.close()  # the reads' endpoints, where the watcher opened them
        if self._owned:
            self.endpoints.close()

    def __enter__(self) -> PlacementWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        backoff = Backoff()
        while not self._stop.is_set():
            old = self.watching.homeward()  # back to a reads-only instance, when it is time
            if old is not None:
                old.close()
            stub = self.watching.stub()
            home = None
            try:
                if self.topology is None or self._failing:
                    # A round trip before the stream, which may send nothing for a while: it
                    # says whether the service is reachable again (and tells the topology).
                    reply = self.client.call(
                        "GetDeployment", pb.GetDeploymentRequest(name=self.deployment), timeout_s=_ATTEMPT_S
                    )
                    if self.topology is None:
                        self.topology = wire.topology_from_pb(reply.deployment.topology)
                    self._recovered()
                    stub = self.watching.stub()  # the call may have moved to another address
                self._call = stub.WatchPlacements(
                    pb.WatchPlacementsRequest(
                        deployment=self.deployment, since_version=self.version, max_part_bytes=WATCH_PART_BYTES
                    ),
                    metadata=self.watching.metadata,
                )
                if self.watching.away():
                    # At a fallback address: end this watch when a reads-only one may answer again.
                    home = threading.Timer(self.watching.home_after_s, self._go_home, (self._call,))
                    home.daemon = True
                    home.start()
                parts = PartAssembler()
                for response in self._call:
                    backoff.reset()
                    self._recovered()
                    placement = parts.feed(response)
                    if placement is not None:
                        self._deliver(placement)
                    if self._stop.is_set():
                        return
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                if self._homing:
                    self._homing = False
                    continue  # reconnects at once, at the reads-only instance (homeward)
                self.last_error = f"{exc.code().name}: {exc.details()}"
                self.connected = False
                if transient(exc):
                    if not self._failing:
                        self._outage_from = self.reconnects
                        log.warning(
                            "watching %s at %s: %s; retrying until it answers",
                            self.deployment,
                            self.watching.address,
                            self.last_error,
                        )
                    self._failing = True
                    self.watching.failover(stub)
                elif exc.code() in _REFUSED:
                    log.error("watching %s: %s; not retrying with this token", self.deployment, self.last_error)
                    self.gave_up = True
                    with self._changed:
                        self._changed.notify_all()
                    return
                else:
                    # Not the network's fault (deployment missing, a server failure): retry at
                    # the same address, keep saying why.
                    log.warning("watching %s: %s", self.deployment, self.last_error)
                    if not self._failing:
                        self._outage_from = self.reconnects
                    self._failing = True
            finally:
                if home is not None:
                    home.cancel()
            self.reconnects += 1
            self._stop.wait(backoff.delay())

    def _go_home(self, call: object) -> None:
        """Ends ``call`` (the watch at a fallback address) if it is still the one running, so
        that the watcher reconnects at a reads-only instance (it resumes after its version)."""
        if call is self._call and not self._stop.is_set():
            self._homing = True
            call.cancel()

    def _recovered(self) -> None:
        """A call reached the service: the end of an outage, if in one (logged once)."""
        if self._failing:
            attempts = self.reconnects - self._outage_from
            log.warning(
                "watching %s: reached %s again after %d attempt%s",
                self.deployment,
                self.watching.address,
                attempts,
                "" if attempts == 1 else "s",
            )
        self._failing = False
        self.connected = True
        self.last_error = ""

    def _deliver(self, msg: pb.Placement) -> None:
        if msg.version <= self.version:
            return
        error = ""
        try:
            self.callback(wire.placement_from_pb(msg, self.topology))
        except Exception as exc:  # a placement that does not decode, or the engine's failure: reported, not fatal
            log.exception("placement callback failed on version %d of %s", msg.version, self.deployment)
            error = f"{type(exc).__name__}: {exc}"
            self.failed += 1
        with self._changed:
            self.version = msg.version
            self.delivered += 1
            self._changed.notify_all()
        if self.ack and self.rank in msg.down_ranks:
            # A rank down in this version takes no part in its rollout (the service refuses its
            # acks); it is planned in again by SetRanksDown(up=[rank]).
            log.info("rank %d is down in version %d of %s: not acking it", self.rank, msg.version, self.deployment)
        elif self.ack:
            try:
                self.client.ack(self.deployment, self.rank, msg.version, "failed" if error else "switched", error=error)
            except grpc.RpcError as exc:
                log.warning("ack of version %d failed: %s", msg.version, exc.details())
