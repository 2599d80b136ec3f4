"""The asyncio face against a real service: calls, a watch that survives a restart, failover."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from svc_thread import REDIS_URL, ServerThread, free_port, report_some_load

import eplb
from eplb_engine.aio import AsyncServiceClient

TOPO = eplb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)


async def test_calls_and_a_watch_that_resumes_after_a_restart(prefix):
    server = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()
    try:
        async with AsyncServiceClient(server.address, timeout_s=15) as client:
            assert await client.healthy()
            await client.create_deployment("d1", TOPO, window_s=30)
            assert (await client.create_deployment("d1", TOPO, exist_ok=True)).name == "d1"
            current = await client.get_placement("d1")
            assert current.version == 1 and current.placement == eplb.Placement.contiguous(TOPO)
            watch = client.watch("d1")
            assert (await asyncio.wait_for(anext(watch), 5)).version == 1
            await asyncio.to_thread(report_some_load, server.address)
            await client.rebalance("d1", force=True)
            assert (await asyncio.wait_for(anext(watch), 5)).version == 2
            await asyncio.to_thread(server.stop, 0.5)
            await asyncio.to_thread(server.start)
            await asyncio.to_thread(report_some_load, server.address)
            await client.rebalance("d1", force=True)
            third = await asyncio.wait_for(anext(watch), 15)
            assert third.version == 3 and third.placement.phy2log.shape == (4, 24)
            reply = await client.ack("d1", rank=1, version=3)
            assert reply.ranks_acked == 1
            await watch.aclose()
    finally:
        server.stop()


async def test_failover_to_the_second_address(prefix):
    a = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()
    b = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()
    try:
        async with AsyncServiceClient([a.address, b.address], timeout_s=15) as client:
            await client.create_deployment("d1", TOPO)
            await asyncio.to_thread(report_some_load, b.address)
            watch = client.watch("d1")
            assert (await asyncio.wait_for(anext(watch), 5)).version == 1
            await asyncio.to_thread(a.stop, 0.5)
            await client.rebalance("d1", force=True)
            assert (await asyncio.wait_for(anext(watch), 15)).version == 2
            assert client.address == b.address and client.failovers >= 1
            await watch.aclose()
    finally:
        a.stop()
        b.stop()


async def test_unreachable_service_is_unhealthy_and_calls_give_up_at_their_deadline():
    client = AsyncServiceClient(f"127.0.0.1:{free_port()}", timeout_s=0.5)
    assert not await client.healthy(timeout_s=0.3)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await client.get_deployment("d1")
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    await client.close()
