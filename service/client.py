"""Deprecated: the engine side's client is ``eplb_engine`` (``AsyncServiceClient``, ``ServiceClient``).

``EngineClient`` and ``channel()`` stay for one release as thin aliases over
``eplb_engine.aio.AsyncServiceClient`` (the one client implementation, ``eplb_engine.client.Calls``);
each warns with a ``DeprecationWarning`` naming its replacement.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import AsyncIterator

import grpc
import numpy as np

from eplb_engine.aio import AsyncServiceClient
from eplb_engine.client import auth_metadata, channel_options, open_channel, report_request
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

__all__ = ["EngineClient", "channel", "auth_metadata"]


def channel(
    target: str, root_certificates: bytes | None = None, max_message_bytes: int = 16 * 1024 * 1024
) -> grpc.aio.Channel:
    """Deprecated: ``eplb_engine.AsyncServiceClient(target)`` opens (and fails over) its own
    channels. A ``grpc.aio`` channel with the engine client's options (message limit, keepalive
    pings every 30 s, quick reconnects)."""
    warnings.warn(
        "eplb_service.client.channel() is deprecated: use eplb_engine.AsyncServiceClient(addresses), which opens "
        "its own channels (or eplb_engine.client.open_channel for a bare one)",
        DeprecationWarning,
        stacklevel=2,
    )
    return open_channel(target, root_certificates, channel_options(max_message_bytes), aio=True)


class EngineClient:
    """Deprecated: use ``eplb_engine.AsyncServiceClient``. One engine rank of one deployment,
    over ``eplb_engine.AsyncServiceClient.over(chan)``: one attempt per call, no deadline.

    ``seq`` starts at the current time in microseconds, so a restarted rank keeps increasing
    seqs (the service drops any ``seq <=`` the last one it accepted from the rank).
    """

    def __init__(self, chan: grpc.aio.Channel, deployment: str, rank: int, token: str | None = None) -> None:
        warnings.warn(
            "eplb_service.client.EngineClient is deprecated: use eplb_engine.AsyncServiceClient "
            "(report, watch, ack with deployment and rank)",
            DeprecationWarning,
            stacklevel=2,
        )
        self.client = AsyncServiceClient.over(chan, token=token)
        self.stub = self.client.stub()
        self.deployment = deployment
        self.rank = rank
        self.metadata = self.client.metadata
        self.seq = time.time_ns() // 1000

    def request(self, counts: np.ndarray, placement_version: int | None = None) -> pb.ReportLoadRequest:
        """``counts``: ``[L, E]`` logical, or ``[L, P]`` physical recorded under ``placement_version``."""
        self.seq += 1
        return report_request(self.deployment, self.rank, self.seq, counts, placement_version)

    async def report(self, batches: list[np.ndarray], placement_version: int | None = None) -> pb.ReportLoadResponse:
        """Streams ``batches`` of counts in one ``ReportLoad`` call."""
        return await self.client.report([self.request(c, placement_version) for c in batches])

    async def watch(self, since_version: int = 0) -> AsyncIterator[pb.Placement]:
        """Placements from the service (wire messages), resuming after the last one seen if the stream breaks."""
        async for placement in self.client.watch(self.deployment, since_version, decode=False):
            yield placement

    async def ack(self, version: int) -> int:
        """Says this rank switched to ``version``; returns how many ranks have it."""
        return (await self.rollout(version, pb.ACK_STATE_SWITCHED)).ranks_acked

    async def rollout(self, version: int, state: int, step: int = 0, error: str = "") -> pb.AckPlacementResponse:
        """Says where this rank stands with ``version`` (``pb.ACK_STATE_PREPARED`` at engine step
        ``step``, ``SWITCHED`` or ``FAILED`` with ``error``); returns the version's rollout, with
        the switch step once every rank prepared."""
        request = pb.AckPlacementRequest(
            deployment=self.deployment, rank=self.rank, version=version, state=state, step=step, error=error
        )
        return await self.client.call("AckPlacement", request)
