"""A target model and its draft as two deployments on the same ranks (``RolloutGroup``): gloo
ranks in separate processes; when both change they switch at one step, when one changes alone
it switches alone, when one fails the other goes on. Then ``BalancedRank(draft=...)`` against a
real service, through a re-plan of both with real weights."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import assert_same_map, spawn_ranks
from mover_sim import TENSORS, check_layers, encoded_layers
from svc_thread import ServerThread
from test_rollout_group import Recorder, published

import eplb
from eplb_engine import BalancedRank, Draft, ServiceClient
from eplb_engine.rollout import ProcessGroupBarrier, Rollout, RolloutGroup, ServiceBarrier
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb


def run(group: RolloutGroup, offers: dict[tuple[int, int], object], steps: int) -> list[tuple[int, int]]:
    """Steps of 5 ms, offering ``offers[(step, part)]``; the versions routed per step."""
    routed = []
    for step in range(steps):
        for (at, part), placement in offers.items():
            if at == step:
                group.rollouts[part].offer(placement)
        routed.append(tuple(p.version for p in group.step(step)))
        time.sleep(0.005)
    return routed


def events(rollout: Rollout) -> list[tuple[str, int, int]]:
    return [(e.kind, e.version, e.step) for e in rollout.events]


def _worker(rank: int) -> dict:
    res = {}
    # 1. Both change: the target prepares slowly (0.4 s), the draft at once and with a
    # timeout (0.15 s) shorter than its wait for the target: it waits, and does not time out.
    target = Rollout(published(1), Recorder(delay_s=0.4), ProcessGroupBarrier())
    draft = Rollout(published(1), Recorder(), ProcessGroupBarrier(), timeout_s=0.15)
    group = RolloutGroup([target, draft])
    routed = run(group, {(2, 0): published(2), (3 + rank, 1): published(2)}, 160)
    res["both"] = (routed, events(target), events(draft))
    # 2. Only the draft changes: it switches alone.
    routed = run(group, {(1, 1): published(3)}, 40)
    res["draft_alone"] = (routed, events(target), events(draft))
    # 3. The target fails on rank 1 while the draft changes: the draft goes on.
    target.applier.delay_s, target.applier.fail = 0.05, rank == 1
    routed = run(group, {(1, 0): published(3), (1, 1): published(4)}, 60)
    res["target_fails"] = (routed, events(target), events(draft))
    group.close()
    return res


@pytest.fixture(scope="module")
def outcomes():
    return spawn_ranks(_worker, 2)


@pytest.mark.slow
def test_when_both_change_they_switch_at_the_same_step(outcomes):
    assert outcomes[0]["both"] == outcomes[1]["both"]  # every rank alike
    routed, target, draft = outcomes[0]["both"]
    assert [e[:2] for e in target] == [e[:2] for e in draft] == [("switched", 2)]
    step = target[0][2]
    assert draft[0][2] == step  # the ready draft waited for the target, past its own timeout_s
    assert set(routed[:step]) == {(1, 1)} and set(routed[step:]) == {(2, 2)}


@pytest.mark.slow
def test_one_that_changes_alone_switches_alone(outcomes):
    routed, target, draft = outcomes[0]["draft_alone"]
    assert outcomes[1]["draft_alone"] == (routed, target, draft)
    assert [e[:2] for e in target] == [("switched", 2)] and [e[:2] for e in draft] == [("switched", 2), ("switched", 3)]
    assert routed[-1] == (2, 3)


@pytest.mark.slow
def test_a_failing_target_does_not_stop_the_draft(outcomes):
    for rank, kind in ((0, "aborted"), (1, "failed")):
        routed, target, draft = outcomes[rank]["target_fails"]
        assert [e[:2] for e in target][-1] == (kind, 3)
        assert [e[:2] for e in draft][-1] == ("switched", 4) and routed[-1] == (2, 4)


def test_a_group_needs_process_group_barriers_of_their_own():
    recorder = Recorder()
    with pytest.raises(ValueError, match="every rollout needs a ProcessGroupBarrier, got ServiceBarrier"):
        RolloutGroup([Rollout(published(1), recorder, ServiceBarrier.__new__(ServiceBarrier))])
    shared = ProcessGroupBarrier()
    with pytest.raises(ValueError, match="a ProcessGroupBarrier of its own"):
        RolloutGroup([Rollout(published(1), recorder, shared), Rollout(published(1), recorder, shared)])


TARGET = eplb.Topology(num_layers=4, num_experts=6, num_slots=10, num_gpus=2)
DRAFT = eplb.Topology(num_layers=1, num_experts=4, num_slots=6, num_gpus=2)  # experts of its own
SLOT = sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values())


def hot_counts(placement: eplb.Placement) -> np.ndarray:
    """``[L, P]`` tokens per slot with the last expert 40 times as popular as the others."""
    topo = placement.topology
    hot = np.array([1.0] * (topo.num_experts - 1) + [40.0]) * 10
    rows = np.arange(topo.num_layers)[:, None]
    return hot[placement.phy2log] / placement.logcnt[rows, placement.phy2log]


def _rank(rank: int, address: str) -> dict:
    layers = encoded_layers(eplb.Placement.contiguous(TARGET), rank)
    draft_layers = encoded_layers(eplb.Placement.contiguous(DRAFT), rank)
    with BalancedRank(
        address,
        "target",
        rank,
        TARGET,
        layers,
        chunk_layers=1,  # the target switches layer by layer: its last chunk goes with the draft
        report_interval_s=0.1,
        timeout_s=20.0,
        draft=Draft("target-draft", draft_layers, DRAFT),
    ) as br:
        deadline, step = time.monotonic() + 60, 0
        while True:
            routed = br.step(step)
            check_layers(layers, routed.placement, rank)
            check_layers(draft_layers, br.draft.routed.placement, rank)
            assert_same_map(routed.placement, step)
            assert_same_map(br.draft.routed.placement, step)
            br.record(hot_counts(routed.placement))
            br.draft.record(hot_counts(br.draft.routed.placement))
            if step == 5:
                assert br.reporter.flush(10) and br.draft.reporter.flush(10)
                dist.barrier()
                if rank == 0:  # both re-planned at once
                    assert br.client.rebalance("target", force=True).published
                    assert br.client.rebalance("target-draft", force=True).published
            done = min(p.rollout.current.version for p in br.parts) >= 2
            stop = torch.tensor([int(done or time.monotonic() > deadline)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
            step += 1
            time.sleep(0.005)
        events = [[(e.kind, e.version, e.step, e.chunks) for e in p.rollout.events] for p in br.parts]
    dist.barrier()
    with ServiceClient(address) as client:
        got = [
            [(a.rank, a.version) for a in client.call("GetDeployment", pb.GetDeploymentRequest(name=n)).acks]
            for n in ("target", "target-draft")
        ]
    return {"events": events, "acks": got}


@pytest.mark.slow
def test_balanced_rank_switches_a_target_and_its_draft_together():
    server = ServerThread().start()
    try:
        with ServiceClient(server.address) as client:
            client.create_deployment("target", TARGET, interval_s=3600, expert_bytes=SLOT)
            client.create_deployment("target-draft", DRAFT, interval_s=3600, expert_bytes=SLOT)
        out = spawn_ranks(_rank, 2, server.address)
    finally:
        server.stop()
    assert out[0]["events"] == out[1]["events"], out  # every slot was checked against its map at every step
    (target,), (draft,) = out[0]["events"]
    assert target[:2] == ("switched", 2) and draft[:2] == ("switched", 2)
    assert target[3] > 1 and target[2] == draft[2]  # the target in chunks; its last chunk with the draft
    assert out[1]["acks"] == [[(0, 2), (1, 2)], [(0, 2), (1, 2)]]  # each deployment's own versions
