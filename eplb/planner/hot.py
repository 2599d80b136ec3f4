"""Hot experts kept apart: replica counts for the few busiest experts chosen together.

Water-filling can give the few busiest experts so many replicas together that some gpu must
hold two of them; with few spare slots that gpu decides the layer. ``separate_hot`` tries
counts where they share the gpus instead, and counts that minimise a pigeonhole bound
(``eplb.bounds.pigeonhole_bound``), packs them from scratch and keeps what is better.
"""

from __future__ import annotations

import numpy as np

from ..bounds import pigeonhole_bound
from ..budget import Budget
from ..layout import GOOD_ENOUGH, REL_TOL, bin_loads, replica_counts
from .counts import refine_counts
from .packing import descending_order, pack_counts
from .replicate import waterfill

__all__ = ["separate_hot"]

# separate_hot re-packs guided counts only for rows at least this far above their bound, and
# only when the count grid (bins ** 3) is at most this big.
_GUIDED_MARGIN = 0.01
_GUIDED_GRID = 1 << 15


def separate_hot(
    loads: np.ndarray,
    phy: np.ndarray,
    cap: int | None,
    *,
    ks: tuple[int, ...] = (2, 3),
    refine: int = 8,
    target: np.ndarray | None = None,
    guided: bool = True,
    budget: Budget | None = None,
) -> np.ndarray:
    """``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` → ``[X, B, S]``, never worse per row.

    Water-filling can give the ``k`` busiest experts more replicas together than there are
    bins, and then some bin holds two of them: with few spare slots that bin decides the
    row. For ``k`` in ``ks``, where that happens, the ``k`` experts instead share ``B``
    replicas (water-filled among them, so no bin needs two), the other experts water-fill what
    is left, the counts are packed from scratch and improved by ``refine`` count moves; the
    better packing wins. With ``guided``, rows whose busiest bin holds one of the three
    busiest experts also try :func:`_guided_counts`. Rows whose busiest bin is at most
    ``target`` (``[X]``, e.g. what the layer carries elsewhere anyway) are left alone.
    """
    X, B, S = phy.shape
    E = loads.shape[1]
    P = B * S
    binl = bin_loads(loads, phy)
    # Only rows above their mean bin (and target) whose busiest bin holds two of the k:
    # elsewhere the sharing costs nothing. The others are dropped first: they are most rows.
    above = binl.max(axis=1) > binl.mean(axis=1) * (1 + GOOD_ENOUGH)
    if target is not None:
        above &= binl.max(axis=1) > target
    live = np.flatnonzero(above)
    if live.size == 0:
        return phy
    lo, ph = loads[live], phy[live]
    counts = replica_counts(ph, E)
    order = descending_order(lo)
    busiest = ph[np.arange(live.size), binl[live].argmax(axis=1)]  # [A, S]
    rows_all, cands = [], []
    for k in ks:
        if k >= E or k > B or P - B < E - k or (cap is not None and cap * (E - k) < P - B):
            continue  # no valid counts: too few bins for k, or for the others' slots
        top = order[:, :k]
        shared = (busiest[:, :, None] == top[:, None, :]).any(axis=1).sum(axis=1) >= 2
        rows = np.flatnonzero(shared & (np.take_along_axis(counts, top, axis=1).sum(axis=1) > B))
        if rows.size == 0:
            continue
        rest = order[rows, k:]
        hot = waterfill(np.take_along_axis(lo[rows], top[rows], axis=1), B, None if cap is None else min(cap, B))
        cold = waterfill(np.take_along_axis(lo[rows], rest, axis=1), P - B, cap)
        cand = np.zeros((rows.size, E), dtype=np.int64)
        np.put_along_axis(cand, top[rows], hot, axis=1)
        np.put_along_axis(cand, rest, cold, axis=1)
        rows_all.append(live[rows])
        cands.append(cand)
    # And the counts of the three busiest experts that minimise a pigeonhole bound (what a bin
    # shared by some of them must carry, the row's mean bin), the rest water-filled.
    k = 3
    # The grid has up to B ** k count vectors; node-sized rows only.
    if guided and k < E and k <= B and B**k <= _GUIDED_GRID:
        hot_on = (busiest[:, :, None] == order[:, None, :k]).any(axis=(1, 2))
        # The bound is at least the row's mean bin, so rows within the margin of their mean
        # cannot pass the test below: leave them out of the grid search.
        hot_on &= binl.max(axis=1)[live] > lo.sum(axis=1) / B * (1 + _GUIDED_MARGIN)
        rows = np.flatnonzero(hot_on)
        guess = _guided_counts(lo[rows], order[rows], B, S, cap, k) if rows.size else None
        if guess is not None:
            bound, chosen = guess
            # Worth a re-pack only where the busiest bin is well above what those counts allow
            # and they differ from the current ones; only those rows water-fill the rest.
            differs = (chosen != np.take_along_axis(counts[rows], order[rows, :k], axis=1)).any(axis=1)
            ok = np.flatnonzero(differs & (binl.max(axis=1)[live[rows]] > bound * (1 + _GUIDED_MARGIN)))
            rows_all.append(live[rows[ok]])
            cands.append(_fill_rest(lo[rows[ok]], order[rows[ok]], chosen[ok], P, cap))
    if not rows_all:
        return phy
    rows, cand = np.concatenate(rows_all), np.concatenate(cands)
    if rows.size == 0:
        return phy
    packed = pack_counts(loads[rows], cand, B)
    # Water-filling the rest can still give a warm expert more replicas than the light bins
    # can take; count moves (both ways) settle that.
    packed = refine_counts(loads[rows], packed, cap, iterations=refine, reverse=True, budget=budget)
    value = bin_loads(loads[rows], packed).max(axis=1)
    best, best_max = phy.copy(), binl.max(axis=1)
    for i in np.argsort(value, kind="stable"):  # a few rows; the best candidate per row wins
        if value[i] < best_max[rows[i]] * (1 - REL_TOL):
            best[rows[i]], best_max[rows[i]] = packed[i], value[i]
    return best


def _guided_counts(
    loads: np.ndarray, order: np.ndarray, B: int, S: int, cap: int | None, k: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """``loads`` ``[R, E]``, ``order`` ``[R, E]`` experts by load (busiest first) → ``(bound [R],
    counts [R, k])``: the counts of the busiest ``k`` experts (each at most ``B``, in ``order``)
    whose pigeonhole bound is least — the largest of the row's mean bin, their largest replica
    and, for every subset whose counts exceed ``(|T| - 1) B``, the sum of its replicas, which
    then share a bin — and that bound. ``None`` when no count vector leaves the other experts a
    slot each (:func:`_fill_rest` gives them the remaining slots)."""
    E = loads.shape[1]
    P = B * S
    hi = B if cap is None else min(cap, B)
    grid = np.stack(np.meshgrid(*[np.arange(1, hi + 1)] * k, indexing="ij"), axis=-1).reshape(-1, k)
    left = P - grid.sum(axis=1)
    grid = grid[(left >= E - k) & ((cap is None) | (left <= (cap or 0) * (E - k)))]
    if len(grid) == 0:
        return None
    top = np.take_along_axis(loads, order[:, :k], axis=1)  # [R, k]
    bound = np.maximum(pigeonhole_bound(top, grid, B), (loads.sum(axis=1) / B)[:, None])
    pick = bound.argmin(axis=1)
    return bound[np.arange(len(pick)), pick], grid[pick]


def _fill_rest(loads: np.ndarray, order: np.ndarray, chosen: np.ndarray, P: int, cap: int | None) -> np.ndarray:
    """``loads`` ``[R, E]``, ``order`` ``[R, E]`` (busiest first), ``chosen`` ``[R, k]`` counts of
    the first ``k`` of ``order`` → counts ``[R, E]``: the others water-fill the ``P`` slots left."""
    R, E = loads.shape
    k = chosen.shape[1]
    out = np.zeros((R, E), dtype=np.int64)
    np.put_along_axis(out, order[:, :k], chosen, axis=1)
    rest = order[:, k:]
    # Rows differ in how many slots are left: water-fill each group of equal count at once.
    remaining = P - chosen.sum(axis=1)
    for n_left in np.unique(remaining):
        rows = np.flatnonzero(remaining == n_left)
        sub = out[rows]
        np.put_along_axis(
            sub, rest[rows], waterfill(np.take_along_axis(loads[rows], rest[rows], axis=1), int(n_left), cap), axis=1
        )
        out[rows] = sub
    return out
