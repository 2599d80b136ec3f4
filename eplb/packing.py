"""Packing weighted items into bins of equal item count, minimising the heaviest bin.

Used twice by the hierarchical policy: expert groups onto nodes, replicas onto gpus.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack", "bin_loads", "improve"]

# Relative gain below which a swap is float noise, not an improvement.
_REL_TOL = 1e-12
# Best-scoring swaps per heavy bin checked for key clashes.
_CANDIDATES = 4
# Improvement rounds a layer may go without lowering its heaviest bin before it stops.
_PATIENCE = 4


def pack(
    weights: np.ndarray, num_bins: int, keys: np.ndarray | None = None, *, max_rounds: int = 32, pairs: int = 8
) -> np.ndarray:
    """``weights``: ``[X, n]`` → int64 ``[X, num_bins, n // num_bins]``: the items in each bin.

    1. Deal: items in descending weight (ties keep input order), one round at a time, the
       heaviest item of a round to the lightest bin; an item whose ``keys`` value (``[X, n]``,
       e.g. the expert of a replica) is already in its bin trades bins with a nearby item
       of the same round, so no bin holds two equal keys where that can be avoided.
    2. Improve: up to ``max_rounds`` rounds in which the ``pairs`` heaviest bins are paired with
       the lightest (i-th heaviest with i-th lightest) and each pair makes the one item swap
       that most lowers its heavier bin; a layer where no pair can improve tries its heaviest
       bin against the ``4 * pairs`` lightest. Keys stay distinct per bin. A layer stops after
       a few rounds without lowering its heaviest bin. Deterministic.
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
    if per_bin > 1 and num_bins > 1:
        _improve(weights, keys, assign, max_rounds, pairs)
    return assign


def bin_loads(weights: np.ndarray, assign: np.ndarray) -> np.ndarray:
    """``weights`` ``[X, n]``, ``assign`` ``[X, B, k]`` → ``[X, B]`` summed weights."""
    rows = np.arange(weights.shape[0])[:, None, None]
    return weights[rows, assign].sum(axis=2)


def _deal(weights: np.ndarray, keys: np.ndarray, order: np.ndarray, num_bins: int, per_bin: int) -> np.ndarray:
    rows = weights.shape[0]
    r = np.arange(rows)[:, None]
    load = np.zeros((rows, num_bins))
    assign = np.empty((rows, num_bins, per_bin), dtype=np.int64)
    bin_keys = np.empty((rows, num_bins, per_bin), dtype=keys.dtype)
    for rnd in range(per_bin):
        items = order[:, rnd * num_bins:(rnd + 1) * num_bins]
        target = np.argsort(load, axis=1, kind="stable")
        item_keys = keys[r, items]
        if rnd:
            # Equal keys are adjacent in weight order, so clashes are rare: fix them one by one.
            held = bin_keys[r, target, :rnd]  # [X, B, rnd], keys already in each target bin
            clash = (held == item_keys[:, :, None]).any(axis=2)
            for x in np.flatnonzero(clash.any(axis=1)):
                _unclash_round(item_keys[x], held[x], target[x])
        assign[r, target, rnd] = items
        bin_keys[r, target, rnd] = item_keys
        load[r, target] += weights[r, items]
    return assign


def _unclash_round(item_keys: np.ndarray, held: np.ndarray, target: np.ndarray) -> None:
    """Permute ``target`` (``[B]``, bin of each item of one round) so no item meets its key.

    ``held``: ``[B, rnd]`` keys already in the bin each item is headed for (permuted along).
    Trades with the nearest item in weight order that fits, to keep the deal's balance.
    """
    n = len(target)
    for j in np.flatnonzero((held == item_keys[:, None]).any(axis=1)):
        if not (held[j] == item_keys[j]).any():
            continue  # an earlier trade already fixed it
        dist = np.abs(np.arange(n) - j)
        ok = ~(held == item_keys[j]).any(axis=1) & ~(held[j][None, :] == item_keys[:, None]).any(axis=1)
        if not ok.any():
            continue  # no trade inside this round helps: the clash is unavoidable here
        t = int(np.argmin(np.where(ok, dist, n)))
        target[[j, t]] = target[[t, j]]
        held[[j, t]] = held[[t, j]]


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
    # Only the heaviest bins decide the objective; pairing a few of them is most of the gain.
    half = min(num_bins // 2, pairs)
    r3 = np.arange(rows)[:, None, None]
    w = weights[r3, assign]  # [X, B, S] kept in step with assign
    k = keys[r3, assign]
    wide = min(num_bins - 1, 4 * pairs)
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
        found = _swap_best(assign, w, k, load, active, heavy, partner)
        stalled = ~found.any(axis=1)
        if stalled.any():
            # Wider round for layers the cheap one left: the heaviest bin against the lightest
            # bins (any bin lighter than it could take a smaller item).
            st = np.flatnonzero(stalled)
            top = srt[st, -1:]
            part = srt[st, None, :wide]
            again = _swap_best(assign, w, k, load[st], active[st], top, part)
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
) -> np.ndarray:
    """Make, for each heavy bin, the item swap with one of its partner bins that most lowers it.

    ``rows``: ``[A]`` rows of ``assign``/``w``/``k`` (``[X, B, S]``, updated in place);
    ``load``: ``[A, B]``; ``heavy``: ``[A, H]`` distinct bins; ``partners``: ``[A, H, C]`` bins,
    each partner used by at most one heavy bin. Returns ``[A, H]``: whether a swap was made.
    """
    per_bin = w.shape[2]
    A, H = heavy.shape
    C = partners.shape[2]
    ri = np.arange(A)[:, None]
    xr = rows[:, None]
    wh, kh = w[xr, heavy], k[xr, heavy]  # [A, H, S]
    wp, kp = w[xr[:, :, None], partners], k[xr[:, :, None], partners]  # [A, H, C, S]
    lh = load[ri, heavy][:, :, None, None, None]
    lp = load[ri[:, :, None], partners][:, :, None, :, None]
    d = wh[:, :, :, None, None] - wp[:, :, None, :, :]  # [A, H, S(heavy item), C, S(partner item)]
    new = np.maximum(lh - d, lp + d)
    tol = _REL_TOL * lh
    score = np.where((d > tol) & (new < lh - tol), new, np.inf).reshape(A, H, -1)
    # Key clashes are rare, so check them only for the few best-scoring swaps.
    top = min(_CANDIDATES, score.shape[2])
    cand = np.argpartition(score, top - 1, axis=2)[:, :, :top] if top < score.shape[2] else np.broadcast_to(
        np.arange(top), (A, H, top)
    )
    cand = np.take_along_axis(cand, np.argsort(np.take_along_axis(score, cand, axis=2), axis=2), axis=2)
    ci, cc, cj = np.unravel_index(cand, (per_bin, C, per_bin))  # [A, H, top]
    a3, h3 = np.arange(A)[:, None, None], np.arange(H)[None, :, None]
    key_h = kh[a3, h3, ci]  # heavy item's key
    key_p = kp[a3, h3, cc, cj]  # partner item's key
    clash = (kp[a3, h3, cc] == key_h[..., None]).any(axis=3) | (kh[:, :, None, :] == key_p[..., None]).any(axis=3)
    ok = np.isfinite(np.take_along_axis(score, cand, axis=2)) & ~clash
    first = ok.argmax(axis=2)
    hit = ok.any(axis=2)
    best = np.take_along_axis(cand, first[:, :, None], axis=2)[:, :, 0]
    if hit.any():
        a_idx, h_idx = np.nonzero(hit)
        i, c, j = np.unravel_index(best[a_idx, h_idx], (per_bin, C, per_bin))
        x = rows[a_idx]
        bh, bp = heavy[a_idx, h_idx], partners[a_idx, h_idx, c]
        for arr in (assign, w, k):
            tmp = arr[x, bh, i].copy()
            arr[x, bh, i] = arr[x, bp, j]
            arr[x, bp, j] = tmp
    return hit
