"""``eplb_service.client`` (EngineClient, channel()) is a deprecated alias of the engine's
client for one release: it warns, names the replacement, and runs on AsyncServiceClient."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from svc_thread import ServerThread

import eplb
from eplb_engine.aio import AsyncServiceClient
from eplb_engine.client import ServiceClient
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)


async def test_engine_client_and_channel_warn_and_run_on_the_engine_client():
    from eplb_service.client import EngineClient, channel

    server = await asyncio.to_thread(ServerThread().start)
    try:
        with ServiceClient(server.address) as admin:
            await asyncio.to_thread(admin.create_deployment, "d1", TOPO)
        with pytest.warns(DeprecationWarning, match=r"channel\(\) is deprecated: use eplb_engine.AsyncServiceClient"):
            chan = channel(server.address)
        with pytest.warns(DeprecationWarning, match="EngineClient is deprecated: use eplb_engine.AsyncServiceClient"):
            rank = EngineClient(chan, "d1", rank=3)
        assert isinstance(rank.client, AsyncServiceClient) and rank.client.timeout_s is None
        out = await rank.report([np.ones((4, 16), np.int32)] * 2)
        assert (out.accepted, out.duplicates) == (2, 0)
        watch = rank.watch()
        first = await asyncio.wait_for(anext(watch), 10)
        await watch.aclose()
        assert isinstance(first, pb.Placement) and first.version == 1
        assert await rank.ack(1) == 1
        # One attempt, the request's error as a bare stub gave it.
        with pytest.warns(DeprecationWarning, match="EngineClient is deprecated"):
            nope = EngineClient(chan, "nope", rank=0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await nope.report([np.ones((4, 16), np.int32)])
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        await rank.client.close()  # the caller's channel stays open
        with pytest.warns(DeprecationWarning, match="EngineClient is deprecated"):
            other = EngineClient(chan, "d1", rank=4)
        assert (await other.report([np.ones((4, 16), np.int32)])).accepted == 1
        await chan.close()
    finally:
        await asyncio.to_thread(server.stop)
