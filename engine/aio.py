"""The asyncio face of the engine client, for engines whose control loop is a coroutine.

``AsyncServiceClient`` runs the same calls as ``ServiceClient`` (``client.Calls``: one
implementation of the requests, retries, failover, deadlines and decoding) on ``grpc.aio``
channels, so the two faces raise the same errors and follow the same rules; ``watch()`` is
``PlacementWatcher`` as an async iterator: decoded placements, resumed after the last version
yielded when the stream breaks or a replica goes away.

``LoadReporter`` needs no asyncio face: ``add`` never blocks, so a coroutine calls it as is
(and ``await asyncio.to_thread(reporter.flush)`` where it must wait for the service).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from . import wire
from .client import (
    Calls,
    Deliver,
    Endpoints,
    Failover,
    Health,
    Ops,
    Read,
    Rpc,
    Sent,
    Sleep,
    Step,
    Watch,
    is_read,
    read_endpoints,
)

__all__ = ["AsyncServiceClient"]

_T = TypeVar("_T")


class AsyncServiceClient:
    """Async calls to the balancer at ``addresses`` (one in use, the next after it fails), each
    retried on transient failures for up to ``timeout_s`` (None: one attempt, no deadline).

    ``AsyncServiceClient.over(channel)``: the caller's own ``grpc.aio`` channel, one address,
    never closed by the client.
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
            if not addresses.aio:
                raise ValueError("AsyncServiceClient needs Endpoints(..., aio=True): grpc.aio channels")
            self.endpoints = addresses
        else:
            self.endpoints = Endpoints(
                addresses,
                token=token,
                root_certificates=root_certificates,
                max_message_bytes=max_message_bytes,
                aio=True,
            )
        # GetPlacement and watch on reads-only instances first (ServiceClient's reads=).
        self.reads = read_endpoints(reads, self.endpoints)
        self._owns_reads = reads is not None and not isinstance(reads, Endpoints)
        self.timeout_s = timeout_s
        self.calls = Calls(timeout_s, len(self.endpoints.addresses))

    @classmethod
    def over(
        cls, channel: grpc.aio.Channel, *, token: str | None = None, timeout_s: float | None = None
    ) -> AsyncServiceClient:
        """A client on ``channel`` (the caller's; no failover); ``timeout_s`` None by default:
        one attempt per call, as a bare stub would make."""
        return cls(Endpoints.over(channel, token=token), timeout_s=timeout_s)

    @property
    def addresses(self) -> tuple[str, ...]:
        return self.endpoints.addresses

    @property
    def address(self) -> str:
        return self.endpoints.address

    @property
    def failovers(self) -> int:
        return self.endpoints.failovers

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.endpoints.metadata

    def stub(self) -> pb_grpc.ExpertLoadBalancerServiceStub:
        return self.endpoints.stub()

    # -- running the steps ----------------------------------------------------------------

    async def _run(self, ops: Ops[_T]) -> _T:
        answer = None
        while True:
            try:
                step = ops.send(answer)
            except StopIteration as done:
                return done.value
            answer = await self._do(step)

    async def _reading(self) -> Endpoints:
        """The reads' endpoints, back to a reads-only instance once it is time to try one again."""
        old = self.reads.homeward()
        if old is not None:
            await old.close()
        return self.reads

    async def _do(self, step: Step) -> Sent | None:
        if isinstance(step, Rpc):
            on = await self._reading() if is_read(step) else self.endpoints
            stub = on.stub()
            request = iter(step.request) if step.stream else step.request
            try:
                response = await getattr(stub, step.method)(request, timeout=step.timeout_s, metadata=on.metadata)
            except grpc.RpcError as exc:
                return Sent(stub, error=exc)
            return Sent(stub, response)
        if isinstance(step, Health):
            stub = self.endpoints.stub()
            try:
                response = await health_pb2_grpc.HealthStub(self.endpoints.channel()).Check(
                    health_pb2.HealthCheckRequest(service=wire.SERVICE_NAME), timeout=step.timeout_s
                )
            except grpc.RpcError:
                return Sent(stub, False)
            return Sent(stub, response.status == health_pb2.HealthCheckResponse.SERVING)
        if isinstance(step, Watch):
            stub = (await self._reading()).stub()
            return Sent(stub, stub.WatchPlacements(step.request, metadata=self.reads.metadata))
        if isinstance(step, Read):
            try:
                message = await step.call.read()
            except grpc.RpcError as exc:
                return Sent(None, error=exc)
            return Sent(None, None if message is grpc.aio.EOF else message)
        if isinstance(step, Failover):
            # Only the endpoints whose stub it is move (the other's is a different stub).
            for endpoints in (self.endpoints,) if self.reads is self.endpoints else (self.endpoints, self.reads):
                channel = endpoints.detach(step.stub)
                if channel is not None:
                    await channel.close()
        elif isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
        else:
            raise TypeError(f"not a step of a unary call: {step!r}")
        return None

    async def _stream(self, ops: Ops[None]) -> AsyncIterator[Any]:
        """Runs a streaming ``Calls`` method: what it delivers is yielded; its open stream is
        cancelled when it opens another or the caller stops iterating."""
        open_call = None
        answer = None
        try:
            while True:
                step = ops.send(answer)
                if isinstance(step, Deliver):
                    yield step.item
                    answer = None
                    continue
                answer = await self._do(step)
                if isinstance(step, Watch):
                    if open_call is not None:
                        open_call.cancel()
                    open_call = answer.response
        finally:
            if open_call is not None:
                open_call.cancel()
            ops.close()

    # -- the calls (as ``ServiceClient``'s) ---------------------------------------------------

    async def call(self, method: str, request: object, timeout_s: float | None = None) -> object:
        """Unary ``method``, failing over and retrying transient failures until ``timeout_s``."""
        return await self._run(self.calls.call(method, request, timeout_s))

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
        return await self._run(self.calls.create_deployment(name, topology, initial, exist_ok, options))

    async def get_deployment(self, name: str) -> pb.Deployment:
        return await self._run(self.calls.get_deployment(name))

    async def topology(self, name: str) -> eplb.Topology:
        return await self._run(self.calls.topology(name))

    async def get_placement(
        self, deployment: str, version: int = 0, topology: eplb.Topology | None = None
    ) -> wire.PublishedPlacement:
        return await self._run(self.calls.get_placement(deployment, version, topology))

    async def ack(
        self, deployment: str, rank: int, version: int, state: str = "switched", *, step: int = 0, error: str = ""
    ) -> pb.AckPlacementResponse:
        """As ``ServiceClient.ack``."""
        return await self._run(self.calls.ack(deployment, rank, version, state, step, error))

    async def rebalance(self, deployment: str, *, dry_run: bool = False, force: bool = False) -> pb.RebalanceResponse:
        return await self._run(self.calls.rebalance(deployment, dry_run, force))

    async def delete_deployment(self, name: str) -> None:
        await self._run(self.calls.delete_deployment(name))

    async def report(
        self, requests: Sequence[pb.ReportLoadRequest], timeout_s: float | None = None
    ) -> pb.ReportLoadResponse:
        """As ``ServiceClient.report``."""
        return await self._run(self.calls.report(requests, timeout_s))

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """As ``ServiceClient.healthy``: the current address first, then each other in turn;
        the first SERVING one becomes the current address."""
        return await self._run(self.calls.healthy(timeout_s))

    def watch(
        self, deployment: str, since_version: int = 0, topology: eplb.Topology | None = None, *, decode: bool = True
    ) -> AsyncIterator[wire.PublishedPlacement]:
        """Each new version of ``deployment`` after ``since_version``, decoded (the wire
        ``Placement`` if not ``decode``); reconnects (at the next address after a transient
        failure) and resumes after the last version yielded. Ends only when the caller stops
        iterating or with an error that is the request's fault."""
        return self._stream(self.calls.watch(deployment, since_version, topology, decode=decode))

    async def close(self) -> None:
        channel = self.endpoints.take()
        if channel is not None:
            await channel.close()
        if self._owns_reads:
            channel = self.reads.take()
            if channel is not None:
                await channel.close()

    async def __aenter__(self) -> AsyncServiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
