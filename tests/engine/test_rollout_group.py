"""The rollout protocol through the engine's own process group: ranks on gloo in separate
processes agree on one switch step, and a failed or timed-out prepare aborts everywhere."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from svc_thread import free_port

import eplb
from eplb_engine.rollout import Decision, Local, ProcessGroupBarrier, Rollout
from eplb_engine.wire import PublishedPlacement
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(num_layers=2, num_experts=4, num_slots=6, num_gpus=2)


def published(version: int) -> PublishedPlacement:
    rng = np.random.default_rng(version)
    phy2log = np.concatenate([rng.permutation(4), rng.integers(0, 4, 2)])[None].repeat(2, axis=0)
    return PublishedPlacement("d1", version, eplb.Placement(phy2log, TOPO), pb.PlanStats())


class Recorder:
    """An applier that records calls; ``fail`` makes prepare raise, ``delay_s`` makes it slow."""

    def __init__(self, fail: bool = False, delay_s: float = 0.0) -> None:
        self.fail, self.delay_s, self.calls = fail, delay_s, []

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        self.calls.append("prepare")
        time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("staging buffer allocation failed")

    def commit(self) -> None:
        self.calls.append("commit")

    def rollback(self) -> None:
        self.calls.append("rollback")


def run_steps(rollout: Rollout, offers: dict[int, PublishedPlacement], steps: int) -> list[int]:
    """Steps 0..steps-1 with 2 ms each, offering at the given steps; the version routed per step."""
    routed = []
    for step in range(steps):
        if step in offers:
            rollout.offer(offers[step])
        routed.append(rollout.step(step).version)
        time.sleep(0.002)
    return routed


def _worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        barrier = ProcessGroupBarrier()
        results = {}
        # 1. Ranks learn of version 2 at different steps; all switch at one step.
        applier = Recorder(delay_s=0.02 * rank)
        rollout = Rollout(published(1), applier, barrier)
        routed = run_steps(rollout, {3 + 4 * rank: published(2)}, 60)
        results["agree"] = (routed, applier.calls, [(e.kind, e.version) for e in rollout.events])
        # 2. Rank 1 fails to prepare version 3: everyone keeps version 2 and rolls back.
        applier = Recorder(fail=rank == 1)
        rollout = Rollout(published(2), applier, barrier)
        routed = run_steps(rollout, {1: published(3)}, 30)
        results["fail"] = (routed, applier.calls, [(e.kind, e.version, e.error) for e in rollout.events])
        # 3. Rank 0's prepare (0.9 s) outlives the timeout (0.4 s); the others prepare in 0.25 s,
        # so they are waiting when rank 0 fails at 0.4 s (they would give up only at 0.65 s):
        # they abort, rank 0 rolls back once its prepare returns; a newer version then goes through.
        applier = Recorder(delay_s=0.9 if rank == 0 else 0.25)
        rollout = Rollout(published(3), applier, barrier, timeout_s=0.4)
        routed = run_steps(rollout, {1: published(4)}, 700)
        applier.delay_s = 0.0
        routed += run_steps(rollout, {0: published(5)}, 30)
        results["timeout"] = (routed, applier.calls, [(e.kind, e.version, e.error) for e in rollout.events])
        out[rank] = results
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes():
    world = 3
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(world, free_port(), out), nprocs=world, join=True)
        return dict(out)


@pytest.mark.slow
def test_all_ranks_switch_at_the_same_step(outcomes):
    routed = [outcomes[r]["agree"][0] for r in range(3)]
    assert routed[0] == routed[1] == routed[2]
    first = routed[0].index(2)
    # Rank 2 had version 2 only from step 11: nobody prepared (let alone switched) before.
    assert first > 11 and set(routed[0][:first]) == {1} and set(routed[0][first:]) == {2}
    for r in range(3):
        assert outcomes[r]["agree"][1] == ["prepare", "commit"]
        assert outcomes[r]["agree"][2] == [("switched", 2)]


@pytest.mark.slow
def test_a_failed_prepare_rolls_back_everywhere(outcomes):
    for r in range(3):
        routed, calls, events = outcomes[r]["fail"]
        assert set(routed) == {2}
        assert calls == ["prepare", "rollback"]
    assert outcomes[1]["fail"][2] == [("failed", 3, "RuntimeError: staging buffer allocation failed")]
    assert outcomes[0]["fail"][2] == outcomes[2]["fail"][2] == [("aborted", 3, "")]


@pytest.mark.slow
def test_a_timed_out_prepare_aborts_and_a_newer_version_goes_through(outcomes):
    routed = [outcomes[r]["timeout"][0] for r in range(3)]
    assert routed[0] == routed[1] == routed[2]
    assert 4 not in routed[0] and routed[0][-1] == 5
    assert outcomes[0]["timeout"][2] == [
        ("failed", 4, "prepare of version 4 timed out after 0.4 s"),
        ("switched", 5, ""),
    ]
    for r in (1, 2):
        assert outcomes[r]["timeout"][2] == [("aborted", 4, ""), ("switched", 5, "")]
    assert outcomes[0]["timeout"][1] == ["prepare", "rollback", "prepare", "commit"]


def test_barrier_decisions_on_one_rank():
    """A group of one: the decision table without peers."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        b = ProcessGroupBarrier()
        assert b.sync(0, Local(current=1, offered=1, target=0, prepared=False, failed="")) == Decision()
        assert b.sync(1, Local(current=1, offered=3, target=0, prepared=False, failed="")) == Decision(start=3)
        assert b.sync(2, Local(current=1, offered=3, target=3, prepared=False, failed="")) == Decision()
        assert b.sync(3, Local(current=1, offered=3, target=3, prepared=True, failed="")) == Decision(switch=True)
        assert b.sync(4, Local(current=1, offered=3, target=3, prepared=False, failed="boom")) == Decision(abort=True)
    finally:
        dist.destroy_process_group()
