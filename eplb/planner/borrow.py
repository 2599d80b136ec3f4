"""Replica counts borrowed across the rows of one search chunk, by load rank.

Layers of one model often share their load profile: under a zipf law every layer holds the
same sorted loads in another order, and real traces have layers of similar skew. The search
of one row can stop in a local optimum that another row of the same profile escaped (qwen3-64
zipf 1.5: 1.0072 to 1.0267 over layers that are the same problem). So a row tries the counts
of the chunk's best rows, expert of rank ``i`` taking what the donor's expert of rank ``i``
had, each candidate packed from scratch; it keeps the best where it beats its own.
Everything stays inside the rows given (one chunk of layers), so a plan does not depend on
how many processes plan the chunks.
"""

from __future__ import annotations

import numpy as np

from ..budget import Budget
from ..layout import GOOD_ENOUGH, REL_TOL, bin_loads, replica_counts
from .packing import pack_counts_in_time

__all__ = ["borrow_counts", "same_profile"]


def _shares(loads: np.ndarray) -> np.ndarray:
    """``[X, E]`` → ``[X, E]``: each row's loads heaviest first over its mean (zeros for an
    all-zero row)."""
    total = loads.sum(axis=1, keepdims=True)
    return -np.sort(-loads, axis=1) / np.where(total > 0, total, 1.0) * loads.shape[1]


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Shares ``[K, E]`` twice → ``[K]``: equal up to rounding."""
    return np.abs(a - b).max(axis=1) <= 1e-9 * np.maximum(np.abs(a).max(axis=1), 1e-300)


def same_profile(loads: np.ndarray) -> np.ndarray:
    """``loads`` ``[X, E]`` → ``[X]`` bool: rows whose sorted loads, up to scale, another row
    has too (under a zipf law every layer's); all-zero rows never."""
    share = _shares(loads)
    live = share[:, 0] > 0
    # Sort rows by their shares so equal ones are neighbours; equal to rounding, not bits.
    order = np.lexsort(share.T[::-1])
    s = share[order]
    eq = _same(s[1:], s[:-1]) & live[order][1:]
    out = np.zeros(loads.shape[0], dtype=bool)
    out[order[1:][eq]] = True
    out[order[:-1][eq]] = True
    return out


def borrow_counts(
    loads: np.ndarray, phy: np.ndarray, budget: Budget, *, donors: int = 8, target: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` → (``[X, B, S]``, never worse per row; ``[X]``
    bool: rows that took the counts of a donor with the same sorted loads up to scale, whose
    search from there would repeat the donor's). Each row
    above ``target`` ``[X]`` tries the counts of the ``donors`` rows with the lowest busiest
    bin over mean bin (other than itself, lower than its own), mapped by load rank and packed.
    Spends a packing's units per candidate (``B * S * S``, as ``repack_search``); rows are
    taken in order while the budget lasts, so the result is deterministic."""
    X, B, S = phy.shape
    E = loads.shape[1]
    none = np.zeros(X, dtype=bool)
    if X < 2 or budget.out():
        return phy, none
    now = bin_loads(loads, phy).max(axis=1)
    mean = loads.sum(axis=1) / B
    ratio = np.where(mean > 0, now / np.where(mean > 0, mean, 1.0), np.inf)
    want = now > (mean * (1 + GOOD_ENOUGH) if target is None else target)
    order = np.argsort(ratio, kind="stable")  # best rows first
    best = order[: donors + 1]
    counts = replica_counts(phy, E)
    # rank[x, i]: the expert of rank i (heaviest first) of row x; ties by expert id.
    rank = np.argsort(-loads, axis=1, kind="stable")
    by_rank = np.take_along_axis(counts, rank, axis=1)  # [X, E] counts in rank order
    rows, give = [], []
    for x in np.flatnonzero(want):
        d = best[(best != x) & (ratio[best] < ratio[x] * (1 - REL_TOL))][:donors]
        rows += [x] * d.size
        give += d.tolist()
    if not rows:
        return phy, none
    rows, give = np.asarray(rows), np.asarray(give)
    cost = B * S * S
    # All candidates are packed in one go: as many as the units left and the time left pay for.
    fit = budget.fit(rows.size, cost)
    rows, give = rows[:fit], give[:fit]
    if rows.size == 0:
        return phy, none
    cand = np.empty((rows.size, E), dtype=np.int64)
    np.put_along_axis(cand, rank[rows], by_rank[give], axis=1)
    unchanged = (cand == counts[rows]).all(axis=1)
    rows, give, cand = rows[~unchanged], give[~unchanged], cand[~unchanged]
    budget.spend(rows.size * cost)
    if rows.size == 0:
        return phy, none
    packed = pack_counts_in_time(loads[rows], cand, B, budget.clock)
    rows, give, cand = rows[: len(packed)], give[: len(packed)], cand[: len(packed)]
    value = bin_loads(loads[rows], packed).max(axis=1)
    order = np.lexsort((value, rows))
    first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
    win = first[value[first] < now[rows[first]] * (1 - REL_TOL)]
    out = phy.copy()
    out[rows[win]] = packed[win]
    # Same problem as the donor's up to the order of experts: sorted shares equal to rounding.
    share = _shares(loads)
    same = _same(share[rows[win]], share[give[win]])
    settled = none.copy()
    settled[rows[win][same]] = True
    return out, settled
