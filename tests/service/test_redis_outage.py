"""Redis stopped and restarted (empty: no persistence) during reports."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from eplb_service._gen.eplb.v1 import balancer_pb2 as pb
from eplb_service.client import EngineClient
from eplb_service.server import SERVICE_NAME
from svc_helpers import small_deployment


async def health_of(c) -> int:
    stub = health_pb2_grpc.HealthStub(c.channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))).status


async def eventually(fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            out = await fn()
            if out:
                return out
        except grpc.aio.AioRpcError:
            pass
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_redis_restart_loses_no_committed_placement(serve, connect, private_redis):
    a = await serve(redis_url=private_redis.url, key_prefix="outage")
    b = await serve(redis_url=private_redis.url, key_prefix="outage")
    ca, cb = connect(a), connect(b)
    await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    for _ in range(2):
        await ca.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    watch = cb.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1"))
    assert (await watch.read()).placement.version == 3
    rank = EngineClient(ca.channel, "d1", rank=0)
    loads = np.ones((4, 16), dtype=np.int32)
    assert (await rank.report([loads])).accepted == 1
    assert await health_of(ca) == health_pb2.HealthCheckResponse.SERVING

    private_redis.stop()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await rank.report([loads])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cb.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    await eventually(lambda: _is(health_of(ca), health_pb2.HealthCheckResponse.NOT_SERVING))

    private_redis.start()
    await eventually(lambda: _is(health_of(ca), health_pb2.HealthCheckResponse.SERVING))
    # Both replicas write back what they had; the store is at version 3 again, nothing lost.
    got = await eventually(lambda: cb.stub.GetDeployment(pb.GetDeploymentRequest(name="d1")))
    assert got.deployment.version == 3
    assert (await rank.report([loads])).accepted == 1
    nxt = await ca.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert nxt.published and nxt.placement.version == 4
    # The watcher on the other replica resumes by itself and sees the next version, no gap.
    assert (await asyncio.wait_for(watch.read(), 10)).placement.version == 4
    watch.cancel()


async def _is(coro, want: int) -> bool:
    return (await coro) == want
