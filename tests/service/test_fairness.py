"""One tenant must not slow another: a small deployment's re-plan does not wait behind a large
one's (the small-plan lane, service/solver.py), and a watcher that does not read costs at most
one pending placement (service/hub.py). Real servers on 127.0.0.1, real channels."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import grpc
import numpy as np
import pytest
from svc_helpers import FAST, small_deployment

from eplb import limits
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service.cli import parse_args
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

# 32 layers x 8192 slots = 2^18 cells, the smallest plan the lane refuses: a few seconds to
# plan, where the small deployment's 4 x 24 takes milliseconds.
BIG = pb.Topology(num_layers=32, num_experts=8192, num_slots=8192, num_gpus=4096, num_nodes=512, num_groups=1)


def config(**kw: object):
    return replace(FAST, replica_id=uuid.uuid4().hex[:8], **kw)


async def report(c, name: str, shape: tuple[int, int], seed: int) -> None:
    loads = np.random.default_rng(seed).integers(0, 1000, size=shape).astype(np.int32)
    assert (await AsyncServiceClient.over(c.channel).report(reports(name, 0, [loads]))).accepted == 1


async def small_waits_for_big(serve, connect, small_plan_workers: int) -> bool:
    """A forced re-plan of a large deployment holds the only re-plan worker; then a small one's:
    True when the large one had finished by the time the small one returned."""
    assert BIG.num_layers * BIG.num_slots >= limits.SMALL_PLAN_CELLS
    server = await serve(balancer=config(plan_workers=1, small_plan_workers=small_plan_workers))
    c = connect(server)
    big = pb.Deployment(name="big", topology=BIG, policy="auto")
    for d in (big, small_deployment("small")):
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    await report(c, "big", (BIG.num_layers, BIG.num_experts), 1)
    await report(c, "small", (4, 16), 2)
    await asyncio.sleep(0.3)  # flushed (flush_s 0.1)
    # Warm: the worker the small re-plan will use is started (a spawn takes a second or so).
    assert (await c.stub.Rebalance(pb.RebalanceRequest(deployment="small", force=True))).published
    planning_big = asyncio.ensure_future(c.stub.Rebalance(pb.RebalanceRequest(deployment="big", force=True)))
    await asyncio.sleep(1.0)  # the large plan has reached its worker (its own start and a plan: seconds)
    assert not planning_big.done()
    small = await c.stub.Rebalance(pb.RebalanceRequest(deployment="small", force=True), timeout=120)
    assert small.published and small.placement.version == 3
    big_done_first = planning_big.done()
    assert (await planning_big).published
    return big_done_first


async def test_a_small_replan_does_not_wait_behind_a_large_one(serve, connect):
    assert not await small_waits_for_big(serve, connect, small_plan_workers=1)


async def test_without_the_lane_the_small_replan_waits(serve, connect):
    # What the lane fixes: the same scenario with --small-plan-workers 0.
    assert await small_waits_for_big(serve, connect, small_plan_workers=0)


def test_small_plan_workers_flag(monkeypatch):
    monkeypatch.delenv("EPLB_SMALL_PLAN_WORKERS", raising=False)
    assert parse_args([])[0].balancer.small_plan_workers == limits.SMALL_PLAN_WORKERS
    assert parse_args(["--small-plan-workers", "0"])[0].balancer.small_plan_workers == 0
    monkeypatch.setenv("EPLB_SMALL_PLAN_WORKERS", "3")
    assert parse_args([])[0].balancer.small_plan_workers == 3
    with pytest.raises(SystemExit) as info:
        parse_args(["--small-plan-workers", "-1"])
    assert info.value.code == 2


# A 1 MiB placement (64 x 4096 int32): a client that does not read stops the server's write of
# it, where a small one would fit in the transport's buffers. The greedy policy plans it fast.
WIDE = pb.Topology(num_layers=64, num_experts=4096, num_slots=4096, num_gpus=512, num_nodes=64, num_groups=1)


# A connection of its own per channel (as engines have; channels alike would share one).
STALLING = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 8 << 20)]


async def wide_deployment(serve, connect):
    server = await serve()
    c = connect(server)
    d = pb.Deployment(name="wide", topology=WIDE, policy="deepseek")
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    await report(c, "wide", (WIDE.num_layers, WIDE.num_experts), 3)  # a forced re-plan needs a window
    await asyncio.sleep(0.3)  # flushed (flush_s 0.1)
    return server, c


async def publish(c, name: str = "wide") -> int:
    out = await c.stub.Rebalance(pb.RebalanceRequest(deployment=name, force=True), timeout=60)
    assert out.published
    return out.placement.version


async def test_a_watcher_that_reads_gets_every_version_in_order(serve, connect):
    _, c = await wide_deployment(serve, connect)
    seen: list[int] = []

    async def read() -> None:
        async for placement in AsyncServiceClient.over(c.channel).watch("wide", decode=False):
            seen.append(placement.version)

    reader = asyncio.create_task(read())
    while not seen:
        await asyncio.sleep(0.01)
    last = 0
    for _ in range(8):  # back to back: each new version while the last may still be in flight
        last = await publish(c)
    for _ in range(200):
        if seen[-1] == last:
            break
        await asyncio.sleep(0.05)
    reader.cancel()
    assert seen == list(range(1, last + 1))


async def test_a_stalled_watcher_then_reading_gets_the_latest_with_a_gap(serve, connect):
    server, c = await wide_deployment(serve, connect)
    # Its own connection, as an engine has, with the transport's window at its 64 KiB start (no
    # BDP probing): the client takes no more of a message than that until it reads.
    own = grpc.aio.insecure_channel(server.target, options=[*STALLING, ("grpc.http2.bdp_probe", 0)])
    stalled = pb_grpc.ExpertLoadBalancerServiceStub(own).WatchPlacements(pb.WatchPlacementsRequest(deployment="wide"))
    await stalled.wait_for_connection()
    last = 0
    for _ in range(6):  # over 2 s: the watcher's stream has held its message past hub.STALL_S
        last = await publish(c)
        await asyncio.sleep(0.4)
    seen = []
    while not seen or seen[-1] < last:
        seen.append((await asyncio.wait_for(stalled.read(), 30)).placement.version)
    stalled.cancel()
    await own.close()
    assert seen[0] == 1 and seen[-1] == last
    assert seen == sorted(set(seen))  # increasing, no duplicate
    # Latest-wins: the versions published while it stalled were not queued for it.
    assert len(seen) < last, seen


async def test_cancelling_stalled_watches_logs_no_error(serve, connect, caplog):
    server, c = await wide_deployment(serve, connect)
    chans = [grpc.aio.insecure_channel(server.target, options=STALLING) for _ in range(4)]
    calls = [
        pb_grpc.ExpertLoadBalancerServiceStub(ch).WatchPlacements(pb.WatchPlacementsRequest(deployment="wide"))
        for ch in chans
    ]
    for call in calls:
        await call.wait_for_connection()
    for _ in range(3):
        await publish(c)
    await asyncio.sleep(0.3)
    assert server.metrics.watchers.labels("wide")._value.get() == 4
    with caplog.at_level("DEBUG"):
        for call in calls:
            call.cancel()  # each with a 1 MiB write pending on the server
        for ch in chans:
            await ch.close()
        for _ in range(100):
            if server.metrics.watchers.labels("wide")._value.get() == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
    assert server.metrics.watchers.labels("wide")._value.get() == 0
    assert [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")] == []
