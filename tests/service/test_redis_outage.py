"""Redis stopped and restarted (empty: no persistence) during reports."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_helpers import report_some_load, small_deployment, timed

from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service.server import SERVICE_NAME
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb


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
    await report_some_load(ca.stub)
    for _ in range(2):
        await ca.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    watch = cb.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1"))
    assert (await watch.read()).placement.version == 3
    rank = AsyncServiceClient.over(ca.channel)
    loads = np.ones((4, 16), dtype=np.int32)
    assert (await rank.report(reports("d1", 0, [loads]))).accepted == 1
    assert await health_of(ca) == health_pb2.HealthCheckResponse.SERVING

    private_redis.stop()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await rank.report(reports("d1", 0, [loads]))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cb.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    await eventually(lambda: _is(health_of(ca), health_pb2.HealthCheckResponse.NOT_SERVING))

    private_redis.start()
    await eventually(lambda: _is(health_of(ca), health_pb2.HealthCheckResponse.SERVING))
    # Both instances write back what they had; the store is at version 3 again, nothing lost.
    got = await eventually(lambda: cb.stub.GetDeployment(pb.GetDeploymentRequest(name="d1")))
    assert got.deployment.version == 3
    assert (await rank.report(reports("d1", 0, [loads]))).accepted == 1
    nxt = await ca.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert nxt.published and nxt.placement.version == 4
    # The watcher on the other instance resumes by itself and sees the next version, no gap.
    assert (await asyncio.wait_for(watch.read(), 10)).placement.version == 4
    watch.cancel()


async def _is(coro, want: int) -> bool:
    return (await coro) == want


async def test_reads_are_served_from_memory_while_redis_is_down_and_nothing_is_ever_not_found(
    serve, connect, private_redis
):
    a = await serve(redis_url=private_redis.url, key_prefix="outage-reads")
    c = connect(a)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await report_some_load(c.stub)
    await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    await eventually(lambda: _placement_is(c, 2))
    rank = AsyncServiceClient.over(c.channel)
    loads = np.ones((4, 16), dtype=np.int32)

    private_redis.stop()
    try:
        await eventually(lambda: _is(health_of(c), health_pb2.HealthCheckResponse.NOT_SERVING))
        # The current placement is in this instance's memory: reads go on.
        got = await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"), timeout=2)
        assert got.placement.version == 2
        # Writes fail at once instead of waiting on Redis.
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await rank.report(reports("d1", 0, [loads]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 0.5
    finally:
        private_redis.start()  # empty: no persistence
    # Straight after the empty restart, before any health tick wrote the state back: the
    # instance knows d1, so it never answers NOT_FOUND.
    got = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert got.deployment.version == 2
    got = await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))
    assert got.placement.version == 2


async def _placement_is(c, version: int) -> bool:
    return (await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))).placement.version == version


async def test_a_hung_redis_costs_a_call_one_socket_timeout(serve, connect, private_redis):
    # SIGSTOP: the socket stays open and nothing answers. Timeouts used to be retried three
    # times, so every store call waited 4.1 s.
    a = await serve(redis_url=private_redis.url, key_prefix="outage-hung")
    c = connect(a)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    private_redis.proc.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.ListDeployments(pb.ListDeploymentsRequest(), timeout=10)
        took = time.monotonic() - start
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert took < 2.5, f"{took:.2f}s"
        # Once health has noticed, writes and plans fail at once (they waited 1 s each).
        await eventually(lambda: _is(health_of(c), health_pb2.HealthCheckResponse.NOT_SERVING))
        calls = {
            "create": lambda: c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("d2"))),
            "rebalance": lambda: c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True)),
            "ack": lambda: c.stub.AckPlacement(pb.AckPlacementRequest(deployment="d1", rank=0, version=1)),
            "delete": lambda: c.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="d1")),
        }
        for what, call in calls.items():
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call()
            took = time.monotonic() - start
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (what, info.value.details())
            assert took < 0.5, (what, took)
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
    await eventually(lambda: _is(health_of(c), health_pb2.HealthCheckResponse.SERVING))
    got = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert got.deployment.version == 1


async def test_a_hung_redis_fails_every_call_within_one_socket_timeout(serve, connect, private_redis):
    # Every RPC at once, before health notices: each waited its own timeouts (ReportLoad queued
    # behind a batch in flight 2 s, SetRanksDown and Rebalance 4-5 s, one store call after another).
    c = connect(await serve(redis_url=private_redis.url, key_prefix="outage-hung-all"))
    for n in ("d1", "d2"):
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(n)))
        await report_some_load(c.stub, n)
        await c.stub.Rebalance(pb.RebalanceRequest(deployment=n, force=True))
    loads = np.ones((4, 16), dtype=np.int32)
    s = c.stub
    private_redis.proc.send_signal(signal.SIGSTOP)
    try:
        calls = {
            "GetDeployment": s.GetDeployment(pb.GetDeploymentRequest(name="d1")),
            "GetPlacement(window)": s.GetPlacement(pb.GetPlacementRequest(deployment="d1", include_window_loads=True)),
            "AckPlacement": s.AckPlacement(pb.AckPlacementRequest(deployment="d1", rank=0, version=2)),
            "Rebalance": s.Rebalance(pb.RebalanceRequest(deployment="d1", force=True)),
            "SetRanksDown": s.SetRanksDown(pb.SetRanksDownRequest(deployment="d1", down=[7])),
            "CreateDeployment": s.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("d3"))),
            "DeleteDeployment": s.DeleteDeployment(pb.DeleteDeploymentRequest(name="d2")),
            "ListDeployments": s.ListDeployments(pb.ListDeploymentsRequest()),
            **{
                f"ReportLoad(rank {r})": AsyncServiceClient.over(c.channel).report(reports("d1", r, [loads]))
                for r in range(4)
            },
        }
        tasks = {what: asyncio.create_task(timed(call)) for what, call in calls.items()}
        await asyncio.sleep(0.5)  # these queue behind the first reports' batch in flight
        later = {
            f"ReportLoad(rank {r}, later)": asyncio.create_task(
                timed(AsyncServiceClient.over(c.channel).report(reports("d1", r, [loads])))
            )
            for r in range(4, 8)
        }
        served = await timed(s.GetPlacement(pb.GetPlacementRequest(deployment="d1")))  # from memory
        for what, task in {**tasks, **later}.items():
            code, took = await task
            assert code == grpc.StatusCode.UNAVAILABLE and took <= 1.5, (what, code.name, f"{took:.2f}s")
        assert served[0] == grpc.StatusCode.OK and served[1] < 0.5, served
    finally:
        private_redis.proc.send_signal(signal.SIGCONT)
    await eventually(lambda: _accepted(c, loads))
    got = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert got.deployment.version == 2


async def _accepted(c, loads: np.ndarray) -> bool:
    return (await AsyncServiceClient.over(c.channel).report(reports("d1", 0, [loads]))).accepted == 1
