"""The asyncio face of the engine client, for engines whose control loop is a coroutine.

``AsyncServiceClient`` makes the same unary calls as ``ServiceClient`` (with the same
failover between addresses and retries of transient failures) on ``grpc.aio`` channels, and
``watch()`` is ``PlacementWatcher`` as an async iterator: decoded placements, resumed after
the last version yielded when the stream breaks or a replica goes away.

``LoadReporter`` needs no asyncio face: ``add`` never blocks, so a coroutine calls it as is
(and ``await asyncio.to_thread(reporter.flush)`` where it must wait for the service).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from . import wire
from .client import (
    EXISTING_OK,
    TRANSIENT,
    Backoff,
    Retry,
    ack_request,
    channel_options,
    create_request,
    parse_addresses,
    same_topology,
)

__all__ = ["AsyncServiceClient"]


class AsyncServiceClient:
    """Async calls to the balancer at ``addresses`` (one in use, the next after it fails)."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        token: str | None = None,
        root_certificates: bytes | None = None,
        timeout_s: float = 10.0,
        max_message_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        self.addresses = parse_addresses(addresses)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout_s = timeout_s
        self._root_certificates = root_certificates
        self._options = channel_options(max_message_bytes)
        self._index = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ExpertLoadBalancerServiceStub | None = None
        self.failovers = 0

    @property
    def address(self) -> str:
        return self.addresses[self._index]

    def stub(self) -> pb_grpc.ExpertLoadBalancerServiceStub:
        if self._stub is None:
            target = self.addresses[self._index]
            if self._root_certificates is not None:
                creds = grpc.ssl_channel_credentials(self._root_certificates)
                self._channel = grpc.aio.secure_channel(target, creds, options=self._options)
            else:
                self._channel = grpc.aio.insecure_channel(target, options=self._options)
            self._stub = pb_grpc.ExpertLoadBalancerServiceStub(self._channel)
        return self._stub

    async def failover(self, failed: pb_grpc.ExpertLoadBalancerServiceStub) -> None:
        """The call made on ``failed`` could not reach its replica: use the next address."""
        if failed is not self._stub:
            return
        channel, self._channel, self._stub = self._channel, None, None
        self._index = (self._index + 1) % len(self.addresses)
        self.failovers += 1
        await channel.close()

    async def call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        """Unary ``method``, failing over and retrying transient failures until ``timeout_s``."""
        retry = Retry(self.timeout_s if timeout_s is None else timeout_s)
        while True:
            stub = self.stub()
            try:
                return await getattr(stub, method)(request, timeout=retry.attempt_timeout(), metadata=self.metadata)
            except grpc.aio.AioRpcError as exc:
                if not retry.retryable(exc.code()):
                    raise
                await self.failover(stub)
                await asyncio.sleep(retry.pause_s())

    async def create_deployment(
        self,
        name: str,
        topology: eplb.Topology,
        *,
        initial: eplb.Placement | None = None,
        exist_ok: bool = False,
        **options: object,
    ) -> pb.Deployment:
        """As ``ServiceClient.create_deployment``."""
        try:
            return (await self.call("CreateDeployment", create_request(name, topology, initial, options))).deployment
        except grpc.aio.AioRpcError as exc:
            if not (exist_ok and exc.code() in EXISTING_OK):
                raise
            refused = exc
        try:
            existing = await self.get_deployment(name)
        except grpc.aio.AioRpcError:
            raise refused from None
        return same_topology(name, existing, topology)

    async def get_deployment(self, name: str) -> pb.Deployment:
        return (await self.call("GetDeployment", pb.GetDeploymentRequest(name=name))).deployment

    async def topology(self, name: str) -> eplb.Topology:
        return wire.topology_from_pb((await self.get_deployment(name)).topology)

    async def get_placement(
        self, deployment: str, version: int = 0, topology: eplb.Topology | None = None
    ) -> wire.PublishedPlacement:
        msg = (
            await self.call("GetPlacement", pb.GetPlacementRequest(deployment=deployment, version=version))
        ).placement
        return wire.placement_from_pb(msg, topology or await self.topology(deployment))

    async def ack(
        self, deployment: str, rank: int, version: int, state: str = "switched", *, step: int = 0, error: str = ""
    ) -> pb.AckPlacementResponse:
        """As ``ServiceClient.ack``."""
        return await self.call("AckPlacement", ack_request(deployment, rank, version, state, step, error))

    async def rebalance(self, deployment: str, *, dry_run: bool = False, force: bool = False) -> pb.RebalanceResponse:
        return await self.call("Rebalance", pb.RebalanceRequest(deployment=deployment, dry_run=dry_run, force=force))

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """As ``ServiceClient.healthy``: the current address first, then each other in turn;
        the first SERVING one becomes the current address."""
        for _ in range(len(self.addresses)):
            stub = self.stub()
            try:
                response = await health_pb2_grpc.HealthStub(self._channel).Check(
                    health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=timeout_s
                )
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            await self.failover(stub)
        return False

    async def watch(
        self, deployment: str, since_version: int = 0, topology: eplb.Topology | None = None
    ) -> AsyncIterator[wire.PublishedPlacement]:
        """Each new version of ``deployment`` after ``since_version``, decoded; reconnects (at the
        next address after a transient failure) and resumes after the last version yielded.
        Ends only when the caller stops iterating or with an error that is the request's fault."""
        backoff = Backoff()
        version = since_version
        while True:
            stub = self.stub()
            try:
                if topology is None:
                    topology = await self.topology(deployment)
                call = stub.WatchPlacements(
                    pb.WatchPlacementsRequest(deployment=deployment, since_version=version), metadata=self.metadata
                )
                try:
                    async for response in call:
                        backoff.reset()
                        if response.placement.version > version:
                            published = wire.placement_from_pb(response.placement, topology)
                            version = published.version
                            yield published
                finally:
                    call.cancel()
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in TRANSIENT:
                    raise
                await self.failover(stub)
            await asyncio.sleep(backoff.delay())

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None

    async def __aenter__(self) -> AsyncServiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
