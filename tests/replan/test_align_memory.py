"""eplb.replan.align at the service's size limits: memory stays bounded, results unchanged.

The alignment once counted each expert per bin densely (``[L, E, G]``, then ``[L, G, G]``
overlaps): 32 GiB at 128 layers x 8192 experts x 4096 gpus, a MemoryError for every
migration-aware re-plan there. ``_dense_align_bins`` below is that computation, kept as the
reference the sparse one must equal.
"""

import tracemalloc

import numpy as np
import pytest

import eplb
from eplb.limits import MAX_EXPERTS, MAX_GPUS
from eplb.replan import align
from eplb.workloads import SCALES, make_loads

MiB = 1 << 20


def _dense_align_bins(new: np.ndarray, old: np.ndarray, num_experts: int) -> np.ndarray:
    """``new``, ``old``: ``[X, B, k]`` → the previous dense implementation's result."""
    X, B, _ = old.shape
    keys = (np.arange(X)[:, None, None] * num_experts + old) * B + np.arange(B)[None, :, None]
    held = np.bincount(keys.ravel(), minlength=X * num_experts * B).reshape(X, num_experts, B).astype(np.float32)
    overlap = held[np.arange(X)[:, None, None], new].sum(axis=2)
    order = np.argsort(-overlap.max(axis=2), axis=1, kind="stable")
    taken = np.zeros((X, B), dtype=bool)
    target = np.empty((X, B), dtype=np.int64)
    rows = np.arange(X)
    for step in range(B):
        nb = order[:, step]
        ob = np.where(taken, -1.0, overlap[rows, nb]).argmax(axis=1)
        target[rows, nb] = ob
        taken[rows, ob] = True
    out = np.empty_like(new)
    np.put_along_axis(out, target[:, :, None], new, axis=1)
    return out


def _peak(fn: object) -> tuple[object, int]:
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("pairs_per_chunk", [1 << 22, 5])
def test_sparse_alignment_equals_the_dense_one(monkeypatch: pytest.MonkeyPatch, pairs_per_chunk: int) -> None:
    # Few experts: many ties, repeated experts within a bin, bins sharing nothing; a tiny pair
    # budget splits the rows into chunks of one row.
    monkeypatch.setattr(align, "_PAIRS_PER_CHUNK", pairs_per_chunk)
    monkeypatch.setattr(align, "_DENSE_CELLS", 0)  # the sparse path, even this small
    rng = np.random.default_rng(0)
    for _ in range(200):
        X, B, k, E = (
            int(v) for v in (rng.integers(1, 6), rng.integers(1, 12), rng.integers(1, 5), rng.integers(1, 30))
        )
        new, old = rng.integers(0, E, (X, B, k)), rng.integers(0, E, (X, B, k))
        assert (align._align_bins(new, old, E) == _dense_align_bins(new, old, E)).all(), (X, B, k, E)


@pytest.mark.parametrize("dense_cells", [0, 1 << 22])
@pytest.mark.parametrize("scale", ["v3-prefill", "kimi-64", "qwen3-64"])
def test_alignment_unchanged_at_the_standard_scales(
    monkeypatch: pytest.MonkeyPatch, scale: str, dense_cells: int
) -> None:
    monkeypatch.setattr(align, "_DENSE_CELLS", dense_cells)
    topo = SCALES[scale].with_layers(8)
    prev = eplb.rebalance(make_loads("lognormal-1.0", topo, seed=1), topo).phy2log
    fresh = eplb.rebalance(make_loads("lognormal-1.0", topo, seed=2), topo).phy2log
    t = topo
    for by_node in (False, True):
        if by_node and t.num_nodes > 1:
            new = fresh.reshape(t.num_layers, t.num_nodes, t.slots_per_node)
            old = prev.reshape(t.num_layers, t.num_nodes, t.slots_per_node)
        else:
            new = fresh.reshape(t.num_layers, t.num_gpus, t.slots_per_gpu)
            old = prev.reshape(t.num_layers, t.num_gpus, t.slots_per_gpu)
        assert (align._align_bins(new, old, t.num_experts) == _dense_align_bins(new, old, t.num_experts)).all()


def _limit_topology(layers: int) -> eplb.Topology:
    return eplb.Topology(num_layers=layers, num_experts=MAX_EXPERTS, num_slots=MAX_EXPERTS, num_gpus=MAX_GPUS)


def test_alignment_at_the_limits_stays_small() -> None:
    # 2 layers of the largest experts x gpus the service takes: the dense presence alone was
    # 2 x 8192 x 4096 int64 = 512 MiB; the sparse one holds a few arrays of the slots' size.
    topo = _limit_topology(2)
    rng = np.random.default_rng(0)
    prev = np.stack([rng.permutation(topo.num_experts) for _ in range(topo.num_layers)]).astype(np.int32)
    fresh = prev.copy()
    # Half the gpus keep their pair of experts, relabelled; the others hold new pairs.
    perm = rng.permutation(topo.num_gpus)
    fresh = fresh.reshape(topo.num_layers, topo.num_gpus, -1)[:, perm].reshape(topo.num_layers, -1)
    fresh[:, : topo.num_slots // 2] = rng.permutation(fresh[:, : topo.num_slots // 2].T).T
    placement = eplb.Placement(prev, topo)
    aligned, peak = _peak(lambda: align.align_to_previous(fresh, placement, topo, by_node=False))
    assert peak < 16 * MiB, f"{peak / MiB:.0f} MiB"
    # The gpus that kept their pair are back where they were, slots included.
    kept = (
        np.sort(aligned.reshape(2, topo.num_gpus, -1), axis=2) == np.sort(prev.reshape(2, topo.num_gpus, -1), axis=2)
    ).all(axis=2)
    assert kept.sum() >= topo.num_layers * topo.num_gpus // 2
    assert (np.sort(aligned, axis=1) == np.arange(topo.num_experts)).all()


def test_migration_aware_replan_at_the_limits_completes_in_bounded_memory() -> None:
    topo = _limit_topology(2)
    prev = eplb.rebalance(make_loads("lognormal-0.5", topo, seed=0), topo, effort="fast").placement
    loads = make_loads("lognormal-0.5", topo, seed=1)
    plan, peak = _peak(lambda: eplb.rebalance(loads, topo, previous=prev, effort="fast"))
    # Moves > 0: the previous placement was out of tolerance, so the fresh plan was aligned
    # onto it (the candidate that ran out of memory).
    assert plan.moves.sum() > 0
    # The fresh plan itself takes about 2 B per (expert, gpu) and layer (eplb.limits); the
    # dense alignment added 768 MiB on top.
    assert peak < 160 * MiB, f"{peak / MiB:.0f} MiB"


def test_hierarchical_replan_at_the_limits_stays_small() -> None:
    # Groups swapped between nodes (eplb.replan.candidates._swap_groups) once built an
    # [L, N*K, N*K, N] array of node loads (512 groups on 64 nodes: 256 MiB per layer), the
    # repairs an [L * N, E] inverse of each node's experts: 805 MiB at these 2 layers, 6 MiB now.
    topo = eplb.Topology(2, MAX_EXPERTS, MAX_EXPERTS, MAX_GPUS, num_nodes=64, num_groups=512)
    prev = eplb.rebalance(make_loads("lognormal-0.5", topo, seed=0), topo, "hierarchical", effort="fast").placement
    loads = make_loads("lognormal-0.5", topo, seed=1)
    plan, peak = _peak(lambda: eplb.rebalance(loads, topo, "hierarchical", previous=prev, effort="fast"))
    assert plan.moves.sum() > 0
    assert peak < 64 * MiB, f"{peak / MiB:.0f} MiB"
