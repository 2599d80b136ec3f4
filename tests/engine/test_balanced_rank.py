"""``BalancedRank`` against a real service: two gloo ranks in separate processes report loads,
get a re-plan, move their weights and switch at one step (chunk by chunk with the group
barrier, whole with the service barrier); every slot is checked against the routing map at
every step, and the loads recorded while the map was mixed went out folded per expert. The
combinations that cannot work are refused at construction."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from gloo_ranks import assert_same_map, spawn_ranks
from mover_sim import TENSORS, check_layers, encoded_layers
from svc_thread import ServerThread, free_port

import eplb
from eplb_engine import BalancedRank, Draft, ServiceClient
from eplb_engine.balanced_rank import fold_slot_counts
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

TOPO = eplb.Topology(num_layers=6, num_experts=6, num_slots=10, num_gpus=2)
SLOT = sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values())
HOT = np.array([1.0] * 5 + [40.0])  # expert 5 takes most tokens: a re-plan replicates it


def slot_counts(placement: eplb.Placement, step: int) -> np.ndarray:
    """``[L, P]`` tokens one step sends to each slot: ``HOT`` per expert split over its replicas."""
    rows = np.arange(placement.topology.num_layers)[:, None]
    return (HOT * (10 + step % 3))[placement.phy2log] / placement.logcnt[rows, placement.phy2log]


def acks(address: str, deployment: str) -> list[tuple[int, int]]:
    with ServiceClient(address) as client:
        got = client.call("GetDeployment", pb.GetDeploymentRequest(name=deployment)).acks
        return [(a.rank, a.version) for a in got]


def _rank(rank: int, address: str, barrier: str) -> dict:
    deployment = f"d-{barrier}"
    layers = encoded_layers(eplb.Placement.contiguous(TOPO), rank)
    budget = TOPO.slots_per_gpu * SLOT if barrier == "group" else None  # group: several chunks a version
    switches: list[tuple[int, tuple[int, ...]]] = []
    with BalancedRank(
        address,
        deployment,
        rank,
        TOPO,
        layers,
        barrier=barrier,
        staging_bytes=budget,
        timeout_s=20.0,
        report_interval_s=0.1,
        on_switch=lambda step, lay, routing: switches.append((step, tuple(lay))),
        verify=True,
    ) as br:
        added: list[tuple[tuple[int, ...], int | None, bool]] = []
        add = br.reporter.add

        def spy(counts, version=None, **kw):  # the real add, remembering what it was given
            added.append((tuple(counts.shape), version, br.rollout.mixed))
            return add(counts, version, **kw)

        br.reporter.add = spy
        dist.barrier()
        at_start = acks(address, deployment)
        deadline, step, mixed_steps = time.monotonic() + 60, 0, 0
        while True:
            routed = br.step(step)
            check_layers(layers, routed.placement, rank)  # every slot holds what the map routes to it
            assert_same_map(routed.placement, step)
            mixed_steps += br.rollout.mixed
            br.record(slot_counts(routed.placement, step))
            if step == 5:
                assert br.reporter.flush(10)
                dist.barrier()  # both ranks' loads are in the window
                if rank == 0:
                    assert br.client.rebalance(deployment, force=True).published
            stop = torch.tensor([int(br.rollout.current.version >= 2 or time.monotonic() > deadline)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
            step += 1
            time.sleep(0.005)
        report = br.applier.report
        res = {
            "acks_at_start": at_start,
            "version": br.rollout.current.version,
            "events": [(e.kind, e.version, e.chunks) for e in br.rollout.events],
            "switches": switches,
            "mixed_steps": mixed_steps,
            "added": added,
            "mismatches": len(report.mismatches),
            "checked": report.checked_slots,
            "final": br.rollout.routing.phy2log.tolist(),
        }
    stats = br.reporter.stats()
    res["stats"] = (stats.accepted, stats.rejected, stats.invalid_adds, stats.pending)
    dist.barrier()
    res["acks_at_end"] = acks(address, deployment)
    return res


@pytest.mark.slow
@pytest.mark.parametrize("barrier", ["group", "service"])
def test_two_ranks_switch_a_replan_through_balanced_rank(barrier):
    server = ServerThread().start()
    try:
        with ServiceClient(server.address) as client:
            client.create_deployment(
                f"d-{barrier}", TOPO, interval_s=3600, switch_margin_steps=20, expert_bytes=SLOT
            )  # only the forced re-plan
        runs = spawn_ranks(_rank, 2, server.address, barrier)
    finally:
        server.stop()
    # BalancedRank acked the version each rank started on, and the rollout the one it switched to.
    assert runs[0]["acks_at_start"] == [(0, 1), (1, 1)] and runs[1]["acks_at_end"] == [(0, 2), (1, 2)]
    for run in runs:
        assert run["version"] == 2 and run["switches"] == runs[0]["switches"] and run["final"] == runs[0]["final"]
        assert run["mismatches"] == 0
        accepted, rejected, invalid, pending = run["stats"]
        assert accepted > 0 and rejected == invalid == pending == 0
        logical, physical = (TOPO.num_layers, TOPO.num_experts), (TOPO.num_layers, TOPO.num_slots)
        # Mixed steps' counts went out per expert, the others per slot tagged with the version routed.
        assert {(shape, version) for shape, version, mixed in run["added"] if mixed} == (
            {(logical, None)} if run["mixed_steps"] else set()
        )
        assert {(shape, version) for shape, version, mixed in run["added"] if not mixed} == {
            (physical, 1),
            (physical, 2),
        }
    assert sum(run["checked"] for run in runs) > 0  # verify=True reached the mover: written slots were checked
    chunks = runs[0]["events"][0][2]
    assert [e[:2] for e in runs[0]["events"]] == [("switched", 2)]
    if barrier == "group":  # the budget of one gpu's slots cuts the re-plan into chunks, switched one by one
        assert chunks > 1 and runs[0]["mixed_steps"] > 0 and len(runs[0]["switches"]) == chunks
    else:
        assert chunks == 1 and runs[0]["mixed_steps"] == 0


def test_fold_slot_counts_adds_each_slot_to_its_expert():
    placement = eplb.Placement(np.array([[0, 1, 2, 2], [2, 0, 1, 2]]), eplb.Topology(2, 3, 4, 2))
    counts = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    want = np.array([[1.0, 2.0, 7.0], [6.0, 7.0, 13.0]])
    np.testing.assert_array_equal(fold_slot_counts(counts, placement), want)
    got = fold_slot_counts(torch.from_numpy(counts), placement)
    assert isinstance(got, torch.Tensor) and torch.equal(got, torch.from_numpy(want))


@pytest.fixture
def one_rank():
    """A real service and a gloo world of one, with deployment ``one`` (1 gpu) and ``two`` (2)."""
    server = ServerThread().start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        with ServiceClient(server.address) as client:
            client.create_deployment("one", eplb.Topology(2, 4, 6, 1))
            client.create_deployment("two", eplb.Topology(2, 4, 6, 2))
        yield server.address
    finally:
        dist.destroy_process_group()
        server.stop()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(barrier="service"), "barrier='service' agrees one switch step per version"),
        (dict(barrier="service", staging_bytes=None, chunk_layers=2), "chunk_layers=2"),
        (dict(barrier="nccl"), "barrier must be 'group'"),
        (dict(applier=object()), "applier= replaces the MoverApplier: leave layers"),
        (dict(rank=1), "rank=1 but this process is rank 0 of the group: pass rank=0"),
        (dict(group="world", mover_group="world"), "mover_group must not be the group the barrier runs on"),
        (dict(topology=eplb.Topology(2, 4, 8, 1)), "differs from deployment 'one'"),
        (dict(deployment="two", topology=None), "deployment 'two' has num_gpus = 2; the process group has 1 ranks"),
        (dict(layers="short"), "layers has 1 entries; the topology has num_layers = 2"),
        (dict(barrier="service", staging_bytes=None, draft="one-draft"), "use barrier='group' with a draft"),
        (dict(draft="one"), "the draft needs a deployment of its own, not 'one' again"),
    ],
)
def test_inconsistent_options_are_refused_at_construction(one_rank, kwargs, message):
    topo = eplb.Topology(2, 4, 6, 1)
    args = dict(
        addresses=one_rank,
        deployment="one",
        rank=0,
        topology=topo,
        layers=encoded_layers(eplb.Placement.contiguous(topo), 0),
    )
    args.update(kwargs)
    if args.get("group") == "world":
        args["group"] = args["mover_group"] = dist.group.WORLD
    if "draft" in args:
        args["draft"] = Draft(args["draft"], args["layers"])
    if args["layers"] == "short":
        args["layers"] = encoded_layers(eplb.Placement.contiguous(topo), 0)[:1]
    with pytest.raises(ValueError, match=re.escape(message)):
        BalancedRank(**args)
    # A refused construction acked nothing: the service still has no rank on any version.
    assert acks(one_rank, "one") == []


DOC = Path(__file__).resolve().parents[2] / "docs" / "rollout.md"


def _doc_rank(rank: int, address: str) -> tuple:
    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)[0]
    ns = {
        "rank": rank,
        "topology": TOPO,
        "layers": encoded_layers(eplb.Placement.contiguous(TOPO), rank),
        "steps": 30,
        "run_step": lambda log2phy, logcnt: slot_counts(eplb.Placement.contiguous(TOPO), 0),
    }
    exec(compile(block.replace("127.0.0.1:50051", address), str(DOC), "exec"), ns)
    stats = ns["balanced"].reporter.stats()
    dist.barrier()
    return stats.added, stats.accepted, stats.pending, acks(address, "my-model")


@pytest.mark.slow
def test_the_rollout_guides_balanced_rank_block_runs_as_written():
    server = ServerThread().start()
    try:
        with ServiceClient(server.address) as client:
            client.create_deployment("my-model", TOPO)
        out = spawn_ranks(_doc_rank, 2, server.address)
    finally:
        server.stop()
    # Each rank recorded its 30 steps, all sent and accepted by the time the block's `with` closed.
    assert out[0][0] == out[1][0] == 30 and out[0][1] > 0 and out[0][2] == out[1][2] == 0, out
    assert out[1][3] == [(0, 1), (1, 1)]
