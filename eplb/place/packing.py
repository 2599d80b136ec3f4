"""Packing weighted items into bins of equal item count, minimising the heaviest bin.

``pack`` deals items and improves the deal by swaps; it is used twice by the first plan:
expert groups onto nodes, replicas onto gpus. On the ``[rows, bins, slots]`` layout
(``eplb.layout``), with counts fixed: ``pack_counts`` packs replica counts from scratch,
``swap_improve`` swaps slots between bins (count moves and re-plans use it).
"""

from __future__ import annotations

import numpy as np

from ..bounds import item_bound
from ..layout import GOOD_ENOUGH, REL_TOL, replica_counts

__all__ = ["pack", "packed_loads", "improve", "swap_improve", "pack_counts"]

# Partner bins the heaviest bin tries when the paired round finds nothing.
_WIDE = 16
# ... and the bins holding the smallest items it also tries.
_SMALL = 8
# Best-scoring swaps per heavy bin checked for key clashes.
_CANDIDATES = 4
# Improvement rounds a layer may go without lowering its heaviest bin before it stops.
_PATIENCE = 4


def pack(
    weights: np.ndarray,
    num_bins: int,
    keys: np.ndarray | None = None,
    *,
    max_rounds: int = 32,
    pairs: int = 8,
    floor: np.ndarray | None = None,
) -> np.ndarray:
    """``weights``: ``[X, n]`` → int64 ``[X, num_bins, n // num_bins]``: the items in each bin.

    1. Deal: items in descending weight (ties keep input order) form rounds of ``num_bins``;
       rounds merge by balanced largest differencing (see ``_deal``). Then no bin keeps two
       items with the same ``keys`` value (``[X, n]``, e.g. the expert of a replica) where a
       swap with another bin avoids it.
    2. Improve: up to ``max_rounds`` rounds in which the ``pairs`` heaviest bins are paired with
       the lightest (i-th heaviest with i-th lightest) and each pair makes the one item swap
       that most lowers its heavier bin; a layer where no pair can improve tries its heaviest
       bin against the 16 lightest bins and the 8 holding the smallest items. Keys stay distinct per bin. A layer stops after
       a few rounds without lowering its heaviest bin, or once its heaviest bin is within
       0.1 % of its lower bound or at most ``floor`` (``[X]``, e.g. what a row's layer must
       carry elsewhere anyway). Deterministic.
    """
    weights = np.asarray(weights, dtype=np.float64)
    rows, n = weights.shape
    if n % num_bins:
        raise ValueError(f"{n} items cannot fill {num_bins} bins equally")
    per_bin = n // num_bins
    if keys is None:
        keys = np.broadcast_to(np.arange(n), (rows, n))
    order = np.argsort(-weights, axis=1, kind="stable")
    assign = _deal(weights, keys, order, num_bins, per_bin)
    if per_bin > 1:
        _repair(weights, keys, assign)
    if per_bin > 1 and num_bins > 1:
        # Rows already within GOOD_ENOUGH of their bound (mean bin, heaviest item) skip the swaps.
        bound = item_bound(weights, num_bins) * (1 + GOOD_ENOUGH)
        _improve(weights, keys, assign, max_rounds, pairs, bound if floor is None else np.maximum(bound, floor))
    return assign


def packed_loads(weights: np.ndarray, assign: np.ndarray) -> np.ndarray:
    """``weights`` ``[X, n]``, ``assign`` ``[X, B, k]`` → ``[X, B]`` summed weights."""
    rows = np.arange(weights.shape[0])[:, None, None]
    return weights[rows, assign].sum(axis=2)


def _deal(weights: np.ndarray, keys: np.ndarray, order: np.ndarray, num_bins: int, per_bin: int) -> np.ndarray:
    """Balanced largest differencing (Karmarkar-Karp for equal-count bins), vectorised over rows.

    Each round of ``num_bins`` items in weight order is a partial solution; the two partials
    with the largest spread (heaviest minus lightest bin) merge, heaviest bin of one with
    lightest of the other, until one is left. Items carry (partial, bin) labels, so a merge
    costs a few ``[X, n]`` operations.
    """
    X, m, S = weights.shape[0], num_bins, per_bin
    n = m * S
    r = np.arange(X)
    rc = r[:, None]
    sums = np.take_along_axis(weights, order, axis=1).reshape(X, S, m)
    # code = partial * m + bin for every item; a merge relabels codes through a table.
    code = np.empty((X, n), dtype=np.int64)
    np.put_along_axis(code, order, np.broadcast_to(np.arange(n), (X, n)), axis=1)
    flat = code + rc * n  # index into a per-row table of width n
    col = np.arange(m)
    for left in range(S, 1, -1):
        spread = sums[:, :left].max(axis=2) - sums[:, :left].min(axis=2)
        pick = np.argsort(-spread, axis=1, kind="stable")[:, :2]
        a, b = pick[:, 0], pick[:, 1]
        lo, hi, last = np.minimum(a, b), np.maximum(a, b), left - 1
        oa = np.argsort(-sums[r, a], axis=1, kind="stable")
        ob = np.argsort(sums[r, b], axis=1, kind="stable")
        new_sum = np.take_along_axis(sums[r, a], oa, axis=1) + np.take_along_axis(sums[r, b], ob, axis=1)
        table = np.broadcast_to(np.arange(n), (X, n)).copy()
        # The last partial moves into the freed slot; a and b merge into the lower slot.
        table[rc, last * m + col] = hi[:, None] * m + col
        inv = np.empty_like(oa)
        np.put_along_axis(inv, oa, np.broadcast_to(col, oa.shape), axis=1)
        table[rc, a[:, None] * m + col] = lo[:, None] * m + inv
        np.put_along_axis(inv, ob, np.broadcast_to(col, ob.shape), axis=1)
        table[rc, b[:, None] * m + col] = lo[:, None] * m + inv
        code = table.ravel()[flat]
        flat = code + rc * n
        sums[r, hi] = sums[r, last]
        sums[r, lo] = new_sum
    # Codes are now bins (< m): as the smallest integer type they sort by radix, not by merges.
    return np.argsort(code.astype(np.min_scalar_type(m)), axis=1, kind="stable").reshape(X, m, S)


def _repair(weights: np.ndarray, keys: np.ndarray, assign: np.ndarray) -> None:
    """Swap away equal keys sharing a bin, one clash per row per pass, all rows at once.

    Each clash swaps with the item of closest weight whose bin lacks the clashing key and
    whose key the clashing bin lacks. Rows where no such item exists keep the clash.
    """
    X, B, S = assign.shape
    rows = np.arange(X)
    for _ in range(B * S):
        if rows.size == 0:
            return
        r3 = rows[:, None, None]
        k = keys[r3, assign[rows]]
        clash = np.tril(k[:, :, :, None] == k[:, :, None, :], -1).any(axis=3)  # [R, B, S]
        has = clash.reshape(len(rows), -1).any(axis=1)
        rows, k, clash = rows[has], k[has], clash[has]
        if rows.size == 0:
            return
        R = rows.size
        ri = np.arange(R)
        b, s = np.divmod(clash.reshape(R, -1).argmax(axis=1), S)
        e = k[ri, b, s]
        w = weights[rows[:, None, None], assign[rows]]
        # Partner (q, t): bin q lacks e, and bin b lacks the partner's key.
        ok = ~(k == e[:, None, None]).any(axis=2)[:, :, None] & ~(k[:, :, :, None] == k[ri, b][:, None, None, :]).any(
            axis=3
        )
        cost = np.where(ok, np.abs(w - w[ri, b, s][:, None, None]), np.inf).reshape(R, -1)
        best = cost.argmin(axis=1)
        fixable = np.isfinite(cost[ri, best])
        q, t = np.divmod(best[fixable], S)
        x, bb, ss = rows[fixable], b[fixable], s[fixable]
        tmp = assign[x, bb, ss].copy()
        assign[x, bb, ss] = assign[x, q, t]
        assign[x, q, t] = tmp
        stuck = rows[~fixable]
        if stuck.size:
            _cyclic(weights, keys, assign, stuck)
        rows = x


def _cyclic(weights: np.ndarray, keys: np.ndarray, assign: np.ndarray, rows: np.ndarray) -> None:
    """Rows where no single swap removes a clash: when no key has more items than there are
    bins, deal the items grouped by key round the bins (a run of at most B items lands on B
    distinct bins); the swap step that follows restores the balance. Such rows are rare."""
    X, B, S = assign.shape
    for x in rows:
        if np.bincount(keys[x]).max() <= B:
            order = np.lexsort((-weights[x], keys[x]))
            assign[x] = order.reshape(S, B).T


def improve(
    weights: np.ndarray,
    keys: np.ndarray,
    assign: np.ndarray,
    *,
    max_rounds: int = 32,
    pairs: int = 8,
    target: np.ndarray | None = None,
) -> None:
    """Lower the heaviest bin of an existing packing by item swaps, in place.

    ``weights``, ``keys``: ``[X, n]``; ``assign``: ``[X, B, k]`` item indices. A row stops as
    soon as its heaviest bin is at most ``target[row]`` (``[X]``), so a re-plan makes only the
    swaps it needs.
    """
    _improve(weights, keys, assign, max_rounds, pairs, target)


def _improve(
    weights: np.ndarray,
    keys: np.ndarray,
    assign: np.ndarray,
    max_rounds: int,
    pairs: int,
    target: np.ndarray | None = None,
) -> None:
    rows, num_bins, per_bin = assign.shape
    if num_bins < 2:
        return  # one bin (e.g. a node of one gpu): nothing to swap with
    # Only the heaviest bins decide the objective; pairing a few of them is most of the gain.
    half = min(num_bins // 2, pairs)
    r3 = np.arange(rows)[:, None, None]
    w = weights[r3, assign]  # [X, B, S] kept in step with assign
    k = keys[r3, assign]
    wide = min(num_bins - 1, _WIDE)
    active = np.arange(rows)
    idle = np.zeros(rows, dtype=np.int64)  # rounds since the heaviest bin last got lighter
    for _ in range(max_rounds):
        if target is not None:
            active = active[w[active].sum(axis=2).max(axis=1) > target[active]]
        if active.size == 0:
            return
        load = w[active].sum(axis=2)
        srt = np.argsort(load, axis=1, kind="stable")
        # Cheap round: i-th heaviest with i-th lightest, all pairs at once.
        heavy, partner = srt[:, ::-1][:, :half], srt[:, :half, None]
        # Bins already at or below the target are left alone: swaps there only cost moves.
        floor = None if target is None else target[active]
        found = _swap_best(assign, w, k, load, active, heavy, partner, floor)
        stalled = ~found.any(axis=1)
        if stalled.any():
            # Wider round for layers the cheap one left: the heaviest bin against the lightest
            # bins and against the bins holding the smallest items (a heavy bin often needs a
            # smaller partner for its big item, wherever that partner sits).
            st = np.flatnonzero(stalled)
            top = srt[st, -1:]
            small = np.argsort(w[active[st]].min(axis=2), axis=1, kind="stable")[:, :_SMALL]
            part = np.concatenate([srt[st, :wide], small], axis=1)[:, None, :]
            again = _swap_best(assign, w, k, load[st], active[st], top, part, None if floor is None else floor[st])
            stalled[st] = ~again[:, 0]
        # A layer goes on while its heaviest bin got lighter within the last few rounds (ties
        # at the top need several swaps before the maximum moves).
        dropped = w[active].sum(axis=2).max(axis=1) < load.max(axis=1)
        idle[active] = np.where(dropped, 0, idle[active] + 1)
        active = active[~stalled & (idle[active] < _PATIENCE)]


def _swap_best(
    assign: np.ndarray,
    w: np.ndarray,
    k: np.ndarray,
    load: np.ndarray,
    rows: np.ndarray,
    heavy: np.ndarray,
    partners: np.ndarray,
    floor: np.ndarray | None = None,
) -> np.ndarray:
    """Make, for each heavy bin, the item swap with one of its partner bins that most lowers it.

    ``rows``: ``[A]`` rows of ``assign``/``w``/``k`` (``[X, B, S]``, updated in place);
    ``load``: ``[A, B]``; ``heavy``: ``[A, H]`` distinct bins; ``partners``: ``[A, H, C]`` bins,
    each partner used by at most one heavy bin; heavy bins not above ``floor`` ``[A]`` are
    skipped. Returns ``[A, H]``: whether a swap was made.
    """
    per_bin = w.shape[2]
    A, H = heavy.shape
    C = partners.shape[2]
    lh_all = load[np.arange(A)[:, None], heavy]  # [A, H]
    hit = np.zeros((A, H), dtype=bool)
    # Only (row, heavy bin) pairs above the floor can swap (a re-plan's targets leave few):
    # the item grids are built for those pairs alone.
    pa, ph = np.nonzero(lh_all > floor[:, None]) if floor is not None else np.nonzero(hit == 0)
    if pa.size == 0:
        return hit
    P = pa.size
    ar = np.arange(P)
    xr, hb, pb = rows[pa], heavy[pa, ph], partners[pa, ph]  # [P], [P], [P, C]
    wh, kh = w[xr, hb], k[xr, hb]  # [P, S]
    wp, kp = w[xr[:, None], pb], k[xr[:, None], pb]  # [P, C, S]
    lh = lh_all[pa, ph][:, None, None, None]
    lp = load[pa[:, None], pb][:, None, :, None]
    # Swapping items i (heavy bin) and j (partner) moves d = w_i - w_j; the pair's new maximum
    # is (lh + lp) / 2 + |d - (lh - lp) / 2|, an improvement iff that deviation is below
    # (lh - lp) / 2. So score by deviation plus lp / 2 (lh is fixed per heavy bin).
    half = (lh - lp) * 0.5 - REL_TOL * lh
    dev = wh[:, :, None, None] - wp[:, None, :, :]  # [P, S(heavy item), C, S(partner item)]
    dev -= (lh - lp) * 0.5
    np.abs(dev, out=dev)
    score = np.where(dev < half, dev + lp * 0.5, np.inf).reshape(P, -1)
    # Key clashes are rare: check the best swap, and only where it clashes try the next best.
    best = score.argmin(axis=1)
    found = np.isfinite(score[ar, best])
    for attempt in range(_CANDIDATES):
        i, c, j = np.unravel_index(best, (per_bin, C, per_bin))
        key_h = kh[ar, i]
        key_p = kp[ar, c, j]
        clash = found & ((kp[ar, c] == key_h[:, None]).any(axis=1) | (kh == key_p[:, None]).any(axis=1))
        if not clash.any():
            break
        if attempt == _CANDIDATES - 1:
            found &= ~clash
            break
        cp = np.flatnonzero(clash)
        score[cp, best[cp]] = np.inf
        best[cp] = score[cp].argmin(axis=1)
        found[cp] = np.isfinite(score[cp, best[cp]])
    hit[pa, ph] = found
    if found.any():
        sel = np.flatnonzero(found)
        i, c, j = np.unravel_index(best[sel], (per_bin, C, per_bin))
        x, bh, bp = xr[sel], hb[sel], pb[sel, c]
        for arr in (assign, w, k):
            tmp = arr[x, bh, i].copy()
            arr[x, bh, i] = arr[x, bp, j]
            arr[x, bp, j] = tmp
    return hit


def swap_improve(
    loads: np.ndarray, phy: np.ndarray, rows: np.ndarray, rounds: int, target: np.ndarray | None = None
) -> None:
    """Swap slots between bins of ``phy`` ``[X, B, S]`` (rows ``rows``, in place) to lower each
    row's busiest bin, stopping at ``target`` ``[X]``; counts stay as they are."""
    sub = phy[rows]
    A, B, S = sub.shape
    ra = np.arange(A)
    cnt = replica_counts(sub, loads.shape[1])
    keys = sub.reshape(A, B * S)
    weights = (loads[rows] / cnt)[ra[:, None], keys]
    assign = np.broadcast_to(np.arange(B * S).reshape(B, S), (A, B, S)).copy()
    improve(weights, keys, assign, max_rounds=rounds, target=None if target is None else target[rows])
    phy[rows] = np.take_along_axis(keys, assign.reshape(A, -1), axis=1).reshape(A, B, S)


def pack_counts(loads: np.ndarray, counts: np.ndarray, bins: int, max_rounds: int = 16) -> np.ndarray:
    """``loads``, ``counts``: ``[X, E]`` → ``[X, B, S]`` experts per bin, freshly packed."""
    X, E = loads.shape
    ids = np.repeat(np.tile(np.arange(E), X), counts.ravel()).reshape(X, -1)
    w = (loads / counts)[np.arange(X)[:, None], ids]
    return ids[np.arange(X)[:, None, None], pack(w, bins, ids, max_rounds=max_rounds)]
