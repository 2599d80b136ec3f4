"""A small engine-side client: report counters, watch placements, acknowledge them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

from eplb_wire import arrays
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

__all__ = ["EngineClient", "channel", "auth_metadata"]


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def channel(
    target: str, root_certificates: bytes | None = None, max_message_bytes: int = 16 * 1024 * 1024
) -> grpc.aio.Channel:
    """A channel with the service's message limit and keepalive pings every 30 s."""
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]
    if root_certificates is not None:
        return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=options)
    return grpc.aio.insecure_channel(target, options=options)


class EngineClient:
    """One engine rank of one deployment.

    ``seq`` starts at the current time in microseconds, so a restarted rank keeps increasing
    seqs (the service drops any ``seq <=`` the last one it accepted from the rank).
    """

    def __init__(self, chan: grpc.aio.Channel, deployment: str, rank: int, token: str | None = None) -> None:
        self.stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
        self.deployment = deployment
        self.rank = rank
        self.metadata = auth_metadata(token)
        self.seq = time.time_ns() // 1000

    def request(self, counts: np.ndarray, placement_version: int | None = None) -> pb.ReportLoadRequest:
        """``counts``: ``[L, E]`` logical, or ``[L, P]`` physical recorded under ``placement_version``."""
        self.seq += 1
        msg = pb.ReportLoadRequest(deployment=self.deployment, rank=self.rank, seq=self.seq)
        if placement_version is None:
            msg.logical.CopyFrom(arrays.encode(counts))
        else:
            msg.physical.counts.CopyFrom(arrays.encode(counts))
            msg.physical.placement_version = placement_version
        return msg

    async def report(self, batches: list[np.ndarray], placement_version: int | None = None) -> pb.ReportLoadResponse:
        """Streams ``batches`` of counts in one ``ReportLoad`` call."""
        requests = [self.request(c, placement_version) for c in batches]
        return await self.stub.ReportLoad(iter(requests), metadata=self.metadata)

    async def watch(self, since_version: int = 0) -> AsyncIterator[pb.Placement]:
        """Placements from the service, resuming after the last one seen if the stream breaks."""
        while True:
            try:
                call = self.stub.WatchPlacements(
                    pb.WatchPlacementsRequest(deployment=self.deployment, since_version=since_version),
                    metadata=self.metadata,
                )
                async for response in call:
                    since_version = response.placement.version
                    yield response.placement
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
                    raise
                await asyncio.sleep(0.5)

    async def ack(self, version: int) -> int:
        """Says this rank switched to ``version``; returns how many ranks have it."""
        return (await self.rollout(version, pb.ACK_STATE_SWITCHED)).ranks_acked

    async def rollout(self, version: int, state: int, step: int = 0, error: str = "") -> pb.AckPlacementResponse:
        """Says where this rank stands with ``version`` (``pb.ACK_STATE_PREPARED`` at engine step
        ``step``, ``SWITCHED`` or ``FAILED`` with ``error``); returns the version's rollout, with
        the switch step once every rank prepared."""
        return await self.stub.AckPlacement(
            pb.AckPlacementRequest(
                deployment=self.deployment, rank=self.rank, version=version, state=state, step=step, error=error
            ),
            metadata=self.metadata,
        )
