"""Planning over the wire: the library's effort and budgets, transfer figures, and the limits
that keep stateless ComputePlacement calls from taking the service's planning capacity."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import numpy as np
import pytest
from svc_helpers import FAST, report_some_load, small_deployment, status_details

import eplb
from eplb import limits
from eplb.transfer import transfer_schedule
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_engine.client import pushback_s, transient
from eplb_service.solver import COMPUTE_PUSHBACK_S
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

TOPO = small_deployment().topology
T = eplb.Topology(4, 16, 24, 8, 2, 4)


def loads(seed: int = 7, shape: tuple[int, int] = (4, 16)) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(0, 1.5, shape) * 100


async def test_planning_options_are_checked(serve, connect):
    c = connect(await serve())
    cases = [
        (
            pb.ComputePlacementRequest(topology=TOPO, loads=encode(loads()), planning=pb.Planning(effort="turbo")),
            "planning.effort",
        ),
        (
            pb.ComputePlacementRequest(
                topology=TOPO, policy="deepseek", loads=encode(loads()), planning=pb.Planning(effort="high")
            ),
            "planning.effort",
        ),
        (
            pb.ComputePlacementRequest(
                topology=TOPO, policy="ilp", loads=encode(loads()), planning=pb.Planning(work_budget=5)
            ),
            "planning.work_budget",
        ),
    ]
    for request, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.ComputePlacement(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in status_details(info.value)] == [field]
    bad = small_deployment("bad")
    bad.planning.effort = "turbo"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=bad))
    assert [f for f, _ in status_details(info.value)] == ["deployment.planning.effort"]


async def test_effort_reaches_the_library(serve, connect):
    c = connect(await serve())
    for effort in ("fast", "high"):
        out = await c.stub.ComputePlacement(
            pb.ComputePlacementRequest(topology=TOPO, loads=encode(loads()), planning=pb.Planning(effort=effort))
        )
        want = eplb.rebalance(loads(), T, "auto", effort=effort)
        assert np.array_equal(np.frombuffer(out.phy2log.data, "<i4").reshape(4, 24), want.phy2log)
    # "default" is the library's default, whether or not the installed eplb names it.
    out = await c.stub.ComputePlacement(
        pb.ComputePlacementRequest(topology=TOPO, loads=encode(loads()), planning=pb.Planning(effort="default"))
    )
    assert np.array_equal(np.frombuffer(out.phy2log.data, "<i4").reshape(4, 24), eplb.rebalance(loads(), T).phy2log)


async def test_expert_bytes_give_the_transfer_figures(serve, connect):
    c = connect(await serve())
    previous = eplb.Placement.contiguous(T)
    out = await c.stub.ComputePlacement(
        pb.ComputePlacementRequest(
            topology=TOPO, loads=encode(loads()), previous_phy2log=encode(previous.phy2log), expert_bytes=1 << 20
        )
    )
    new = eplb.Placement(np.frombuffer(out.phy2log.data, "<i4").reshape(4, 24), T)
    want = transfer_schedule(previous, new, T, expert_bytes=float(1 << 20))
    got = out.stats.transfer
    assert got.bytes == int(round(want.bytes)) > 0
    assert got.cross_node_bytes == int(round(want.cross_node_bytes))
    # The schedule's rounds: each gpu talks to at most one peer per round, so a gpu receiving
    # from k peers needs at least k rounds; the busiest rank's round moves at least one expert.
    assert got.rounds == want.total_rounds >= 1
    assert got.max_rank_round_bytes == int(round(want.max_rank_round_bytes)) >= 1 << 20
    assert got.predicted_seconds == pytest.approx(want.predicted_seconds) and got.predicted_seconds > 0
    plain = await c.stub.ComputePlacement(pb.ComputePlacementRequest(topology=TOPO, loads=encode(loads())))
    assert not plain.stats.HasField("transfer")


async def test_an_ilp_over_the_size_limit_is_refused(serve, connect):
    c = connect(await serve())
    big = pb.Topology(num_layers=1, num_experts=256, num_slots=512, num_gpus=64)
    assert 256 * 64 > limits.ILP_MAX_CELLS
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ComputePlacement(
            pb.ComputePlacementRequest(topology=big, policy="ilp", loads=encode(loads(1, (1, 256))))
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(limits.ILP_MAX_CELLS) in info.value.details()
    # A limit that stays gives no retry hint: the engine client does not repeat the call.
    assert pushback_s(info.value) is None and not transient(info.value)


@pytest.mark.slow
async def test_ilp_calls_keep_their_deadline_and_leave_re_plans_their_capacity(serve, connect):
    """Eight ILP calls at once on layers CP-SAT cannot finish in time: each ends by its deadline,
    those beyond the compute queue are refused at once, and a deployment re-plans meanwhile."""
    server = await serve()
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    hard = pb.Topology(num_layers=4, num_experts=128, num_slots=160, num_gpus=32)
    request = pb.ComputePlacementRequest(topology=hard, policy="ilp", loads=encode(loads(1, (4, 128))))
    await report_some_load(c.stub)
    calls = [c.stub.ComputePlacement(request, timeout=3.0) for _ in range(8)]
    await asyncio.sleep(0.2)
    replan = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True), timeout=30)
    assert replan.published
    codes = []
    for call in calls:
        try:
            await call
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A full queue drains: the refusal says when to come back, and the client retries.
                assert pushback_s(exc) == COMPUTE_PUSHBACK_S and transient(exc)
    allowed = {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert set(codes) <= allowed, codes
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 8 - limits.COMPUTE_WORKERS - limits.COMPUTE_QUEUE


async def test_an_ilp_deployment_over_the_size_limit_is_refused(serve, connect):
    c = connect(await serve())
    d = pb.Deployment(
        name="big", policy="ilp", topology=pb.Topology(num_layers=1, num_experts=256, num_slots=512, num_gpus=64)
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert list((await c.stub.ListDeployments(pb.ListDeploymentsRequest())).deployments) == []


async def test_layer_workers_split_a_re_plan_over_processes_and_plan_the_same(serve, connect):
    """With ``layer_workers=2`` a deployment's re-plans plan their layers in two processes that
    the planning worker starts (a multiprocessing Pool's daemonic worker may not start any: the
    re-plan failed), and publish what one process plans: the fresh first plan, then a
    migration-aware re-plan from it."""
    c = connect(await serve(balancer=replace(FAST, layer_workers=2)))
    # More layers than the library's chunk of 16, so the plan really splits.
    d = pb.Deployment(
        name="wide",
        topology=pb.Topology(num_layers=40, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4),
        policy="auto",
    )
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    topo = eplb.Topology(40, 16, 24, 8, 2, 4)
    counts = (np.random.default_rng(3).lognormal(0, 1.5, (40, 16)) * 100).astype(np.int32)
    resp = await AsyncServiceClient.over(c.channel).report(reports("wide", 0, [counts]))
    assert resp.accepted == 1
    await asyncio.sleep(0.3)  # the window flushes every 0.1 s
    first = await c.stub.Rebalance(pb.RebalanceRequest(deployment="wide", force=True), timeout=60)
    assert first.published
    got = np.frombuffer(first.placement.phy2log.data, "<i4").reshape(40, 24)
    want = eplb.rebalance(counts, topo, "auto")
    assert np.array_equal(got, want.phy2log)
    # The counts change: the re-plan from version 2 keeps what it can, in two processes too.
    more = (np.random.default_rng(4).lognormal(0, 1.5, (40, 16)) * 100).astype(np.int32)
    assert (await AsyncServiceClient.over(c.channel).report(reports("wide", 1, [more]))).accepted == 1
    await asyncio.sleep(0.3)
    second = await c.stub.Rebalance(pb.RebalanceRequest(deployment="wide", force=True), timeout=60)
    assert second.published and second.placement.version == 3
    again = eplb.rebalance(counts + more, topo, "auto", previous=want.placement)
    assert again.replan is not None and again.total_moves < topo.num_layers * topo.num_slots
    assert np.array_equal(np.frombuffer(second.placement.phy2log.data, "<i4").reshape(40, 24), again.phy2log)


def test_a_deployment_without_a_time_limit_searches_within_half_its_trigger_interval():
    from google.protobuf.duration_pb2 import Duration

    from eplb_service import codec

    plain = pb.Planning()
    assert "time_limit" not in codec.planning_options(plain, "auto", 4, None)  # no interval: deterministic
    assert codec.planning_options(plain, "auto", 4, None, 30.0)["time_limit"] == 15.0
    assert codec.planning_options(plain, "global", 4, None, 0.5)["time_limit"] == codec.TRIGGER_MIN_SECONDS
    own = pb.Planning(time_limit=Duration(seconds=40))
    assert codec.planning_options(own, "auto", 4, None, 30.0)["time_limit"] == 40.0  # its own wins
    # The ilp's per-layer limit shares the same cap; deepseek takes no time limit at all.
    assert codec.planning_options(plain, "ilp", 4, None, 8.0)["time_limit"] == pytest.approx(4.0 / 4)
    assert codec.planning_options(plain, "deepseek", 4, None, 30.0) == {}
