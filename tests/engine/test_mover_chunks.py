"""Staged mode in chunks: a staging budget cuts the layers into chunks that are prepared and
committed one after the other, the old map staying correct for every layer not yet committed."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from mover_sim import TENSORS, ThreadWorld, check_layers, encoded_layers

import eplb
from eplb.transfer import staged_chunks, staged_slots
from eplb_engine.mover import WeightMover

DEVICE = os.environ.get("EPLB_TEST_DEVICE", "cpu")
SLOT = sum(int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size() for shape, dt in TENSORS.values())


def _random_placement(topo: eplb.Topology, rng: np.random.Generator) -> eplb.Placement:
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    rows = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.integers(0, E, (L, P - E))], axis=1)
    return eplb.Placement(rng.permuted(rows, axis=1), topo)


def mixed(old: eplb.Placement, new: eplb.Placement, switched: int) -> eplb.Placement:
    """Layers ``0 .. switched - 1`` from ``new``, the rest from ``old``."""
    rows = old.phy2log.copy()
    rows[:switched] = new.phy2log[:switched]
    return eplb.Placement(rows, old.topology)


def test_random_transitions_in_chunks_switch_layer_by_layer_correctly() -> None:
    rng = np.random.default_rng(21)
    several = 0
    for _ in range(60):
        G = int(rng.choice([2, 3, 4]))
        P = G * int(rng.integers(2, 5))
        topo = eplb.Topology(int(rng.integers(2, 7)), int(rng.integers(2, P + 1)), P, G, 2 if G % 2 == 0 else 1)
        old, new = _random_placement(topo, rng), _random_placement(topo, rng)
        need = staged_slots(eplb.transfer.transfer_schedule(old, new, topo, expert_bytes=float(SLOT)))
        budget = int(need.max() + rng.integers(0, 3)) * SLOT  # from the smallest possible up
        per_call = int(rng.integers(1, 3))
        world = ThreadWorld(G)

        def rank(r: int):
            layers = encoded_layers(old, r, device=DEVICE)
            mover = WeightMover(
                layers,
                old,
                new,
                transport=world.transport(r),
                staging_bytes=budget,
                layers_per_call=per_call,
                verify=True,
            )
            # The receive buffers of this rank's largest chunk, in slots of SLOT bytes, fit.
            assert mover.slot_bytes == SLOT and mover.staging_bytes_needed("staged") <= budget
            for chunk in mover.chunks:
                while mover.prepare():
                    pass
                assert mover.chunk_prepared
                check_layers(layers, mixed(old, new, chunk.start), r)  # live slots untouched by prepare
                report = mover.commit()
                assert report.ok and report.layers == tuple(chunk)
                assert mover.committed_layers == chunk.stop
                mover.synchronize()
                check_layers(layers, mixed(old, new, chunk.stop), r)
            assert mover.done
            return mover.chunks

        chunks = world.run(rank)
        assert all(c == chunks[0] for c in chunks)
        assert [layer for c in chunks[0] for layer in c] == list(range(topo.num_layers))
        several += len(chunks[0]) > 1
    assert several > 20


def test_spare_slots_match_each_ranks_own_cycles() -> None:
    """The chunking uses the schedule's cycles for the spare slot; each rank's own order of
    local copies needs the spare in exactly those layers."""
    rng = np.random.default_rng(5)
    one = eplb.Topology(1, 4, 8, 2)
    for _ in range(40):
        topo = eplb.Topology(3, 4, 8, 2)
        old, new = _random_placement(topo, rng), _random_placement(topo, rng)
        for r in range(2):
            need = staged_slots(
                WeightMover(encoded_layers(old, r), old, new, transport=ThreadWorld(2).transport(r)).schedule
            )
            # A mover of one layer stages that layer alone: its buffers are the layer's slots.
            staged = []
            for layer in range(3):
                o, n = (eplb.Placement(p.phy2log[layer : layer + 1], one) for p in (old, new))
                mover = WeightMover(encoded_layers(o, r), o, n, transport=ThreadWorld(2).transport(r))
                staged.append(mover.staging_bytes_needed("staged") // mover.slot_bytes)
            assert staged == need[:, r].tolist()


def test_a_layer_that_alone_does_not_fit_is_refused_with_the_bytes_it_needs() -> None:
    topo = eplb.Topology(2, 4, 4, 2)
    old = eplb.Placement(np.array([[0, 1, 2, 3], [0, 1, 2, 3]]), topo)
    new = eplb.Placement(np.array([[0, 1, 2, 3], [2, 3, 0, 1]]), topo)  # layer 1: 2 receives per gpu
    s = eplb.transfer.transfer_schedule(old, new, topo, expert_bytes=float(SLOT))
    assert staged_chunks(s, SLOT, 2 * SLOT) == (range(0, 2),)
    with pytest.raises(ValueError, match=f"below what layer 1 alone needs staged on gpu 0: {2 * SLOT} bytes"):
        staged_chunks(s, SLOT, 2 * SLOT - 1)
    with pytest.raises(ValueError, match="staging_bytes must be an integer >= 0 or None"):
        staged_chunks(s, SLOT, -1)
    assert staged_chunks(s, SLOT, None) == (range(0, 2),)
    # at most chunk_layers layers a chunk, with or without a budget
    assert staged_chunks(s, SLOT, None, 1) == staged_chunks(s, SLOT, 100 * SLOT, 1) == (range(0, 1), range(1, 2))
    with pytest.raises(ValueError, match="chunk_layers must be a positive integer or None"):
        staged_chunks(s, SLOT, None, 0)
    layers = encoded_layers(old, 0)
    mover = WeightMover(layers, old, new, transport=ThreadWorld(2).transport(0), staging_bytes=SLOT)
    with pytest.raises(ValueError, match="layer 1 alone"):
        mover.prepare()
    check_layers(layers, old, 0)


def test_rollback_after_committed_chunks_keeps_them_and_a_new_mover_finishes_from_the_mix() -> None:
    rng = np.random.default_rng(9)
    topo = eplb.Topology(4, 6, 8, 2)
    old, new = _random_placement(topo, rng), _random_placement(topo, rng)
    need = staged_slots(eplb.transfer.transfer_schedule(old, new, topo, expert_bytes=float(SLOT)))
    world = ThreadWorld(2)

    def rank(r: int):
        layers = encoded_layers(old, r)
        mover = WeightMover(layers, old, new, transport=world.transport(r), staging_bytes=int(need.max()) * SLOT)
        assert len(mover.chunks) >= 2
        while mover.prepare():
            pass
        mover.commit()
        mover.prepare()
        mover.rollback()
        switched = mover.chunks[0].stop
        assert mover.committed_layers == switched
        check_layers(layers, mixed(old, new, switched), r)
        with pytest.raises(ValueError, match="make a new WeightMover"):
            mover.prepare()
        # back to the old placement from the mix: only the switched layers move
        back = WeightMover(
            layers, mixed(old, new, switched), old, transport=world.transport(r), staging_bytes=int(need.max()) * SLOT
        )
        assert back.schedule.received_bytes[switched:].sum() == 0
        for _ in back.chunks:
            while back.prepare():
                pass
            back.commit()
        check_layers(layers, old, r)

    world.run(rank)
