"""WeightMover on ranks simulated as threads: any old -> new pair, both modes, in place.

``EPLB_TEST_DEVICE=cuda`` runs the random transitions on GPU tensors (each rank's mover on
its own CUDA stream); the default is CPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from mover_sim import TENSORS, ThreadWorld, check_layers, encoded_layers

import eplb
from eplb_engine import WeightMover
from eplb_engine.survivors import GroupMismatch
from eplb_engine.transport import P2P


def _random_placement(topo: eplb.Topology, rng: np.random.Generator) -> eplb.Placement:
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
    return eplb.Placement(rng.permuted(rows, axis=1), topo)


def _random_pair(topo: eplb.Topology, seed: int) -> tuple[eplb.Placement, eplb.Placement]:
    """Two random placements (old, new) of ``topo`` from ``seed``."""
    rng = np.random.default_rng(seed)
    return _random_placement(topo, rng), _random_placement(topo, rng)


def _cross_gpu_swap() -> tuple[eplb.Placement, eplb.Placement]:
    """One layer of 4 experts on 2 gpus, old -> new: slot 0 (gpu 0) and slot 2 (gpu 1) swap."""
    topo = eplb.Topology(1, 4, 4, 2)
    return eplb.Placement(np.array([[0, 1, 2, 3]]), topo), eplb.Placement(np.array([[2, 1, 0, 3]]), topo)


DEVICE = os.environ.get("EPLB_TEST_DEVICE", "cpu")


def _move(world: ThreadWorld, old: eplb.Placement, new: eplb.Placement, mode: str, **kw):
    """Every rank moves old -> new in ``mode``; returns per-rank (layers, reports)."""

    def rank(r: int):
        layers = encoded_layers(old, r, device=DEVICE)
        storage = [t.data_ptr() for layer in layers for t in layer.values()]
        mover = WeightMover(layers, old, new, transport=world.transport(r), **kw)
        reports = []
        if mode == "staged":
            while mover.prepare():
                pass
            reports.append(mover.commit())
        else:
            while not mover.done:
                reports.append(mover.step())
        mover.synchronize()
        assert [t.data_ptr() for layer in layers for t in layer.values()] == storage, "tensors were reallocated"
        return layers, reports

    return world.run(rank)


@pytest.mark.parametrize("mode", ["staged", "direct"])
def test_random_transitions_put_every_expert_in_place(mode: str) -> None:
    rng = np.random.default_rng(7 if mode == "staged" else 8)
    for _ in range(150):
        G = int(rng.choice([1, 2, 3, 4]))
        N = int(rng.choice([n for n in (1, 2) if G % n == 0]))
        P = G * int(rng.integers(1, 5))
        topo = eplb.Topology(int(rng.integers(1, 4)), int(rng.integers(1, P + 1)), P, G, N)
        old, new = _random_placement(topo, rng), _random_placement(topo, rng)
        world = ThreadWorld(G)
        out = _move(
            world,
            old,
            new,
            mode,
            layers_per_call=int(rng.integers(1, 3)),
            round_experts=int(rng.integers(1, 3)),
            verify=True,
        )
        for r, (layers, reports) in enumerate(out):
            check_layers(layers, new, r)
            assert all(rep.ok for rep in reports)
            assert sum(rep.checked_slots for rep in reports) == int(
                (old.phy2log != new.phy2log).reshape(topo.num_layers, G, -1)[:, r].sum()
            )
        # the rounds the movers ran are the schedule's: one peer per exchange
        assert all(len(peers) == 1 for _, peers in world.rounds)


def test_staged_prepare_leaves_live_slots_untouched_until_commit() -> None:
    old, new = _random_pair(eplb.Topology(3, 6, 12, 3), 3)
    world = ThreadWorld(3)

    def rank(r: int):
        layers = encoded_layers(old, r)
        mover = WeightMover(layers, old, new, transport=world.transport(r), layers_per_call=1)
        assert [mover.prepare() for _ in range(4)] == [1, 1, 1, 0]
        check_layers(layers, old, r)  # the old map still routes to correct weights
        report = mover.commit()
        check_layers(layers, new, r)
        return report

    reports = world.run(rank)
    assert sum(rep.received_bytes for rep in reports) == sum(rep.sent_bytes for rep in reports) > 0


def test_rollback_keeps_the_old_weights_and_a_new_mover_can_run() -> None:
    old, new = _random_pair(eplb.Topology(2, 4, 8, 2), 4)
    world = ThreadWorld(2)

    def rank(r: int):
        layers = encoded_layers(old, r)
        mover = WeightMover(layers, old, new, transport=world.transport(r))
        mover.prepare()
        mover.rollback()
        check_layers(layers, old, r)
        with pytest.raises(ValueError, match="commit\\(\\) needs a prepared"):
            mover.commit()
        WeightMover(layers, old, new, transport=world.transport(r)).run()
        check_layers(layers, new, r)

    world.run(rank)


class _Corrupting:
    """A transport that adds 1 to the first tensor received by rank 1."""

    def __init__(self, inner) -> None:
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.done = False

    def start(self, device: torch.device) -> None:
        self.inner.start(device)

    def exchange(self, ops: list[P2P]) -> None:
        self.inner.exchange(ops)
        if self.rank == 1 and not self.done:
            first = next(op for op in ops if not op.send)
            first.tensor.add_(1)
            self.done = True


def test_verify_reports_a_slot_that_differs_from_its_source() -> None:
    old, new = _cross_gpu_swap()
    world = ThreadWorld(2)

    def rank(r: int):
        layers = encoded_layers(old, r)
        return WeightMover(layers, old, new, transport=_Corrupting(world.transport(r)), verify=True).run()

    reports = world.run(rank)
    assert reports[0].ok and reports[0].checked_slots == 1
    assert reports[1].mismatches == ((0, 0),)


def test_direct_mode_receives_into_unread_slots_and_needs_less_staging() -> None:
    old, new = _cross_gpu_swap()
    world = ThreadWorld(2)
    slot = sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values())

    def rank(r: int):
        mover = WeightMover(encoded_layers(old, r), old, new, transport=world.transport(r))
        # each rank's changed slot is sent from before it is received into: one buffer either way
        assert mover.staging_bytes_needed("staged") == slot
        assert mover.staging_bytes_needed("direct") == slot
        return True

    world.run(rank)
    # gpu 0's slot 0 takes expert 2 from gpu 1; its old expert 0 is read by nobody.
    topo = eplb.Topology(1, 3, 4, 2)
    old = eplb.Placement(np.array([[0, 1, 2, 0]]), topo)
    new = eplb.Placement(np.array([[2, 1, 2, 0]]), topo)
    world = ThreadWorld(2)

    def lands_in_place(r: int):
        layers = encoded_layers(old, r)
        mover = WeightMover(layers, old, new, transport=world.transport(r))
        need = (mover.staging_bytes_needed("staged"), mover.staging_bytes_needed("direct"))
        mover.run()
        check_layers(layers, new, r)
        return need

    assert world.run(lands_in_place) == [(slot, 0), (0, 0)]
    # a swap within one gpu is a cycle: one spare slot, no receive buffer
    topo = eplb.Topology(1, 2, 2, 1)
    swap = WeightMover(
        encoded_layers(eplb.Placement(np.array([[0, 1]]), topo), 0),
        eplb.Placement(np.array([[0, 1]]), topo),
        eplb.Placement(np.array([[1, 0]]), topo),
        transport=ThreadWorld(1).transport(0),
    )
    assert swap.staging_bytes_needed("staged") == swap.staging_bytes_needed("direct") == slot


def test_a_staging_cap_below_the_need_is_refused_before_anything_moves() -> None:
    old, new = _cross_gpu_swap()
    world = ThreadWorld(2)
    layers = encoded_layers(old, 0)
    mover = WeightMover(layers, old, new, transport=world.transport(0), staging_bytes=10)
    with pytest.raises(ValueError, match="staging_bytes=10 is below what layer 0 alone needs staged on gpu"):
        mover.prepare()
    check_layers(layers, old, 0)


def test_schedule_is_available_before_anything_moves() -> None:
    old, new = _random_pair(eplb.Topology(2, 4, 8, 2, 2), 5)
    mover = WeightMover(encoded_layers(old, 0), old, new, transport=ThreadWorld(2).transport(0))
    stats = mover.schedule.stats()
    assert stats["bytes"] == mover.schedule.received_bytes.sum() and stats["rounds"] == mover.schedule.total_rounds
    assert mover.prepared_layers == 0 and not mover.done


def test_bad_tensors_are_rejected_with_what_is_wrong() -> None:
    topo = eplb.Topology(2, 4, 8, 2)
    old = eplb.Placement.contiguous(topo)
    t = ThreadWorld(2).transport(0)
    layers = encoded_layers(old, 0)
    with pytest.raises(ValueError, match="layers has 1 entries; the topology has num_layers = 2"):
        WeightMover(layers[:1], old, old, transport=t)
    bad = [dict(layers[0]), dict(layers[1])]
    bad[1]["w2"] = bad[1]["w2"][:3]
    with pytest.raises(
        ValueError, match=r"layers\[1\]\['w2'\] has shape \[3, 3, 2\]; its leading dimension must be the 4 local slots"
    ):
        WeightMover(bad, old, old, transport=t)
    bad[1] = {"w13": layers[1]["w13"]}
    with pytest.raises(ValueError, match="every layer needs the same names"):
        WeightMover(bad, old, old, transport=t)
    bad[1] = dict(layers[1], w13=layers[1]["w13"].transpose(1, 2))
    with pytest.raises(ValueError, match="is \\[4, 3, 4\\] torch.float32; layer 0 has \\[4, 4, 3\\]"):
        WeightMover(bad, old, old, transport=t)
    with pytest.raises(GroupMismatch, match="the process group has 2 ranks; the topology has num_gpus = 4"):
        WeightMover(
            encoded_layers(eplb.Placement.contiguous(eplb.Topology(2, 4, 8, 4)), 0),
            eplb.Placement.contiguous(eplb.Topology(2, 4, 8, 4)),
            eplb.Placement.contiguous(eplb.Topology(2, 4, 8, 4)),
            transport=t,
        )
    mover = WeightMover(layers, old, old, transport=t)
    mover.prepare()
    with pytest.raises(ValueError, match="prepare\\(\\)/commit\\(\\) and step\\(\\) do not mix"):
        mover.step()


@pytest.mark.parametrize("batch_copies", [True, False])
def test_both_copy_launch_styles_move_correctly(batch_copies: bool) -> None:
    rng = np.random.default_rng(11)
    # a scale over 1 MiB a slot takes the one-copy_-per-tensor path even when batching
    tensors = dict(TENSORS, big=(((1 << 18) + 1,), torch.float32))
    for _ in range(5):
        topo = eplb.Topology(2, 5, 8, 2)
        old, new = _random_placement(topo, rng), _random_placement(topo, rng)
        world = ThreadWorld(2)

        def rank(r: int, old=old, new=new, world=world):
            layers = encoded_layers(old, r, tensors)
            WeightMover(layers, old, new, transport=world.transport(r), batch_copies=batch_copies).run()
            check_layers(layers, new, r, tensors)

        world.run(rank)


def test_without_torch_the_mover_import_says_what_to_install(monkeypatch) -> None:
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.delitem(sys.modules, "eplb_engine.mover")
    with pytest.raises(ImportError, match=r"WeightMover needs torch: pip install 'eplb\[engine\]'"):
        importlib.import_module("eplb_engine.mover")


# Run in a fresh interpreter with every import of grpc refused: the mover moves weights on its
# own, on a machine without the service's packages.
_WITHOUT_GRPC = """
import importlib.abc
import sys


class NoGrpc(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "grpc" or name.startswith(("grpc.", "grpc_")):
            raise ImportError(f"{name} is blocked in this test")
        return None


sys.meta_path.insert(0, NoGrpc())

import numpy as np
from mover_sim import ThreadWorld, check_layers, encoded_layers

import eplb
from eplb_engine.mover import WeightMover

topo = eplb.Topology(num_layers=2, num_experts=4, num_slots=6, num_gpus=2)
old = eplb.Placement(np.array([[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 2, 3]]), topo)
new = eplb.Placement(np.array([[3, 2, 1, 0, 3, 3], [1, 0, 3, 2, 0, 0]]), topo)
world = ThreadWorld(2)
moved = []


def rank(r):
    layers = encoded_layers(old, r)
    report = WeightMover(layers, old, new, transport=world.transport(r)).run()
    check_layers(layers, new, r)
    moved.append((r, report.layers, report.received_bytes + report.local_copy_bytes > 0))


world.run(rank)
assert not any(m.split(".")[0] == "grpc" for m in sys.modules), "grpc was imported"
print(sorted(moved))
"""


def test_the_mover_moves_weights_without_grpc() -> None:
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_GRPC],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": here},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # Both ranks wrote both layers, moving bytes (check_layers in the script checked the content).
    assert done.stdout.strip() == "[(0, (0, 1), True), (1, (0, 1), True)]"
