"""The rollout protocol over the wire: PREPARED / SWITCHED / FAILED acks and the switch step."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from svc_helpers import REDIS_URL, report_some_load, small_deployment, status_details

from eplb_engine.aio import AsyncServiceClient
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

P, S, F = pb.ACK_STATE_PREPARED, pb.ACK_STATE_SWITCHED, pb.ACK_STATE_FAILED


@pytest.fixture(params=["memory", "redis"])
async def rollout_server(request, serve, connect, prefix):
    """A server (in-process or Redis store) with deployment d1 on ranks 0, 1, 2 at version 3."""
    kw = {"redis_url": REDIS_URL, "key_prefix": prefix()} if request.param == "redis" else {}
    server = await serve(**kw)
    c = connect(server)
    d = small_deployment()
    d.ranks.extend([0, 1, 2])
    d.switch_margin_steps = 5
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    await report_some_load(c.stub)
    for _ in range(2):
        assert (await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))).published
    return server, c


def ack(c, rank: int, version: int, state: int, step: int = 0, error: str = ""):
    return c.stub.AckPlacement(
        pb.AckPlacementRequest(deployment="d1", rank=rank, version=version, state=state, step=step, error=error)
    )


def figures(r: pb.AckPlacementResponse) -> tuple:
    return r.ranks_acked, r.ranks_prepared, r.ranks_failed, r.num_ranks, r.switch_step, r.aborted


async def test_switch_step_is_fixed_once_every_rank_prepared(rollout_server):
    server, c = rollout_server
    assert figures(await ack(c, 0, 2, P, step=100)) == (0, 1, 0, 3, 0, False)
    assert figures(await ack(c, 1, 2, P, step=120)) == (0, 2, 0, 3, 0, False)
    # The last PREPARED fixes the switch: the largest PREPARED step + switch_margin_steps.
    assert figures(await ack(c, 2, 2, P, step=110)) == (0, 3, 0, 3, 125, False)
    # Stable once set: a late PREPARED with a larger step does not move it.
    assert figures(await ack(c, 0, 2, P, step=500)) == (0, 3, 0, 3, 125, False)
    assert figures(await ack(c, 0, 2, S, step=125)) == (1, 3, 0, 3, 125, False)
    assert figures(await ack(c, 1, 2, S, step=125)) == (2, 3, 0, 3, 125, False)
    # An old client's ack (no state) is a SWITCHED ack.
    assert figures(await ack(c, 2, 2, pb.ACK_STATE_UNSPECIFIED)) == (3, 3, 0, 3, 125, False)
    # Version 3 has its own rollout; a rank that switched to 3 counts for 2 as well.
    assert figures(await ack(c, 0, 3, S)) == (1, 1, 0, 3, 0, False)
    assert figures(await ack(c, 1, 2, S)) == (3, 3, 0, 3, 125, False)  # a repeated ack changes nothing
    info = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert [(a.rank, a.version, a.prepared_version, a.failed_version) for a in info.acks] == [
        (0, 3, 3, 0),
        (1, 2, 2, 0),
        (2, 2, 2, 0),
    ]
    assert list(info.deployment.ranks) == [0, 1, 2] and info.deployment.switch_margin_steps == 5
    rollouts = server.metrics.rollouts
    assert rollouts.labels("d1", "prepared")._value.get() == 1
    assert rollouts.labels("d1", "switched")._value.get() == 1
    assert rollouts.labels("d1", "failed")._value.get() == 0


async def test_a_failed_rank_aborts_the_version(rollout_server):
    server, c = rollout_server
    await ack(c, 0, 3, P, step=10)
    await ack(c, 1, 3, P, step=11)
    out = await ack(c, 2, 3, F, step=12, error="cuda out of memory")
    assert figures(out) == (0, 2, 1, 3, 0, True)
    # The abort sticks: no switch step for version 3, whatever arrives later.
    assert figures(await ack(c, 2, 3, P, step=13)) == (0, 3, 1, 3, 0, True)
    info = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert [(a.rank, a.failed_version) for a in info.acks] == [(0, 0), (1, 0), (2, 3)]
    assert server.metrics.rollouts.labels("d1", "failed")._value.get() == 1
    assert server.metrics.rollouts.labels("d1", "prepared")._value.get() == 0


async def test_a_failure_after_the_switch_step_is_fixed_aborts_nothing(rollout_server):
    server, c = rollout_server
    for rank in range(3):
        out = await ack(c, rank, 3, P, step=20 + rank)
    assert figures(out) == (0, 3, 0, 3, 27, False)
    await ack(c, 0, 3, S, step=27)  # rank 0 already routes with version 3
    # Rank 2 fails afterwards (say its commit broke): counted, but the fixed step stands, so
    # every later poller learns the same step rank 0 switched at.
    assert figures(await ack(c, 2, 3, F, step=28, error="commit failed")) == (1, 3, 1, 3, 27, False)
    assert figures(await ack(c, 1, 3, P, step=29)) == (1, 3, 1, 3, 27, False)
    assert server.metrics.rollouts.labels("d1", "failed")._value.get() == 0


async def test_unknown_ranks_are_refused(rollout_server):
    _, c = rollout_server
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ack(c, 3, 2, S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in status_details(info.value)] == ["rank"]
    report = pb.ReportLoadRequest(deployment="d1", rank=7, seq=1)
    report.logical.CopyFrom(pb.Array(dtype=pb.DTYPE_FLOAT64, shape=[4, 16], data=np.ones((4, 16)).tobytes()))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ReportLoad(iter([report]))
    assert [f for f, _ in status_details(info.value)] == ["rank"]
    # Nothing was recorded for the refused ranks.
    info = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert list(info.acks) == []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ack(c, 0, 2, 9)
    assert [f for f, _ in status_details(info.value)] == ["state"]


async def test_every_replica_answers_the_same_switch_step(serve, connect, prefix):
    p = prefix()
    a, b = await serve(redis_url=REDIS_URL, key_prefix=p), await serve(redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await report_some_load(ca.stub)
    assert (await ca.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))).published
    # Default ranks: one per gpu (8); default margin 8.
    for rank in range(8):
        out = await AsyncServiceClient.over((ca if rank % 2 else cb).channel).ack(
            "d1", rank, 2, "prepared", step=1000 + rank
        )
    assert figures(out) == (0, 8, 0, 8, 1007 + 8, False)
    again = await ca.stub.AckPlacement(pb.AckPlacementRequest(deployment="d1", rank=0, version=2, state=S))
    assert figures(again) == (1, 8, 0, 8, 1015, False)
