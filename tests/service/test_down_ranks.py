"""Placements with gpus down (empty slots, ``phy2log == -1``) in the service: physical counts
folded to experts, restores in the transfer figures, rollouts over the live ranks."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from svc_helpers import REDIS_URL, report_some_load, small_deployment, status_details

import eplb
import eplb.transfer
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service import codec
from eplb_service.rollout import PREPARED, SWITCHED, apply_ack
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(4, 16, 24, 8, 2, 4)


def arr(a: np.ndarray) -> pb.Array:
    a = np.ascontiguousarray(a)
    code = {np.dtype("<i4"): pb.DTYPE_INT32, np.dtype("<f8"): pb.DTYPE_FLOAT64}[a.dtype]
    return pb.Array(dtype=code, shape=list(a.shape), data=a.tobytes())


def skewed(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, (4, 16)).astype(np.float64)


def survivor_placement(down: list[int]) -> eplb.Placement:
    """A balanced placement of ``TOPO`` with ``down`` gpus empty."""
    return eplb.rebalance(skewed(0), TOPO, down_gpus=down).placement


async def test_physical_counts_under_a_placement_with_a_gpu_down_fold_like_logical_ones(serve, connect):
    server = await serve()
    c = connect(server)
    placement = survivor_placement([3])
    assert placement.down_gpus == (3,) and (placement.logcnt > 1).any()
    created = await c.stub.CreateDeployment(
        pb.CreateDeploymentRequest(deployment=small_deployment("phys"), initial_phy2log=arr(placement.phy2log))
    )
    # An initial placement with gpu 3 empty: rank 3 is down from version 1 on.
    assert list(created.placement.down_ranks) == [3] and created.placement.down_ranks_version == 1
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("logi")))
    loads = skewed(1)
    # Per slot: each expert's load split over its replicas (integers: the remainder to the first).
    phys = np.zeros((4, 24), dtype=np.int32)
    for lay in range(4):
        for e in range(16):
            slots = np.flatnonzero(placement.phy2log[lay] == e)
            share = int(loads[lay, e]) // len(slots)
            phys[lay, slots] = share
            phys[lay, slots[0]] += int(loads[lay, e]) - share * len(slots)
    assert (phys[:, 9:12] == 0).all()  # gpu 3's slots route nothing
    out = await AsyncServiceClient.over(c.channel).report(reports("phys", 0, [phys], placement_version=1))
    assert out.accepted == 1
    assert (await AsyncServiceClient.over(c.channel).report(reports("logi", 0, [loads]))).accepted == 1
    now = time.time()
    folded, _ = server.balancer.registry.local["phys"].window.total(now)
    direct, _ = server.balancer.registry.local["logi"].window.total(now)
    # Before: the -1 slots were binned as expert 15 of the layer before (and layer 0's made
    # bincount fail); with zeros there the sums still matched, so also check the layers apart.
    assert np.array_equal(folded, direct) and np.array_equal(folded, loads)


async def test_counts_on_an_empty_slot_are_refused_naming_the_slot(serve, connect):
    server = await serve()
    c = connect(server)
    placement = survivor_placement([3])
    await c.stub.CreateDeployment(
        pb.CreateDeploymentRequest(deployment=small_deployment("phys"), initial_phy2log=arr(placement.phy2log))
    )
    phys = np.ones((4, 24), dtype=np.int32)
    phys[:, 9:12] = 0
    phys[2, 10] = 5  # layer 2, slot 10 is on gpu 3, which is down in version 1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await AsyncServiceClient.over(c.channel).report(reports("phys", 0, [phys], placement_version=1))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ((field, why),) = [v for v in status_details(err.value) if v[0] != "stream"]
    assert field == "physical.counts" and "layer 2 slot 10" in why and "version 1" in why
    now = time.time()
    assert server.balancer.registry.local["phys"].window.total(now)[1] == 0  # nothing entered the window


def test_transfer_stats_count_restores_apart():
    old = eplb.Placement.contiguous(TOPO)  # slots 16..23 repeat experts 0..7: 9, 10, 11 once only
    new = eplb.rebalance(skewed(0), TOPO, previous=old, down_gpus=[3]).placement
    stats = codec.transfer_stats(old, new, TOPO, expert_bytes=1000)
    # gpu 3 held experts 9, 10 and 11 of every layer, their only replicas: one restore per
    # (layer, gpu, expert) of them in the new placement.
    lost = {(lay, p // 3, e) for lay in range(4) for p, e in enumerate(new.phy2log[lay]) if e in (9, 10, 11)}
    assert len(lost) >= 12 and stats.restored_experts == len(lost) and stats.restored_bytes == 1000 * len(lost)
    moved = int(eplb.moves(old, new).sum())
    assert stats.bytes <= (moved - len(lost)) * 1000  # restores are not peer bytes
    full = codec.transfer_stats(old, eplb.rebalance(skewed(0), TOPO, previous=old).placement, TOPO, 1000)
    assert full.restored_experts == 0 and full.restored_bytes == 0


def test_a_rollout_over_the_live_ranks_switches_without_the_down_one():
    states, versions = {}, {}
    live = [0, 1, 2, 4, 5, 6, 7]  # rank 3 is down
    for r in live[:-1]:
        out = apply_ack(states, versions, r, 5, PREPARED, 10 + r, live, 4)
        assert out.switch_step == 0 and out.num_ranks == 7
    out = apply_ack(states, versions, 7, 5, PREPARED, 30, live, 4)
    assert out.became_prepared and out.switch_step == 34 and out.ranks_prepared == 7
    for r in live:
        out = apply_ack(states, versions, r, 5, SWITCHED, 34, live, 4)
    assert out.became_switched and out.ranks_acked == 7


# -- SetRanksDown over the wire ---------------------------------------------------------------

PREP, SWITCH = pb.ACK_STATE_PREPARED, pb.ACK_STATE_SWITCHED


@pytest.fixture(params=["memory", "redis"])
async def fleet(request, serve, connect, prefix):
    """A server (in-process or Redis store) with d1 (8 gpus, ranks 0..7) at version 2, planned
    from reported loads, its client and version 2."""
    kw = {"redis_url": REDIS_URL, "key_prefix": prefix()} if request.param == "redis" else {}
    server = await serve(**kw)
    c = connect(server)
    d = small_deployment()
    d.switch_margin_steps = 3
    d.expert_bytes = 1000
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    assert (await AsyncServiceClient.over(c.channel).report(reports("d1", 0, [skewed(5)]))).accepted == 1
    planned = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert planned.published
    return server, c, planned.placement


def phy(placement: pb.Placement) -> np.ndarray:
    return np.frombuffer(placement.phy2log.data, "<i4").reshape(4, 24)


def set_down(c, down=(), up=(), reason=""):
    return c.stub.SetRanksDown(pb.SetRanksDownRequest(deployment="d1", down=list(down), up=list(up), reason=reason))


async def test_a_rank_down_publishes_a_survivor_placement_at_once(fleet, caplog):
    server, c, base = fleet
    assert base.version == 2 and base.HasField("loads") and not base.down_ranks
    with caplog.at_level("WARNING", logger="eplb_service.audit"):
        out = await set_down(c, down=[3], reason="nccl timeout on rank 3")
    assert out.published and list(out.down_ranks) == [3]
    p = out.placement
    assert p.version == 3 and list(p.down_ranks) == [3] and p.down_ranks_version == 3 and p.survivor_of == 2
    assert p.eplb_version == base.eplb_version == codec.EPLB_VERSION != ""
    got = phy(p)
    assert (got[:, 9:12] == -1).all() and (got[:, np.r_[0:9, 12:24]] >= 0).all()
    assert all((np.bincount(row[row >= 0], minlength=16) >= 1).all() for row in got)
    assert "survivor plan (SetRanksDown)" in p.stats.notes[-1] and p.loads == base.loads
    # The same call the engines make without the service (eplb_engine.survivors.survivor_plan).
    topo = eplb.Topology(4, 16, 24, 8, 2, 4)
    loads = np.frombuffer(base.loads.data, "<f4").reshape(4, 16).astype(np.float64)
    want = eplb.rebalance(loads, topo, "auto", previous=eplb.Placement(phy(base), topo), down_gpus=[3], effort="fast")
    assert np.array_equal(got, want.phy2log)
    assert (
        p.stats.transfer.restored_experts
        == eplb.transfer.transfer_schedule(eplb.Placement(phy(base), topo), want.placement, topo).restore_layer.size
    )
    (line,) = [r for r in caplog.records if "SetRanksDown" in r.getMessage()]
    assert "ranks down [] -> [3]" in line.getMessage() and "nccl timeout on rank 3" in line.getMessage()
    # Idempotent: the same down set again publishes nothing.
    again = await set_down(c, down=[3])
    assert not again.published and again.placement.version == 3 and list(again.down_ranks) == [3]
    info = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert list(info.down_ranks) == [3] and info.deployment.version == 3
    # The trigger's plans keep gpu 3 out and carry the down ranks on.
    later = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert later.published and list(later.placement.down_ranks) == [3] and later.placement.down_ranks_version == 3
    assert (phy(later.placement)[:, 9:12] == -1).all() and later.placement.survivor_of == 0


async def test_a_rank_back_up_is_planned_in_again(fleet):
    server, c, base = fleet
    await set_down(c, down=[3, 5])
    out = await set_down(c, up=[3])
    assert out.published and list(out.down_ranks) == [5] and out.placement.version == 4
    got = phy(out.placement)
    assert (got[:, 15:18] == -1).all() and (got[:, 9:12] >= 0).all()
    out = await set_down(c, up=[5])
    assert list(out.down_ranks) == [] and (phy(out.placement) >= 0).all()


async def test_set_ranks_down_refusals_name_the_field(fleet):
    server, c, base = fleet
    cases = [
        (dict(down=[9]), "down[0]", "rank 9 is not a gpu's rank"),
        (dict(down=[2, 2]), "down[1]", "listed twice"),
        (dict(down=[2], up=[2]), "up", "in both down and up"),
        (dict(), "down", "at least one rank"),
        (dict(down=[1], reason="x" * 300), "reason", "at most 256"),
    ]
    for kw, field, why in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await set_down(c, **kw)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
        assert any(f == field and why in d for f, d in status_details(err.value)), status_details(err.value)
    # 16 experts need 16 live slots: 3 slots a gpu, so 3 gpus down leave 15.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await set_down(c, down=[0, 1, 2])
    ((field, why),) = status_details(err.value)
    assert field == "down" and "only 15 live slots" in why and "16 experts" in why
    # Nothing was published by the refusals.
    assert (await c.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))).deployment.version == 2


async def test_rollouts_count_the_live_ranks_and_one_in_flight_aborts_when_a_rank_dies(fleet):
    server, c, base = fleet

    def ack(rank, version, state, step=0):
        return c.stub.AckPlacement(
            pb.AckPlacementRequest(deployment="d1", rank=rank, version=version, state=state, step=step)
        )

    # Version 2 is rolling out: ranks 0..5 prepared, then rank 3 dies.
    for r in range(6):
        assert not (await ack(r, 2, PREP, 10)).switch_step
    await set_down(c, down=[3])
    for r in (6, 7):
        out = await ack(r, 2, PREP, 11)
    # Every live rank prepared version 2, but it can never finish: it is aborted, not switched.
    assert out.aborted and out.switch_step == 0
    # The survivor version 3 counts the 7 live ranks; rank 3 takes no part.
    live = [0, 1, 2, 4, 5, 6, 7]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await ack(3, 3, PREP, 12)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "down in version 3" in err.value.details()
    for r in live:
        out = await ack(r, 3, PREP, 20 + r)
    assert out.num_ranks == 7 and out.ranks_prepared == 7 and out.switch_step == 27 + 3 and not out.aborted
    for r in live:
        out = await ack(r, 3, SWITCH, 30)
    assert out.ranks_acked == 7


async def test_an_ack_of_a_version_no_longer_kept_is_still_recorded(serve, connect):
    server = await serve()
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await report_some_load(c.stub)
    for _ in range(18):  # versions 2..19: version 1 and 2 are no longer kept (16 are)
        assert (await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))).published
    out = await c.stub.AckPlacement(
        pb.AckPlacementRequest(deployment="d1", rank=0, version=2, state=pb.ACK_STATE_SWITCHED)
    )
    assert out.ranks_acked == 1 and out.num_ranks == 8


async def test_deployment_status_counts_the_live_ranks_of_the_current_version(serve, connect):
    """``DeploymentStatus`` (eplb ctl's list/show) counts acks over the ranks the current version
    lives on: a rank down in it is not one the rollout waits for."""
    c = connect(await serve())
    placement = survivor_placement([3])
    await c.stub.CreateDeployment(
        pb.CreateDeploymentRequest(deployment=small_deployment("st"), initial_phy2log=arr(placement.phy2log))
    )
    for rank in (0, 1):
        await c.stub.AckPlacement(
            pb.AckPlacementRequest(deployment="st", rank=rank, version=1, state=pb.ACK_STATE_SWITCHED)
        )
    got = await c.stub.GetDeployment(pb.GetDeploymentRequest(name="st"))
    assert list(got.down_ranks) == [3]
    assert got.status.num_ranks == 7 and got.status.ranks_acked == 2
    listed = await c.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert listed.statuses[0].num_ranks == 7
