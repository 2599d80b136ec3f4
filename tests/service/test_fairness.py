"""One tenant must not slow another: a small deployment's re-plan does not wait behind a large
one's (the small-plan lane, service/solver.py), and a watcher that does not read costs at most
one pending placement (service/hub.py). Real servers on 127.0.0.1, real channels."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace

import numpy as np
import pytest
from svc_helpers import FAST, small_deployment

from eplb_service import limits
from eplb_service._gen.eplb.v1 import balancer_pb2 as pb
from eplb_service.cli import parse_args
from eplb_service.client import EngineClient

# 32 layers x 8192 slots = 2^18 cells, the smallest plan the lane refuses: a few seconds to
# plan, where the small deployment's 4 x 24 takes milliseconds.
BIG = pb.Topology(num_layers=32, num_experts=8192, num_slots=8192, num_gpus=4096, num_nodes=512, num_groups=1)


def config(**kw: object):
    return replace(FAST, replica_id=uuid.uuid4().hex[:8], **kw)


async def report(c, name: str, shape: tuple[int, int], seed: int) -> None:
    loads = np.random.default_rng(seed).integers(0, 1000, size=shape).astype(np.int32)
    assert (await EngineClient(c.channel, name, rank=0).report([loads])).accepted == 1


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
