"""Triggered re-plans of different deployments run concurrently (service/planner.py): a small
deployment's re-plan publishes while a large one's is still planning, in the small-plan lane,
rather than waiting for it as the trigger loop once made it do. Real server on 127.0.0.1,
memory store, real worker processes."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import numpy as np
from svc_helpers import FAST, small_deployment

from eplb import limits
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

# 128 layers x 8192 slots (the documented limits): past the small-plan lane (2^18 cells) and
# seconds to plan even on an idle machine (32 layers planned within the test's first second
# there); the small deployment's 4 x 24 takes milliseconds.
BIG = pb.Topology(num_layers=128, num_experts=8192, num_slots=8192, num_gpus=4096, num_nodes=512, num_groups=1)


async def version(c, name: str) -> int:
    return (await c.stub.GetPlacement(pb.GetPlacementRequest(deployment=name))).placement.version


async def report(c, name: str, shape: tuple[int, int], seed: int) -> None:
    loads = np.random.default_rng(seed).integers(0, 1000, size=shape).astype(np.int32)
    loads[:, 0] += 5000  # skewed: a plan gains, so a triggered one publishes
    assert (await AsyncServiceClient.over(c.channel).report(reports(name, 0, [loads]))).accepted == 1


async def test_a_small_triggered_replan_publishes_while_a_large_one_plans(serve, connect):
    assert BIG.num_layers * BIG.num_slots >= limits.SMALL_PLAN_CELLS
    config = replace(FAST, replica_id=uuid.uuid4().hex[:8], plan_workers=1, small_plan_workers=1)
    c = connect(await serve(balancer=config))
    on_each_report = pb.Trigger(report_count=1)
    deployments = (
        pb.Deployment(name="big", topology=BIG, policy="auto", trigger=on_each_report),
        small_deployment("small", report_count=1),
        small_deployment("warm"),  # no trigger: starts the small lane's worker (a spawn takes a second or so)
    )
    for d in deployments:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    await report(c, "warm", (4, 16), 3)
    await asyncio.sleep(0.3)  # flushed (flush_s 0.1)
    assert (await c.stub.Rebalance(pb.RebalanceRequest(deployment="warm", force=True))).published

    await report(c, "big", (BIG.num_layers, BIG.num_experts), 1)
    big_started = time.monotonic()
    await asyncio.sleep(1.0)  # its triggered re-plan has reached its worker (its start and the plan: seconds)
    assert await version(c, "big") == 1, "the large re-plan finished too soon to tell"
    await report(c, "small", (4, 16), 2)
    started = time.monotonic()
    while await version(c, "small") < 2:
        # The fairness target: the small one within 3 s while large ones plan.
        assert time.monotonic() - started < 3.0, "the small triggered re-plan waited behind the large one"
        await asyncio.sleep(0.02)
    waited = time.monotonic() - started
    assert await version(c, "big") == 1, f"the large re-plan published first (small took {waited:.2f}s)"
    deadline = time.monotonic() + 120
    while await version(c, "big") < 2:  # and the large one still publishes
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    # The figures (pytest -s): the small one's wait, and the large one's, from their reports.
    print(f"small published {waited:.2f}s after its report; big {time.monotonic() - big_started:.2f}s after its")
