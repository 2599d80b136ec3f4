"""``eplb.v1.ExpertLoadBalancerService``: decode, call the balancer's part that serves the RPC, encode.
Errors map in ``errors.py``."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc
from eplb_wire.arrays import encode
from eplb_wire.parts import WATCH_PART_BYTES

from .auth import Access
from .balancer import Balancer
from .errors import FieldViolation, InvalidArgument, ReadsOnly, ServiceError
from .validation import check_name

# WatchPlacementsRequest.max_part_bytes: 0, or this range.
MIN_PART_BYTES = 4096
MAX_PART_BYTES = 4 << 20

__all__ = ["BalancerServicer", "add_to_server"]

log = logging.getLogger(__name__)

_M = TypeVar("_M")


def _libc_trim() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_MALLOC_TRIM = _libc_trim()
_trim_pending = False


def _trim_soon(delay_s: float = 0.5) -> None:
    """Gives freed heap back to the system shortly after watch streams end (at most every
    ``delay_s``): glibc keeps what a stream's placement messages took (1 MiB each, per stalled
    stream) in its arenas otherwise, and the RSS never comes down."""
    global _trim_pending
    if _MALLOC_TRIM is None or _trim_pending:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return

    def trim() -> None:
        global _trim_pending
        _trim_pending = False
        _MALLOC_TRIM(0)

    _trim_pending = True
    loop.call_later(delay_s, trim)


def _with_progress(exc: ServiceError, accepted: int, duplicates: int) -> ServiceError:
    """``exc`` for a report stream, saying how many of the stream's earlier reports were
    accepted and answered as duplicates: those are kept, and a client resends only the rest."""
    if accepted == 0 and duplicates == 0:
        return exc
    note = (
        f"the {accepted + duplicates} reports before it in this stream were kept ({accepted} accepted, "
        f"{duplicates} duplicates); resend only the failed report and those after it"
    )
    if isinstance(exc, InvalidArgument):
        return InvalidArgument([*exc.violations, FieldViolation("stream", note)])
    return type(exc)(f"{exc}; {note}")


# StreamLoad's two answers, built once: an ack a report.
_ACCEPTED = pb.ReportLoadAck(accepted=True)
_DUPLICATE = pb.ReportLoadAck(accepted=False)


class BalancerServicer(pb_grpc.ExpertLoadBalancerServiceServicer):
    def __init__(self, balancer: Balancer, access: Access | None = None) -> None:
        self.balancer = balancer
        # The collaborator each RPC calls (service/balancer.py).
        self.deployments = balancer.deployments
        self.ingest = balancer.ingest
        self.planner = balancer.planner
        self.compute = balancer.compute
        # None: no token configured, every caller may do everything.
        self.access = access
        # The latest response per (rpc, deployment), reused while the placement is the same
        # object: copying a v3-sized placement into a fresh response costs more than the call.
        self._responses: dict[tuple[Callable[..., Any], str], tuple[pb.Placement, Any]] = {}
        # The newest placement per deployment as a serialized WatchPlacementsResponse, shared by
        # every watch stream (a stream that does not read holds its message until it does: one
        # copy for all rather than one per stream; see add_to_server).
        self._wire: dict[str, tuple[pb.Placement, bytes]] = {}
        self._wire_parts: dict[tuple[str, int], tuple[pb.Placement, tuple[bytes, ...]]] = {}

    def _response(self, cls: Callable[..., _M], placement: pb.Placement) -> _M:
        key = (cls, placement.deployment)
        cached = self._responses.get(key)
        if cached is None or cached[0] is not placement:
            cached = self._responses[key] = (placement, cls(placement=placement))
        return cached[1]

    def _check(
        self, context: grpc.aio.ServicerContext, method: str, deployment: str | None = None, field: str = "deployment"
    ) -> None:
        """INVALID_ARGUMENT on ``field`` unless ``deployment`` is a valid name, then
        PERMISSION_DENIED unless the call's token may call ``method`` on it. The name comes
        first: nothing else (a refusal, a log line, a lookup) sees a name over its 64 characters."""
        if deployment is not None:
            check_name(deployment, field)
        if self.access is not None:
            self.access.check(context, method, deployment)

    async def CreateDeployment(
        self, request: pb.CreateDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateDeploymentResponse:
        self._check(context, "CreateDeployment", request.deployment.name, "deployment.name")
        return await self.deployments.create(request)

    async def GetDeployment(
        self, request: pb.GetDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetDeploymentResponse:
        self._check(context, "GetDeployment", request.name, "name")
        return await self.deployments.get(request.name)

    async def ListDeployments(
        self, request: pb.ListDeploymentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDeploymentsResponse:
        self._check(context, "ListDeployments")
        listed = await self.deployments.list()
        if self.access is None:
            return listed
        visible = self.access.visible(d.name for d in listed.deployments)
        # statuses[i] is deployments[i]'s: filtered together.
        kept = [i for i, d in enumerate(listed.deployments) if d.name in visible]
        return pb.ListDeploymentsResponse(
            deployments=[listed.deployments[i] for i in kept],
            statuses=[listed.statuses[i] for i in kept] if listed.statuses else [],
        )

    async def DeleteDeployment(
        self, request: pb.DeleteDeploymentRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteDeploymentResponse:
        self._check(context, "DeleteDeployment", request.name, "name")
        await self.deployments.delete(request.name)
        return pb.DeleteDeploymentResponse()

    async def _reports(
        self, method: str, request_iterator: AsyncIterator[pb.ReportLoadRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bool]:
        """A report stream's messages, one at a time, each checked and counted: True when
        accepted, False for a duplicate. A refused one ends the stream, saying what the reports
        before it came to (they are kept)."""
        if self.balancer.config.reads_only:
            raise ReadsOnly(
                "this instance serves reads only (eplb serve --reads-only) and takes no reports: "
                "send them to an instance that takes reports"
            )
        accepted = duplicates = 0
        async for request in request_iterator:
            try:
                # Per message: one stream may name several deployments, and a reload applies
                # to the next message.
                self._check(context, method, request.deployment)
                fresh = await self.ingest.report(request)
            except ServiceError as exc:
                raise _with_progress(exc, accepted, duplicates) from None
            accepted += fresh
            duplicates += not fresh
            yield fresh

    async def ReportLoad(
        self, request_iterator: AsyncIterator[pb.ReportLoadRequest], context: grpc.aio.ServicerContext
    ) -> pb.ReportLoadResponse:
        accepted = duplicates = 0
        async for fresh in self._reports("ReportLoad", request_iterator, context):
            accepted += fresh
            duplicates += not fresh
        return pb.ReportLoadResponse(accepted=accepted, duplicates=duplicates)

    async def StreamLoad(
        self, request_iterator: AsyncIterator[pb.ReportLoadRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ReportLoadAck]:
        """ReportLoad on a long-lived stream: each report answered, in order, once counted.

        One report at a time per stream, as ReportLoad: a rank's reports keep their seq order
        (one counted ahead of an earlier one would make that one a duplicate: lost), and the
        streams of many ranks and nodes are what the group commit batches."""
        async for fresh in self._reports("StreamLoad", request_iterator, context):
            yield _ACCEPTED if fresh else _DUPLICATE

    async def GetPlacement(
        self, request: pb.GetPlacementRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPlacementResponse:
        self._check(context, "GetPlacement", request.deployment)
        placement = await self.deployments.placement(request.deployment, request.version)
        if not request.include_window_loads:
            return self._response(pb.GetPlacementResponse, placement)
        loads, reports = await self.deployments.window_loads(request.deployment)
        return pb.GetPlacementResponse(placement=placement, window_loads=encode(loads), window_reports=reports)

    def _parts(self, placement: pb.Placement, size: int) -> tuple[bytes, ...]:
        """``WatchPlacementsResponse(part)`` of ``placement`` in parts of ``size`` bytes, serialized
        once per (version, size) for the newest version, as ``_serialized``."""
        key = (placement.deployment, size)
        cached = self._wire_parts.get(key)
        if cached is not None and cached[0] is placement:
            return cached[1]
        whole = placement.SerializeToString()
        count = max(1, -(-len(whole) // size))
        parts = tuple(
            pb.WatchPlacementsResponse(
                part=pb.PlacementPart(
                    version=placement.version, index=i, count=count, data=whole[i * size : (i + 1) * size]
                )
            ).SerializeToString()
            for i in range(count)
        )
        # Kept for the size eplb's watchers ask for only: a cache per size a client may name
        # would let clients fill the server with copies.
        if size == WATCH_PART_BYTES and (cached is None or placement.version >= cached[0].version):
            self._wire_parts[key] = (placement, parts)
        return parts

    def _serialized(self, placement: pb.Placement) -> bytes:
        """``WatchPlacementsResponse(placement)`` serialized, once per version for the newest."""
        cached = self._wire.get(placement.deployment)
        if cached is not None and cached[0] is placement:
            return cached[1]
        data = pb.WatchPlacementsResponse(placement=placement).SerializeToString()
        if cached is None or placement.version >= cached[0].version:
            self._wire[placement.deployment] = (placement, data)
        return data

    async def WatchPlacements(self, request: pb.WatchPlacementsRequest, context: grpc.aio.ServicerContext) -> None:
        # Written here rather than yielded: the write of a stream its client cancelled fails, and
        # grpc logs that at ERROR when it does the writing; here it only ends the stream. The
        # bytes are pre-serialized (add_to_server registers an identity serializer).
        self._check(context, "WatchPlacements", request.deployment)
        size = request.max_part_bytes
        if size and not MIN_PART_BYTES <= size <= MAX_PART_BYTES:
            raise InvalidArgument(
                FieldViolation(
                    "max_part_bytes", f"{size} is not 0 (whole placements) or {MIN_PART_BYTES} to {MAX_PART_BYTES}"
                )
            )
        placements = self.deployments.watch(request.deployment, request.since_version)
        if self.access is not None:
            # Ends the stream at once when a reload of the auth file revokes the token.
            placements = self.access.guard(context, "WatchPlacements", request.deployment, placements)
        try:
            async with contextlib.aclosing(placements):
                async for placement in placements:
                    try:
                        # Part by part: gRPC takes the next write only once the last is taken, so
                        # a watcher that stopped reading holds one part here, not a placement.
                        for data in self._parts(placement, size) if size else (self._serialized(placement),):
                            await context.write(data)
                    except (grpc.aio.AbortError, asyncio.CancelledError):
                        raise
                    except Exception as exc:  # noqa: BLE001  (the client went away: nothing to send to)
                        if not (context.cancelled() or context.done() or type(exc).__name__ == "ExecuteBatchError"):
                            raise
                        log.debug("watch of %s ended by its client: %s", request.deployment, exc)
                        return
        finally:
            _trim_soon()

    async def AckPlacement(
        self, request: pb.AckPlacementRequest, context: grpc.aio.ServicerContext
    ) -> pb.AckPlacementResponse:
        self._check(context, "AckPlacement", request.deployment)
        return await self.deployments.ack(request)

    async def Rebalance(self, request: pb.RebalanceRequest, context: grpc.aio.ServicerContext) -> pb.RebalanceResponse:
        self._check(context, "Rebalance", request.deployment)
        return await self.planner.rebalance(request, context.time_remaining())

    async def ComputePlacement(
        self, request: pb.ComputePlacementRequest, context: grpc.aio.ServicerContext
    ) -> pb.ComputePlacementResponse:
        self._check(context, "ComputePlacement")
        return await self.compute.placement(request, context.time_remaining())

    async def SetRanksDown(
        self, request: pb.SetRanksDownRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetRanksDownResponse:
        self._check(context, "SetRanksDown", request.deployment)
        return await self.deployments.set_ranks_down(request, context.peer(), context.time_remaining())


def _wire(message: object) -> bytes:
    """WatchPlacements' response serializer: bytes pass as they are (the servicer serialized
    them once for every stream), a message is serialized (another servicer's handler)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_to_server(servicer: BalancerServicer, server: grpc.aio.Server) -> None:
    """The generated ``add_ExpertLoadBalancerServiceServicer_to_server``, with WatchPlacements'
    response serializer :func:`_wire`, so its handler may yield pre-serialized bytes."""

    class _Registering:
        def add_generic_rpc_handlers(self, handlers: object) -> None:
            pass  # rebuilt below from the same method handlers

        def add_registered_method_handlers(self, name: str, handlers: dict) -> None:
            handlers = dict(handlers)
            handlers["WatchPlacements"] = handlers["WatchPlacements"]._replace(response_serializer=_wire)
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
            server.add_registered_method_handlers(name, handlers)

    pb_grpc.add_ExpertLoadBalancerServiceServicer_to_server(servicer, _Registering())
