"""Survivor placements on the engine side: computed by every live rank alone (the same one the
service publishes for SetRanksDown), applied by the survivors over a group rebuilt without the
dead rank (gloo), lost experts restored through the engine's loader."""

from __future__ import annotations

import os
import time
import zlib

import grpc
import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import spawn_ranks
from mover_sim import TENSORS, check_layers, encoded_layers, expected_slots
from svc_thread import ServerThread

import eplb
from eplb_engine import wire
from eplb_engine.client import ServiceClient, report_request
from eplb_engine.rollout import MoverApplier, ProcessGroupBarrier, Rollout
from eplb_engine.survivors import SURVIVOR_OPTIONS, SURVIVOR_POLICY, same_survivor, survivor_plan
from eplb_service import codec
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

TOPO = eplb.Topology(3, 8, 12, 4, 2)  # 3 slots per gpu, 2 nodes of 2 gpus
SVC_TOPO = eplb.Topology(3, 8, 16, 4, 2)  # 4 slots per gpu: two gpus down still hold every expert


def _loads(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, (3, 8)).astype(np.float64)


def test_engine_and_service_take_the_survivor_rule_from_one_definition():
    from eplb import survivor_rules
    from eplb_engine import survivors

    assert SURVIVOR_POLICY is codec.SURVIVOR_POLICY is survivor_rules.SURVIVOR_POLICY
    assert SURVIVOR_OPTIONS is codec.SURVIVOR_OPTIONS is survivor_rules.SURVIVOR_OPTIONS
    assert survivors.EPLB_VERSION is codec.EPLB_VERSION is survivor_rules.EPLB_VERSION
    assert dict(SURVIVOR_OPTIONS) == {"effort": "fast"}
    with pytest.raises(TypeError):
        SURVIVOR_OPTIONS["effort"] = "high"  # shared by both sides: read-only


def test_the_service_survivor_placement_is_the_one_every_rank_computes():
    server = ServerThread().start()
    try:
        ch = grpc.insecure_channel(server.address)
        stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
        stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=wire.deployment_pb("d1", SVC_TOPO, ranks=[10, 11, 12, 13]))
        )

        with ServiceClient(server.address) as client:
            assert client.report([report_request("d1", 10, 1, _loads(0))]).accepted == 1
        stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
        got = stub.GetPlacement(pb.GetPlacementRequest(deployment="d1")).placement
        base = wire.placement_from_pb(got, SVC_TOPO)
        assert base.version == 2 and base.loads is not None and base.down_ranks == ()
        # Rank 11 (gpu 1) dies: each survivor plans alone, then the service's answer arrives.
        local = survivor_plan(base, [1], down_ranks=[11])
        assert local.placement.down_gpus == (1,) and local.survivor_of == 2
        out = stub.SetRanksDown(pb.SetRanksDownRequest(deployment="d1", down=[11]))
        published = wire.placement_from_pb(out.placement, SVC_TOPO)
        assert published.down_ranks == (11,) and published.survivor_of == 2
        assert same_survivor(local, published)
        # A second failure from the survivor placement: the same again.
        local2 = survivor_plan(published, [1, 3], down_ranks=[11, 13])
        out2 = stub.SetRanksDown(pb.SetRanksDownRequest(deployment="d1", down=[13]))
        assert same_survivor(local2, wire.placement_from_pb(out2.placement, SVC_TOPO))
        # Another base, or another down set, is not the same survivor.
        other = survivor_plan(base, [3], down_ranks=[13])
        assert not same_survivor(other, published)
        ch.close()
    finally:
        server.stop()


def _restore(calls: list):
    def restore(layer: int, expert: int) -> dict[str, torch.Tensor]:
        calls.append((layer, expert))
        return {
            name: expected_slots(layer, np.array([expert]), k, shape, dtype)[0]
            for k, (name, (shape, dtype)) in enumerate(sorted(TENSORS.items()))
        }

    return restore


def _same_map(placement: eplb.Placement, group) -> bool:
    crc = zlib.crc32(placement.phy2log.tobytes())
    t = torch.tensor([crc, -crc], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0]) == -int(t[1])


def _survivor_rank(rank: int, dead: int) -> object:
    """Every rank starts on ``base``; ``dead`` leaves (its process ends). The survivors rebuild
    a group without it, compute the survivor placement alone, agree on it and switch to it
    through a Rollout (ProcessGroupBarrier + MoverApplier over the survivors' group)."""
    old = eplb.Placement.contiguous(TOPO)  # gpu 1 holds experts 3, 4, 5; 4 and 5 only there
    base = wire.PublishedPlacement("d1", 2, old, pb.PlanStats(), loads=_loads(1))
    if rank == dead:
        return "dead"
    survivors = [r for r in range(TOPO.num_gpus) if r != dead]
    # Only the survivors take part: the dead rank never calls new_group.
    group = dist.new_group(survivors, use_local_synchronization=True)
    # The mover's transfers run on the rollout's worker while the barrier reduces on the step
    # thread: a group of their own, as an engine gives its mover.
    movers = dist.new_group(survivors, use_local_synchronization=True)
    local = survivor_plan(base, [dead])
    assert _same_map(local.placement, group), "survivors computed different survivor placements"
    layers = encoded_layers(old, rank)
    calls: list = []
    applier = MoverApplier(layers, movers, restore=_restore(calls), verify=True)
    rollout = Rollout(base, applier, ProcessGroupBarrier(group))
    rollout.offer(local)
    step = 0
    while rollout.current.version != local.version and step < 2000:
        rollout.step(step)
        step += 1
    assert rollout.current.version == local.version, f"not switched after {step} steps: {rollout.events}"
    check_layers(layers, local.placement, rank)
    report = applier.report
    rollout.close()
    return {"restored": report.restored, "calls": len(calls), "ok": report.ok, "step": step}


def test_survivors_switch_to_their_own_survivor_placement_over_a_rebuilt_group():
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = spawn_ranks(_survivor_rank, 4, 1)
    assert out[1] == "dead"
    live = [out[r] for r in (0, 2, 3)]
    assert all(isinstance(r, dict) for r in live), live
    from eplb.transfer import transfer_schedule

    local = survivor_plan(
        wire.PublishedPlacement("d1", 2, eplb.Placement.contiguous(TOPO), pb.PlanStats(), loads=_loads(1)), [1]
    )
    want = transfer_schedule(eplb.Placement.contiguous(TOPO), local.placement, TOPO).restore_layer.size
    assert want > 0 and sum(r["restored"] for r in live) == want == sum(r["calls"] for r in live)
    assert all(r["ok"] for r in live)


@pytest.mark.parametrize("down", [[0, 1, 2]])
def test_too_few_live_slots_is_the_library_error(down):
    base = wire.PublishedPlacement("d1", 2, eplb.Placement.contiguous(TOPO), pb.PlanStats())
    with pytest.raises(ValueError, match=r"only 3 live slots .* 8 experts"):
        survivor_plan(base, down)


BR_TOPO = eplb.Topology(4, 6, 9, 3)  # contiguous: gpu 1 holds experts 3, 4, 5, their only replicas


def _balanced_rank(rank: int, address: str, dead: int, barrier: str) -> object:
    from eplb_engine import BalancedRank

    layers = encoded_layers(eplb.Placement.contiguous(BR_TOPO), rank)
    calls: list = []
    with BalancedRank(
        address,
        f"br-{barrier}",
        rank,
        BR_TOPO,
        layers,
        barrier=barrier,
        staging_bytes=None,
        timeout_s=20.0,
        restore=_restore(calls),
        verify=True,
    ) as br:
        dist.barrier()
        step = 0
        for step in range(3):
            check_layers(layers, br.step(step).placement, rank)
        if rank == dead:
            return "dead"  # its process ends: it never steps again
        survivors = [r for r in range(BR_TOPO.num_gpus) if r != dead]
        group = dist.new_group(survivors, use_local_synchronization=True)
        movers = dist.new_group(survivors, use_local_synchronization=True)
        survivor = br.ranks_down([dead], group, movers)
        deadline = time.monotonic() + 30
        while True:
            step += 1
            routed = br.step(step)
            check_layers(layers, routed.placement, rank)  # every live slot holds what its map routes to
            # Switched to the service's version of the survivor placement (with the group barrier:
            # the local one, then the service's adopted), agreed by both, as each step is collective.
            done = br.rollout.current.version == survivor.version and br.rollout.local_survivor is None
            flag = torch.tensor([int(done or time.monotonic() > deadline)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
            if flag.item():
                break
            time.sleep(0.002)
        assert _same_map(br.rollout.current.placement, group)
        check_layers(layers, survivor.placement, rank)
        report = br.applier.report
        return {
            "version": br.rollout.current.version,
            "phy2log": br.rollout.current.placement.phy2log.tolist(),
            "restored": report.restored,
            "calls": calls,
            "ok": report.ok,
        }


@pytest.mark.parametrize("barrier", ["group", "service"])
def test_balanced_ranks_carry_on_without_a_dead_rank_and_the_service_agrees(barrier):
    server = ServerThread().start()
    name = f"br-{barrier}"
    try:
        ch = grpc.insecure_channel(server.address)
        stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
        stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=wire.deployment_pb(name, BR_TOPO, switch_margin_steps=3))
        )
        out = spawn_ranks(_balanced_rank, 3, server.address, 1, barrier)
        published = stub.GetPlacement(pb.GetPlacementRequest(deployment=name)).placement
        info = stub.GetDeployment(pb.GetDeploymentRequest(name=name))
        ch.close()
    finally:
        server.stop()
    assert out[1] == "dead"
    live = [out[0], out[2]]
    assert all(isinstance(r, dict) and r["ok"] for r in live), live
    # Both survivors switched to the same survivor placement, gpu 1 empty, the lost experts
    # restored through the loader; the service (told by SetRanksDown) published the same map
    # (with the group barrier the ranks planned it themselves; with the service's, it came
    # through the watcher and the service switched the two live ranks).
    assert live[0]["phy2log"] == live[1]["phy2log"] and live[0]["version"] == 2
    got = np.array(live[0]["phy2log"])
    assert (got[:, 3:6] == -1).all()
    assert sum(r["restored"] for r in live) == sum(len(r["calls"]) for r in live) > 0
    assert {e for r in live for _, e in r["calls"]} <= {3, 4, 5}
    assert published.version == 2 and list(published.down_ranks) == [1] and published.survivor_of == 1
    assert np.array_equal(np.frombuffer(published.phy2log.data, "<i4").reshape(4, 9), got)
    assert list(info.down_ranks) == [1]
    # The survivors acked the survivor version; the dead rank took no part.
    assert sorted((a.rank, a.version) for a in info.acks if a.version == 2) == [(0, 2), (2, 2)]


def test_a_base_planned_with_another_eplb_release_is_warned_about(caplog):
    from dataclasses import replace

    from eplb_engine.survivors import EPLB_VERSION

    base = wire.PublishedPlacement("d1", 2, eplb.Placement.contiguous(TOPO), pb.PlanStats(), eplb_version=EPLB_VERSION)
    with caplog.at_level("WARNING", logger="eplb_engine.survivors"):
        same = survivor_plan(base, [1])
        assert not caplog.records and same.eplb_version == EPLB_VERSION
        other = survivor_plan(replace(base, eplb_version="0.0.1-other"), [1])
    (record,) = caplog.records
    assert "planned with eplb 0.0.1-other and this rank runs eplb" in record.getMessage()
    assert np.array_equal(other.placement.phy2log, same.placement.phy2log)  # planned all the same
