"""Chunked rollouts over real gloo process groups (2 and 4 processes): ``MoverApplier`` with a
staging budget that forces several chunks, ``ProcessGroupBarrier`` agreeing a step per chunk.
Every rank checks at every step that every local slot holds the expert its routing map says
(so every routed (layer, expert) reaches a slot holding it) and that all ranks route with the
same map; a failure in a later chunk moves the switched layers back, and a failure while
moving back leaves a mixed map that the next version moves from."""

from __future__ import annotations

import os
import time
import traceback
import zlib
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from mover_sim import TENSORS, check_layers, encoded_layers
from svc_thread import free_port

import eplb
from eplb_engine.rollout import MoverApplier, ProcessGroupBarrier, Rollout
from eplb_engine.wire import PublishedPlacement
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

SLOT = sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values())
STEPS = 160


def topology(world: int) -> eplb.Topology:
    return eplb.Topology(6, 2 * world + 2, 4 * world, world, 2 if world == 4 else 1)


def published(version: int, topo: eplb.Topology) -> PublishedPlacement:
    rng = np.random.default_rng(1000 + version)
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
    return PublishedPlacement("d1", version, eplb.Placement(rng.permuted(rows, axis=1), topo), pb.PlanStats())


class Faulty(MoverApplier):
    """``MoverApplier`` that raises after the transfers of chunk ``k`` of its ``n``-th
    transition (``fail`` holds ``(n, k)``), so no peer is left waiting in a transfer."""

    def __init__(self, *args, fail=(), **kw) -> None:
        super().__init__(*args, **kw)
        self.fail, self.transitions, self.chunk = set(fail), 0, 0

    def prepare(self, old, new) -> None:
        self.transitions += 1
        self.chunk = 0
        super().prepare(old, new)

    def prepare_next(self) -> None:
        super().prepare_next()
        if (self.transitions, self.chunk) in self.fail:
            raise RuntimeError(f"injected failure in chunk {self.chunk} of transition {self.transitions}")
        self.chunk += 1


def run_scenario(rank: int, layers, held: PublishedPlacement, applier, offers: dict[int, PublishedPlacement]) -> dict:
    """``STEPS`` steps of 1 ms, offering at the given steps; the weights checked at every step."""
    switches: list[tuple[int, tuple[int, ...]]] = []
    rollout = Rollout(
        held,
        applier,
        ProcessGroupBarrier(),
        timeout_s=20.0,
        on_switch=lambda step, lay, routing: switches.append((step, tuple(lay))),
    )
    routed, mixed_steps = [], 0
    for step in range(STEPS):
        if step in offers:
            rollout.offer(offers[step])
        current = rollout.step(step)
        check_layers(layers, current.placement, rank)  # every slot holds what the map routes to it
        crc = zlib.crc32(current.placement.phy2log.tobytes())
        agree = torch.tensor([crc, -crc], dtype=torch.int64)
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)
        assert agree[0] == -agree[1], f"ranks route with different maps at step {step}"
        routed.append(current.version)
        mixed_steps += rollout.mixed
        time.sleep(0.001)
    events = [(e.kind, e.version, e.chunks, e.error) for e in rollout.events]
    return {
        "routed": routed,
        "switches": switches,
        "events": events,
        "mixed_steps": mixed_steps,
        "chunks": applier.chunks,
        "final": rollout.routing.phy2log.tolist(),
        "current": rollout.current.version,
        "mixed": rollout.mixed,
    }


def _worker(rank: int, world: int, port: int, out) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
        mover_group = dist.new_group(backend="gloo")
        topo = topology(world)
        v = {n: published(n, topo) for n in range(1, 7)}
        budget = topo.slots_per_gpu * SLOT  # one layer always fits; several chunks per version
        layers = encoded_layers(v[1].placement, rank)
        res = {}
        # 1. v1 -> v2, ranks learning of it at different steps.
        res["through"] = run_scenario(
            rank, layers, v[1], Faulty(layers, mover_group, staging_bytes=budget, verify=True), {2 + 3 * rank: v[2]}
        )
        # 2. v2 -> v3 fails on rank 1 after chunk 0 switched (chunk 1's prepare): all move back to v2; v4 goes through.
        res["revert"] = run_scenario(
            rank,
            layers,
            v[2],
            Faulty(layers, mover_group, staging_bytes=budget, fail={(1, 1)} if rank == 1 else ()),
            {1: v[3], 100: v[4]},
        )
        # 3. v4 -> v5 fails on rank 0 in chunk 1; moving back fails on the last rank: the map stays mixed; v6 moves from it.
        fail = {(1, 1)} if rank == 0 else {(2, 0)} if rank == world - 1 else ()
        res["partial"] = run_scenario(
            rank, layers, v[4], Faulty(layers, mover_group, staging_bytes=budget, fail=fail), {1: v[5], 100: v[6]}
        )
        out[rank] = res
        dist.destroy_process_group()
    except BaseException:  # reported to the parent, which fails the test with it
        out[rank] = traceback.format_exc()
        raise


@pytest.fixture(scope="module", params=[2, 4])
def outcome(request):
    world = request.param
    ctx = mp.get_context("fork")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_worker, args=(r, world, PORTS[world], out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        for p in procs:
            if p.is_alive():
                p.kill()
        res = dict(out)
    for r in range(world):
        assert isinstance(res.get(r), dict), res.get(r, f"rank {r} hung")
    return world, res


PORTS = {2: free_port(), 4: free_port()}


@pytest.mark.slow
def test_a_version_switches_chunk_by_chunk_at_the_same_steps_everywhere(outcome):
    world, res = outcome
    runs = [res[r]["through"] for r in range(world)]
    topo = topology(world)
    chunks = runs[0]["chunks"]
    assert len(chunks) >= 3 and [layer for c in chunks for layer in c] == list(range(topo.num_layers))
    for run in runs:
        assert run["chunks"] == chunks and run["switches"] == runs[0]["switches"]
        assert [lay for _, lay in run["switches"]] == list(chunks)
        assert run["events"] == [("switched", 2, len(chunks), "")]
        assert run["final"] == published(2, topo).placement.phy2log.tolist() and not run["mixed"]
    steps = [s for s, _ in runs[0]["switches"]]
    assert steps == sorted(set(steps)) and steps[0] >= 2 + 3 * (world - 1)  # the last rank learnt of v2 at that step
    # between the first and the last chunk switch the map mixed versions (the check held at every step)
    assert runs[0]["mixed_steps"] == steps[-1] - steps[0] > 0
    assert runs[0]["routed"][steps[-1]] == 2 and set(runs[0]["routed"][: steps[-1]]) == {1}


def _failure_runs(outcome, scenario: str, failing_rank: int, failed: int, then: list[tuple[str, int]]) -> list[dict]:
    """Each rank's run of ``scenario``, checked for what a failed version leaves on every rank:
    ``failed`` failed on ``failing_rank`` and was aborted on the others, then came ``then``
    (ending with the version every rank holds at the end), at the same switch steps everywhere."""
    world, res = outcome
    final = published(then[-1][1], topology(world)).placement.phy2log.tolist()
    runs = [res[r][scenario] for r in range(world)]
    for r, run in enumerate(runs):
        kinds = [(k, ver) for k, ver, _, _ in run["events"]]
        assert kinds == [("failed" if r == failing_rank else "aborted", failed), *then], run["events"]
        assert run["final"] == final and run["switches"] == runs[0]["switches"]
    return runs


@pytest.mark.slow
def test_a_failure_after_chunks_switched_moves_them_back_everywhere(outcome):
    for r, run in enumerate(_failure_runs(outcome, "revert", 1, 3, [("reverted", 2), ("switched", 4)])):
        assert run["events"][0][2] == 1 and len(run["switches"]) > 2  # chunk 0 had switched when chunk 1 failed
        if r == 1:
            assert run["events"][0][3] == "RuntimeError: injected failure in chunk 1 of transition 1"
        assert run["current"] == 4 and 3 not in run["routed"]


@pytest.mark.slow
def test_a_failed_move_back_leaves_a_mixed_map_that_the_next_version_moves_from(outcome):
    for run in _failure_runs(outcome, "partial", 0, 5, [("partial", 4), ("switched", 6)]):
        assert not run["mixed"]
