"""Planning for time over the wire: Planning.kernel_model and its batch sizes, checked, reaching
the library, and reported back as PlanStats.predicted_ms (ComputePlacement and a deployment's
re-plans)."""

from __future__ import annotations

import asyncio
import contextlib
import io

import grpc
import numpy as np
import pytest
from svc_helpers import status_details

import eplb
from eplb_tools.ctl import main as ctl
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

MODEL = "qwen3-30b-a3b@h100"
TOPO = pb.Topology(num_layers=2, num_experts=32, num_slots=48, num_gpus=8, num_nodes=1, num_groups=1)
T = eplb.Topology(2, 32, 48, 8, 1, 1)


def loads(seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(0, 1.0, (2, 32)) * 1000


async def test_kernel_model_reaches_the_library_and_predicted_ms_comes_back(serve, connect):
    c = connect(await serve())
    planning = pb.Planning(kernel_model=MODEL, tokens_per_gpu=[4, 64], top_k=4, dispatch="static")
    out = await c.stub.ComputePlacement(
        pb.ComputePlacementRequest(topology=TOPO, loads=encode(loads()), planning=planning), timeout=60
    )
    want = eplb.rebalance(loads(), T, kernel_curve=MODEL, tokens_per_gpu=[4, 64], top_k=4, dispatch="static")
    assert np.array_equal(np.frombuffer(out.phy2log.data, "<i4").reshape(2, 48), want.phy2log)
    assert dict(out.stats.predicted_ms) == pytest.approx(want.predicted_ms)
    # Without a kernel model: no prediction, the token plan.
    plain = await c.stub.ComputePlacement(pb.ComputePlacementRequest(topology=TOPO, loads=encode(loads())))
    assert not plain.stats.predicted_ms
    assert np.array_equal(np.frombuffer(plain.phy2log.data, "<i4").reshape(2, 48), eplb.rebalance(loads(), T).phy2log)


@pytest.mark.parametrize(
    ("planning", "field"),
    [
        (pb.Planning(kernel_model="h100"), "planning.kernel_model"),
        (pb.Planning(tokens_per_gpu=[4]), "planning.tokens_per_gpu"),
        (pb.Planning(top_k=8), "planning.top_k"),
        (pb.Planning(dispatch="even"), "planning.dispatch"),
        (pb.Planning(kernel_model=MODEL, tokens_per_gpu=[0]), "planning.tokens_per_gpu"),
        (pb.Planning(kernel_model=MODEL, tokens_per_gpu=list(range(1, 18))), "planning.tokens_per_gpu"),
        (pb.Planning(kernel_model=MODEL, top_k=33), "planning.top_k"),
        (pb.Planning(kernel_model=MODEL, dispatch="random"), "planning.dispatch"),
    ],
)
async def test_time_fields_are_checked(serve, connect, planning, field):
    c = connect(await serve())
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ComputePlacement(
            pb.ComputePlacementRequest(topology=TOPO, loads=encode(loads()), planning=planning)
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in status_details(info.value)] == [field]
    d = pb.Deployment(name="bad", topology=TOPO, planning=planning)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    assert [f for f, _ in status_details(info.value)] == ["deployment." + field]
    names = await c.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert "bad" not in [x.name for x in names.deployments]


async def test_any_policy_may_plan_for_time(serve, connect):
    c = connect(await serve())
    planning = pb.Planning(kernel_model=MODEL, tokens_per_gpu=[16])
    out = await c.stub.ComputePlacement(
        pb.ComputePlacementRequest(topology=TOPO, policy="deepseek", loads=encode(loads()), planning=planning),
        timeout=60,
    )
    assert list(out.stats.predicted_ms) == [16]


async def test_a_deployments_replan_is_for_time_and_ctl_shows_it(serve, connect):
    server = await serve()
    c = connect(server)
    d = pb.Deployment(
        name="timed",
        topology=TOPO,
        planning=pb.Planning(kernel_model=MODEL, tokens_per_gpu=[4, 16]),
    )
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    counts = np.round(loads()).astype(np.int32)
    await c.stub.ReportLoad(iter([pb.ReportLoadRequest(deployment="timed", rank=0, seq=1, logical=encode(counts))]))
    out = await c.stub.Rebalance(pb.RebalanceRequest(deployment="timed", force=True), timeout=60)
    assert out.published
    assert sorted(out.placement.stats.predicted_ms) == [4, 16]
    assert all(v > 0 for v in out.placement.stats.predicted_ms.values())
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = await asyncio.to_thread(ctl, ["--address", server.target, "show", "timed"])
    assert rc == 0
    text = buf.getvalue()
    assert "for time: qwen3-30b-a3b@h100, 4,16 tokens per gpu, top-8, even dispatch" in text
    assert "predicted MoE" in text and "ms at 4" in text


async def test_the_batch_sizes_are_learned_from_the_reports_steps(serve, connect):
    c = connect(await serve())
    d = pb.Deployment(name="learn", topology=TOPO, planning=pb.Planning(kernel_model=MODEL, top_k=4))
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    counts = np.round(loads()).astype(np.int32)
    # No steps said: nothing to learn, the plan is for tokens and says why.
    await c.stub.ReportLoad(iter([pb.ReportLoadRequest(deployment="learn", rank=0, seq=1, logical=encode(counts))]))
    dry = await c.stub.Rebalance(pb.RebalanceRequest(deployment="learn", dry_run=True), timeout=60)
    assert not dry.placement.stats.predicted_ms
    assert any("no report in the window says its steps" in n for n in dry.placement.stats.notes)
    # Each rank's counts sum to tokens x top_k per layer: steps make tokens per step.
    per_layer = counts.sum(axis=1).mean()
    reqs = []
    for seq, steps in enumerate([10, 10, 40, 40], start=2):
        reqs.append(pb.ReportLoadRequest(deployment="learn", rank=1, seq=seq, logical=encode(counts), steps=steps))
    await c.stub.ReportLoad(iter(reqs))
    dry = await c.stub.Rebalance(pb.RebalanceRequest(deployment="learn", dry_run=True), timeout=60)
    sizes = sorted(dry.placement.stats.predicted_ms)
    assert sizes == sorted({max(1, round(per_layer / 4 / 40)), max(1, round(per_layer / 4 / 10))})
    assert any("reports' tokens per gpu per step" in n for n in dry.placement.stats.notes)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.ReportLoad(
            iter([pb.ReportLoadRequest(deployment="learn", rank=0, seq=9, logical=encode(counts), steps=1 << 21)])
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in status_details(info.value)] == ["steps"]


async def test_the_time_gate_weighs_the_saved_ms_against_the_moves_stall(serve, connect):
    c = connect(await serve())
    counts = np.round(loads()).astype(np.int32)
    out = {}
    for name, payback in (("strict", 1), ("lax", 10**9)):
        d = pb.Deployment(
            name=name,
            topology=TOPO,
            planning=pb.Planning(kernel_model=MODEL, tokens_per_gpu=[4, 64]),
            trigger=pb.Trigger(max_payback_steps=payback),
            expert_bytes=44_040_192,
        )
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
        await c.stub.ReportLoad(iter([pb.ReportLoadRequest(deployment=name, rank=0, seq=1, logical=encode(counts))]))
        out[name] = await c.stub.Rebalance(pb.RebalanceRequest(deployment=name), timeout=60)
    lax = out["lax"]
    assert lax.published
    s = lax.placement.stats
    assert sorted(s.predicted_ms_before) == [4, 64]
    want = 0.5 * sum(s.predicted_ms_before[b] - s.predicted_ms[b] for b in (4, 64))
    assert s.predicted_saved_ms == pytest.approx(want) and s.predicted_saved_ms > 0
    assert s.transfer.predicted_seconds > 0
    assert s.predicted_gain_percent == pytest.approx(100 * want / (0.5 * sum(s.predicted_ms_before.values())))
    # Judged by time: the token imbalance may be worse than before.
    strict = out["strict"]
    assert not strict.published
    assert "max_payback_steps 1" in strict.reason
    # The gate needs a kernel model.
    bad = pb.Deployment(name="nogate", topology=TOPO, trigger=pb.Trigger(max_payback_steps=5))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=bad))
    assert [f for f, _ in status_details(info.value)] == ["deployment.trigger.max_payback_steps"]


async def test_a_default_top_k_above_the_experts_is_refused_on_create(serve, connect):
    c = connect(await serve())
    topo = pb.Topology(num_layers=1, num_experts=4, num_slots=8, num_gpus=4, num_nodes=1, num_groups=1)
    d = pb.Deployment(name="tiny", topology=topo, planning=pb.Planning(kernel_model=MODEL))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    assert status_details(info.value) == [
        ("deployment.planning.top_k", "unset means 8, more than the 4 experts: set it")
    ]
    d.planning.top_k = 2
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
