"""A survivor placement a rank computed by itself is known by (base version, down ranks), not
by its number: the service may publish a normal plan under that same number (base + 1), and
the ranks must then roll out to it; only the service's own survivor plan of the same pair is
taken without moving anything. Two gloo ranks, a real service, the real watcher."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist
from gloo_ranks import spawn_ranks
from svc_thread import ServerThread, report_some_load

import eplb
from eplb_engine.client import ServiceClient
from eplb_engine.rollout import AckSender, ProcessGroupBarrier, Rollout
from eplb_engine.survivors import survivor_plan
from eplb_engine.watcher import PlacementWatcher
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(3, 8, 16, 4, 2)  # 4 slots per gpu: gpu 3 down still holds every expert
DOWN = [3]


class Recorder:
    """An applier that records each move (old map, new map); the weights are not the point here."""

    def __init__(self) -> None:
        self.prepares: list[tuple[list, list]] = []

    def prepare(self, old: eplb.Placement, new: eplb.Placement) -> None:
        self.prepares.append((old.phy2log.tolist(), new.phy2log.tolist()))

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass


def _steps_until(rollout: Rollout, step: int, done, timeout_s: float = 20.0) -> int:
    """Steps until ``done()`` holds on every rank (or each rank's time is up): the ranks agree
    when to stop, since each step is a collective."""
    import torch

    deadline = time.monotonic() + timeout_s
    while True:
        rollout.step(step)
        step += 1
        flag = torch.tensor([int(done() or time.monotonic() > deadline)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item():
            return step
        time.sleep(0.005)


def _rank(rank: int, address: str, scenario: str, enter: str) -> dict:
    client = ServiceClient(address)
    base = client.get_placement("d1", topology=TOPO)
    applier = Recorder()
    rollout = Rollout(base, applier, ProcessGroupBarrier(dist.group.WORLD, acks=AckSender(client, "d1", rank)))
    # Gpu 3 died and the service is not heard from: both ranks switch to their own survivor plan.
    local = survivor_plan(base, DOWN)
    if enter == "rolled out":
        rollout.offer(local, supersede=True)
        step = _steps_until(rollout, 0, lambda: rollout.current is local)
    else:  # "moved outside": every rank moved the weights at one step itself (as a rejoin does)
        rollout.offer(base)  # an offer no newer than the local plan: dropped by route_moved
        rollout.route_moved(local, base)
        step = _steps_until(rollout, 0, lambda: False, timeout_s=0.2)
    assert rollout.current is local and rollout.routing is local.placement, rollout.events
    assert rollout.local_survivor is local
    dist.barrier()
    if rank == 0:
        if scenario == "normal plan":  # a normal plan from the base, numbered base + 1 like the local one
            client.rebalance("d1", force=True)
        else:  # the service's own survivor plan of (base, gpu 3 down)
            client.call("SetRanksDown", pb.SetRanksDownRequest(deployment="d1", down=DOWN))
    dist.barrier()
    published = client.get_placement("d1", topology=TOPO)
    time.sleep(0.3 * rank)  # the ranks learn of it at different steps
    watcher = PlacementWatcher(
        client.endpoints, "d1", rollout.offer, topology=TOPO, rank=rank, ack=False, since_version=base.version
    )
    step = _steps_until(
        rollout,
        step,
        lambda: (
            rollout.current.version == published.version
            and rollout.current.placement == published.placement
            and not rollout.mixed
        ),
    )
    # A few more steps: nothing else may happen.
    step = _steps_until(rollout, step, lambda: False, timeout_s=0.3)
    watcher.close()
    out = {
        "version": rollout.current.version,
        "phy2log": rollout.routing.phy2log.tolist(),
        "local": local.placement.phy2log.tolist(),
        "published": (published.version, published.survivor_of, published.placement.phy2log.tolist()),
        "prepares": applier.prepares,
        "events": [(e.kind, e.version) for e in rollout.events],
    }
    rollout.close()
    client.close()
    return out


def _run(scenario: str, enter: str = "rolled out") -> tuple[list[dict], list[tuple[int, int]]]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    server = ServerThread().start()
    try:
        with ServiceClient(server.address) as client:
            client.create_deployment("d1", TOPO)
            report_some_load(server.address, shape=(3, 8))
            out = spawn_ranks(_rank, 2, server.address, scenario, enter)
            reply = client.call("GetDeployment", pb.GetDeploymentRequest(name="d1"))
            acks = [(a.rank, a.version) for a in reply.acks]
    finally:
        server.stop()
    assert all(isinstance(r, dict) for r in out), out
    return out, acks


@pytest.mark.slow
def test_ranks_on_a_local_survivor_roll_out_a_normal_plan_that_took_its_number():
    out, acks = _run("normal plan")
    version, survivor_of, normal = out[0]["published"]
    assert (version, survivor_of) == (2, 0)  # the service's 2 is a normal plan, not a survivor one
    local = out[0]["local"]
    assert normal != local and out[1]["local"] == local
    for r in out:
        # They switched to the local plan, then moved from it to the service's version 2.
        assert r["version"] == 2 and r["phy2log"] == normal
        assert [new for _, new in r["prepares"]] == [local, normal] and r["prepares"][1][0] == local
        assert r["events"] == [("switched", 2), ("switched", 2)]
    # The local plan was never acked as version 2 (the service's 2 is another map): only the move to it.
    assert sorted(a for a in acks if a[1] == 2) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_ranks_on_a_local_survivor_adopt_the_services_survivor_plan_of_the_same_pair_without_moving():
    out, acks = _run("survivor plan")
    version, survivor_of, survivor = out[0]["published"]
    assert (version, survivor_of) == (2, 1) and survivor == out[0]["local"]
    for r in out:
        assert r["version"] == 2 and r["phy2log"] == survivor
        assert len(r["prepares"]) == 1  # the local plan's move only: adopting moved nothing
        assert r["events"] == [("switched", 2), ("adopted", 2)]
    assert sorted(a for a in acks if a[1] == 2) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_a_survivor_plan_moved_outside_the_rollout_is_adopted_as_one_it_switched_to():
    """``Rollout.route_moved``: the local plan's weights moved by the ranks themselves (no
    prepare here); the service's survivor plan of the same pair is then adopted, unmoved."""
    out, acks = _run("survivor plan", enter="moved outside")
    version, survivor_of, survivor = out[0]["published"]
    assert (version, survivor_of) == (2, 1) and survivor == out[0]["local"]
    for r in out:
        assert r["version"] == 2 and r["phy2log"] == survivor
        assert r["prepares"] == []  # neither the local plan nor the adoption went through the applier
        assert r["events"] == [("adopted", 2)]
    assert sorted(a for a in acks if a[1] == 2) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_a_survivor_plan_moved_outside_the_rollout_is_left_for_a_normal_plan_that_took_its_number():
    out, acks = _run("normal plan", enter="moved outside")
    version, survivor_of, normal = out[0]["published"]
    assert (version, survivor_of) == (2, 0)
    local = out[0]["local"]
    for r in out:
        # The move to the service's version 2 starts from the local map the ranks hold.
        assert r["version"] == 2 and r["phy2log"] == normal
        assert r["prepares"] == [(local, normal)]
        assert r["events"] == [("switched", 2)]
    assert sorted(a for a in acks if a[1] == 2) == [(0, 2), (1, 2)]
