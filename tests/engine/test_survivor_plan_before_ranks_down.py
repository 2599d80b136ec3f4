"""The service's survivor placement can reach a rank before that rank's own ``ranks_down``
runs (a faster peer's SetRanksDown made it). When the service planned it from a version in
flight, its number is not the local plan's (base + 1): a rank that dropped it offered the
local number while its peers offered the service's, and the survivors never agreed a start
(the demo's ``recovered_step`` -1). Two gloo ranks, the real barrier, no service: the
service's placement is built here (only its arrival order matters)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import spawn_ranks

import eplb
from eplb_engine.rollout import ProcessGroupBarrier, Rollout
from eplb_engine.survivors import survivor_plan
from eplb_engine.wire import PublishedPlacement
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(3, 8, 16, 4, 2)  # 4 slots per gpu: gpu 3 down still holds every expert
DOWN = [3]


class Recorder:
    """An applier that records each move's target map; the weights are not the point here."""

    def __init__(self) -> None:
        self.prepares: list[list] = []

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        self.prepares.append(new.phy2log.tolist())

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass


def _rank(rank: int) -> dict:
    base = PublishedPlacement("d1", 1, eplb.Placement.contiguous(TOPO), pb.PlanStats())
    loads = np.arange(1, 1 + TOPO.num_layers * TOPO.num_experts, dtype=float).reshape(TOPO.num_layers, -1) ** 2
    # Version 2, a normal re-plan the service published and the ranks had not started when gpu 3
    # died; the service's survivor plan comes from it (version 3, survivor of 2).
    in_flight = PublishedPlacement("d1", 2, eplb.rebalance(loads, TOPO).placement, pb.PlanStats(), loads=loads)
    service = survivor_plan(in_flight, DOWN)
    rollout = Rollout(base, Recorder(), ProcessGroupBarrier(dist.group.WORLD))
    local = survivor_plan(base, DOWN)  # ranks_down's: version 2, survivor of 1
    if rank == 0:  # ranks_down first, then the watcher delivers the service's plan
        rollout.offer(local, supersede=True)
        rollout.offer(service)
    else:  # the watcher was faster than this rank's ranks_down
        rollout.offer(service)
        rollout.offer(local, supersede=True)
    deadline, step = time.monotonic() + 5.0, 0
    while True:
        rollout.step(step)
        step += 1
        done = rollout.current.version == service.version and not rollout.mixed
        flag = torch.tensor([int(done or time.monotonic() > deadline)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            break
        time.sleep(0.002)
    out = {
        "version": rollout.current.version,
        "phy2log": rollout.routing.phy2log.tolist(),
        "service": service.placement.phy2log.tolist(),
        "prepares": rollout.applier.prepares,
        "events": [(e.kind, e.version) for e in rollout.events],
    }
    rollout.close()
    return out


@pytest.mark.slow
def test_a_service_survivor_plan_that_came_before_ranks_down_is_still_rolled_out():
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = spawn_ranks(_rank, 2)
    assert all(isinstance(r, dict) for r in out), out
    for r in out:
        # Before the fix rank 1 offered the local version 2, rank 0 the service's 3: no start, ever.
        assert r["version"] == 3 and r["phy2log"] == r["service"], r["events"]
        assert r["prepares"] == [r["service"]] and r["events"] == [("switched", 3)]
