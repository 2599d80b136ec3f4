"""The fresh plan relabelled onto the previous one, so that only real changes move.

Gpus of a plan are interchangeable (within a node for the hierarchical policy, and nodes
among themselves), as are slots within a gpu: each fresh gpu takes the place of the current
gpu holding most of the same experts, and each surviving expert keeps its slot.
"""

from __future__ import annotations

import numpy as np

from ..placement import Placement
from ..topology import Topology

__all__ = ["align_to_previous", "align_slots"]


# Rows of an alignment are matched together while their overlapping (new bin, old bin) pairs
# number at most this many (up to ~80 B each in flight: 325 MiB for 16 layers of 8 experts on
# 4096 gpus, where every gpu shares its expert with 512 others): a dense [X, E, B] presence or [X, B, B]
# overlap at the service's limits (128 x 8192 x 4096) needs 32 GiB, the pairs a few MB.
_PAIRS_PER_CHUNK = 1 << 22
# Up to this many cells (row x expert x bin, or row x slot x bin) the dense overlap (``_dense_match``) is built
# instead, at most ~100 MB: its few whole-array steps per bin beat the sparse steps' many small
# ones at the standard scales (replan_bench --baseline, kimi-64: 226 ms sparse against main's
# 195, 192 with this; a busy machine, so roughly); both give the same bins.
_DENSE_CELLS = 1 << 22


def _pairs(new: np.ndarray, old: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``new``, ``old``: ``[X, B, k]`` expert ids → for each new slot (row-major) the range
    ``[lo, hi)`` of the old slots with the same expert in the same row, in ``order`` (old slots,
    flat, sorted by (row, expert), ties in slot order)."""
    X, B, k = old.shape
    rows = np.arange(X, dtype=np.int64)[:, None, None] * num_experts
    old_keys = (rows + old).ravel()
    order = np.argsort(old_keys, kind="stable")
    sorted_keys = old_keys[order]
    new_keys = (rows + new).ravel()
    return np.searchsorted(sorted_keys, new_keys, "left"), np.searchsorted(sorted_keys, new_keys, "right"), order


def _overlap(new: np.ndarray, old: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """``new``, ``old``: ``[X, B, k]`` → the nonzero overlaps (experts in common, counted as
    the old code's per-bin presence summed over each new bin's slots) as ``keys``
    ``(row * B + new bin) * B + old bin`` ascending and their ``counts``."""
    X, B, k = new.shape
    lo, hi, order = _pairs(new, old, num_experts)
    n = hi - lo
    # Each new slot against every old slot of its expert: the old slots' flat indices.
    first = np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
    old_bin = order[first] // k % B
    seg = np.repeat(np.arange(X * B * k, dtype=np.int64) // k, n)  # row * B + new bin
    return np.unique(seg * B + old_bin, return_counts=True)


def _match_sparse(keys: np.ndarray, counts: np.ndarray, X: int, B: int) -> np.ndarray:
    """Nonzero overlaps (``_overlap``) of ``X`` rows of ``B`` bins → ``[X, B]``: the old bin
    for each new bin, the same greedy as on the dense overlap: new bins in order of their best
    overlap (ties in bin order), each takes its free old bin of most overlap (ties: the lowest
    bin), or the lowest free old bin where it overlaps none that is free."""
    seg = keys // B  # row * B + new bin
    old_bin = keys % B
    start = np.searchsorted(seg, np.arange(X * B + 1))
    size = np.diff(start)
    best = np.zeros(X * B, dtype=counts.dtype)
    has = size > 0
    best[has] = np.maximum.reduceat(counts, start[:-1][has])
    order = np.argsort(-best.reshape(X, B), axis=1, kind="stable")
    taken = np.zeros((X, B), dtype=bool)
    out = np.empty((X, B), dtype=np.int64)
    rows = np.arange(X)
    for step in range(B):
        nb = order[:, step]
        s = rows * B + nb
        lo, n = start[s], size[s]
        pick = np.full(X, -1, dtype=np.int64)
        r = np.flatnonzero(n)
        if r.size:
            m = n[r]
            off = np.cumsum(m) - m
            idx = np.repeat(lo[r] - off, m) + np.arange(int(m.sum()))
            ob = old_bin[idx]
            score = np.where(taken[np.repeat(r, m), ob], -1, counts[idx])
            top = np.maximum.reduceat(score, off)
            # First entry (lowest old bin: the keys are sorted) reaching the row's best.
            pos = np.where(score == np.repeat(top, m), np.arange(idx.size), idx.size)
            first = np.minimum.reduceat(pos, off)
            pick[r] = np.where(top > 0, ob[np.minimum(first, idx.size - 1)], -1)
        none = np.flatnonzero(pick < 0)
        if none.size:
            pick[none] = np.argmin(taken[none], axis=1)  # lowest free old bin
        out[rows, nb] = pick
        taken[rows, pick] = True
    return out


def _dense_match(new: np.ndarray, old: np.ndarray, num_experts: int) -> np.ndarray:
    """``_match_bins`` through the dense ``[X, E, B]`` presence and ``[X, B, B]`` overlap."""
    X, B, _ = old.shape
    # One bincount over (row, expert, bin) keys: np.add.at is several times slower.
    keys = (np.arange(X)[:, None, None] * num_experts + old) * B + np.arange(B)[None, :, None]
    held = np.bincount(keys.ravel(), minlength=X * num_experts * B).reshape(X, num_experts, B).astype(np.float32)
    # A gather of [X, B, k, B] rather than a product over all experts, and no BLAS call, whose
    # threads stall on a busy machine.
    overlap = held[np.arange(X)[:, None, None], new].sum(axis=2)
    most = overlap.max(axis=2)
    order = np.argsort(-most, axis=1, kind="stable")
    out = np.empty((X, B), dtype=np.int64)
    rows = np.arange(X)
    # A taken old bin's overlap is lowered by more than any overlap (small integer counts), so
    # it falls below every free bin's (>= 0) and the argmax is the free bin of most overlap,
    # ties to the lowest, as masking the taken ones would give; a free bin is always left.
    # Whole rows of the [X * B, B] overlap are gathered, and one add replaces the mask.
    lowered = np.zeros((X, B), dtype=overlap.dtype)
    drop = -(most.max(initial=0) + 1)
    flat = overlap.reshape(X * B, B)
    for step in range(B):
        nb = order[:, step]
        cand = flat[rows * B + nb]
        cand += lowered
        ob = cand.argmax(axis=1)
        out[rows, nb] = ob
        lowered[rows, ob] = drop
    return out


def _match_bins(new: np.ndarray, old: np.ndarray, num_experts: int) -> np.ndarray:
    """``new``, ``old``: ``[X, B, k]`` → ``[X, B]`` the old bin each new bin takes: densely
    when small (``_DENSE_CELLS``), else sparsely in chunks of rows (rows are independent) of at
    most ``_PAIRS_PER_CHUNK`` slot pairs."""
    X, B, k = new.shape
    # Its presence is [X, E, B] and its gather [X, B, k, B] (beyond the overlap [X, B, B]).
    if X * B * max(num_experts, B * k) <= _DENSE_CELLS:
        return _dense_match(new, old, num_experts)
    lo, hi, _ = _pairs(new, old, num_experts)
    per_row = (hi - lo).reshape(X, -1).sum(axis=1)
    del lo, hi
    out = np.empty((X, B), dtype=np.int64)
    a = 0
    while a < X:
        # At least one row, then as many as fit the pair budget.
        b = a + max(1, int(np.searchsorted(np.cumsum(per_row[a:]), _PAIRS_PER_CHUNK, "right")))
        keys, counts = _overlap(new[a:b], old[a:b], num_experts)
        out[a:b] = _match_sparse(keys, counts, b - a, B)
        a = b
    return out


def _align_bins(new: np.ndarray, old: np.ndarray, num_experts: int) -> np.ndarray:
    """``new``, ``old``: ``[X, B, k]`` → ``new``'s bins reordered to sit where ``old`` has most in common."""
    # Each new bin's overlap with every old bin (exact small integers), kept sparse: only the
    # pairs of bins sharing an expert, found by sorting, never a dense [X, E, B] or [X, B, B].
    target = _match_bins(new, old, num_experts)
    out = np.empty_like(new)
    np.put_along_axis(out, target[:, :, None], new, axis=1)
    return out


def align_slots(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``new``, ``old``: ``[X, S]`` experts of matched gpus → ``new`` reordered so experts that
    stay keep their slot and the incoming ones fill the freed slots in order."""
    S = new.shape[1]
    dtype = np.result_type(old, new)
    old, new = old.astype(dtype, copy=False), new.astype(dtype, copy=False)
    # As multisets, so a gpu holding an expert twice keeps as many copies as the new one has:
    # the r-th copy of an expert stays if the other side has more than r of it. Counted slot
    # by slot of the other side (S whole-array steps on [X, S]): an [X, S, S] comparison
    # summed over its short last axis runs a reduction per gpu, several times slower.
    in_new = np.zeros(old.shape, dtype=np.int32)  # copies of each old slot's expert in new
    in_old = np.zeros(old.shape, dtype=np.int32)  # copies of each new slot's expert in old
    old_before = np.zeros(old.shape, dtype=np.int32)  # earlier copies in old
    new_before = np.zeros(old.shape, dtype=np.int32)
    for j in range(S):
        in_new += new[:, j : j + 1] == old
        in_old += old[:, j : j + 1] == new
        old_before[:, j + 1 :] += old[:, j : j + 1] == old[:, j + 1 :]
        new_before[:, j + 1 :] += new[:, j : j + 1] == new[:, j + 1 :]
    stays = old_before < in_new  # old slot keeps its expert
    incoming = new_before >= in_old  # new copy not there yet
    # Free slots, in order, get the incoming experts, in order (a gpu has as many of each).
    out = old.copy()
    out[~stays] = new[incoming]
    return out


def align_to_previous(phy2log: np.ndarray, previous: Placement, topology: Topology, by_node: bool) -> np.ndarray:
    """``phy2log``: ``[L, P]`` fresh plan → the same plan relabelled to move fewest slots from ``previous``.

    ``by_node``: keep the fresh plan's node contents together (hierarchical plans), matching
    nodes first and gpus within each node; otherwise any gpu may take any gpu's place.
    Replicas of one expert on one gpu are not expected (our policies avoid them).
    """
    t = topology
    L, S = t.num_layers, t.slots_per_gpu
    old = previous.phy2log
    if by_node and t.num_nodes > 1:
        new_nodes = phy2log.reshape(L, t.num_nodes, t.slots_per_node)
        aligned = _align_bins(new_nodes, old.reshape(L, t.num_nodes, t.slots_per_node), t.num_experts)
        gpus_new = aligned.reshape(L * t.num_nodes, t.gpus_per_node, S)
        gpus_old = old.reshape(L * t.num_nodes, t.gpus_per_node, S)
    else:
        gpus_new = phy2log.reshape(L, t.num_gpus, S)
        gpus_old = old.reshape(L, t.num_gpus, S)
    gpus = _align_bins(gpus_new, gpus_old, t.num_experts)
    slots = align_slots(gpus.reshape(-1, S), gpus_old.reshape(-1, S))
    return slots.reshape(L, t.num_slots).astype(np.int32)
