"""Packing weighted items into bins of equal item count, minimising the heaviest bin.

Used twice by the hierarchical policy: expert groups onto nodes, replicas onto gpus.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pack", "bin_loads"]

# Relative gain below which a swap is float noise, not an improvement.
_REL_TOL = 1e-12


def pack(weights: np.ndarray, num_bins: int, keys: np.ndarray | None = None, *, max_rounds: int = 32) -> np.ndarray:
    """``weights``: ``[X, n]`` → int64 ``[X, num_bins, n // num_bins]``: the items in each bin.

    1. Deal: items in descending weight (ties keep input order), one round at a time, the
       heaviest item of a round to the lightest bin; an item whose ``keys`` value (``[X, n]``,
       e.g. the expert of a replica) is already in its bin trades bins with a nearby item
       of the same round, so no bin holds two equal keys where that can be avoided.
    2. Improve: up to ``max_rounds`` rounds in which bins are paired heaviest with lightest,
       second heaviest with second lightest, … and each pair makes the one item swap that
       most lowers its heavier bin (keeping keys distinct per bin). Deterministic.
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
        _improve(weights, keys, assign, max_rounds)
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
    for j in range(n):
        if not (held[j] == item_keys[j]).any():
            continue
        dist = np.abs(np.arange(n) - j)
        ok = ~(held == item_keys[j]).any(axis=1) & ~(held[j][None, :] == item_keys[:, None]).any(axis=1)
        if not ok.any():
            continue  # no trade inside this round helps: the clash is unavoidable here
        t = int(np.argmin(np.where(ok, dist, n)))
        target[[j, t]] = target[[t, j]]
        held[[j, t]] = held[[t, j]]


def _improve(weights: np.ndarray, keys: np.ndarray, assign: np.ndarray, max_rounds: int) -> None:
    rows, num_bins, per_bin = assign.shape
    half = num_bins // 2
    r3 = np.arange(rows)[:, None, None]
    w = weights[r3, assign]  # [X, B, S] kept in step with assign
    k = keys[r3, assign]
    active = np.arange(rows)
    for _ in range(max_rounds):
        if active.size == 0:
            return
        wa, ka = w[active], k[active]
        load = wa.sum(axis=2)
        srt = np.argsort(load, axis=1, kind="stable")
        heavy, light = srt[:, ::-1][:, :half], srt[:, :half]  # [A, H]
        ri = np.arange(active.size)[:, None]
        wh, wl = wa[ri, heavy], wa[ri, light]  # [A, H, S]
        kh, kl = ka[ri, heavy], ka[ri, light]
        lh, ll = load[ri, heavy], load[ri, light]  # [A, H]
        d = wh[:, :, :, None] - wl[:, :, None, :]  # [A, H, S(heavy item), S(light item)]
        new = np.maximum(lh[:, :, None, None] - d, ll[:, :, None, None] + d)
        tol = (_REL_TOL * lh)[:, :, None, None]
        ok = (d > tol) & (new < lh[:, :, None, None] - tol)
        # The heavy item's key must not already sit in the light bin, and vice versa.
        ok &= ~(kh[:, :, :, None] == kl[:, :, None, :]).any(axis=3)[:, :, :, None]
        ok &= ~(kl[:, :, None, :] == kh[:, :, :, None]).any(axis=2)[:, :, None, :]
        score = np.where(ok, new, np.inf).reshape(active.size, half, -1)
        best = score.argmin(axis=2)  # [A, H]
        hit = np.isfinite(np.take_along_axis(score, best[:, :, None], axis=2)[:, :, 0])
        if not hit.any():
            return
        a_idx, h_idx = np.nonzero(hit)
        i, j = np.divmod(best[a_idx, h_idx], per_bin)
        x = active[a_idx]
        bh, bl = heavy[a_idx, h_idx], light[a_idx, h_idx]
        for arr in (assign, w, k):
            tmp = arr[x, bh, i].copy()
            arr[x, bh, i] = arr[x, bl, j]
            arr[x, bl, j] = tmp
        active = np.unique(x)
