"""Two replicas per bin: replica counts searched for a target busiest bin by their excess.

With two slots per gpu the best packing of given counts pairs the i-th heaviest replica with
the i-th lightest (``eplb.planner.pairing.paired_max``), so a search on counts can judge each
candidate by one sort. ``pair_descent`` judges by the busiest pair, and on realistic routing
counts (dead experts, layers of mixed skew) it stops 1-3 % short of the best counts CP-SAT
finds: those keep experts near the target whole, paired with a dead expert's empty replica,
and split mid-sized experts into small partners of just the right size, which takes many
count moves at once, each of them no better for the busiest pair on its own.

``target_search`` judges instead by the *excess* over a target ``T``: the sum over all pairs
of how far each is above ``T``. Every move that brings any pair closer to ``T`` counts, so the
descent walks where the busiest pair alone sees a plateau; the row has reached ``T`` when the
excess is zero. ``T`` steps down from the busiest pair reached towards a lower bound, and each
descent goes on from where the last one stopped (at a lower ``T`` it got closer than the best
counts so far). At its full width it needs more candidates than the default's budget leaves
after the other lines (about 3 000 per layer at 256 experts on 192 gpus), so the search
(``eplb.planner.search.refine_thorough``) runs it two ways: at ``effort="high"`` last, on half
of what is left (``bench/shapes_bench.py``, 256 experts on 192 gpus with dead experts: 1.0386
to 1.0340; mixed skew: 1.0422 to 1.0383), and at the default, for rows of a profile of their
own, narrow (6 gainers x 8 donors) on the second half of the pairing descent's share (1.0405
to 1.0392 and 1.0408 to 1.0393; 1.0440 to 1.0443 on mixed skew).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .pairing import move_candidates, moved_replicas, pair_sums, paired_max, sorted_replicas

__all__ = ["excess_descent", "target_search"]

# Candidates of one descent step: the experts that carry the most excess (either side of a
# pair above the target) and the lightest experts gain a replica, from donors whose replicas
# stay smallest or grow least. From where the default stops, with no budget, on the three
# 256e/192gpu shapes above 1.04: 16 x 24 reaches 1.031-1.039 for about 3 000 candidates per
# layer, 8 x 16 1.036-1.042 for 1 100, 32 x 48 1.029-1.035 for 10 000.
_GAINERS = 16
_DONORS = 24
# Relative allowance on the excess and the target (float noise, not a real overshoot).
_EPS = 1e-12
# target_search's first target is this fraction below the busiest pair reached; the step
# doubles on each target reached and halves on each missed. Bisecting from the middle of
# [bound, busiest] instead spends the first descents on targets out of reach (at a budget of
# 2 000 candidates per layer: 1.0409 against 1.0372 on 256e/192gpu dead15).
_FIRST_STEP = 0.005


def _excess(w: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Sorted replicas ``[K, 2 * bins]``, ``target`` ``[K]`` → ``[K]``: the sum over the sorted
    pairing's pairs of how far each is above the target."""
    pairs = pair_sums(w)
    return np.maximum(pairs - target[:, None], 0.0).sum(axis=1)


def excess_descent(
    loads: np.ndarray,
    counts: np.ndarray,
    bins: int,
    cap: int | None,
    *,
    target: np.ndarray,
    iterations: int = 64,
    spend: Callable[[int], int] | None = None,
    gainers: int = _GAINERS,
    donors: int = _DONORS,
) -> tuple[np.ndarray, np.ndarray]:
    """Steepest descent on replica counts judged by the excess over ``target``: ``loads``,
    ``counts`` ``[X, E]`` (``2 * bins`` replicas per row, at most ``cap`` per expert) →
    (counts ``[X, E]``, their excess ``[X]``), the excess never higher than at the start.

    A step moves one replica from a donor to a gainer, all rows in one batch. Gainers: the
    ``_GAINERS`` experts whose replicas sit in pairs above the target with the most excess
    between them, and the lightest experts; donors: experts with two or more replicas whose
    replicas stay smallest, or grow least, with one fewer. Each row takes its candidate of
    least excess (the first in candidate order among equals). Rows stop at zero excess, when
    no candidate lowers it, after ``iterations`` steps, or when ``spend`` runs out: called with
    a step's candidate count it returns how many may be judged (the rows whose candidates all
    fit go on). Same input, same counts."""
    loads = np.asarray(loads, dtype=np.float64)
    X, E = loads.shape
    counts = counts.copy()
    limit = 2 * bins if cap is None else cap
    target = np.asarray(target, dtype=np.float64) * (1 + _EPS)
    w, _ = sorted_replicas(loads, counts)
    cur = _excess(w, target)
    active = np.flatnonzero(cur > 0)
    for _ in range(iterations):
        if active.size == 0:
            break
        A = active.size
        sorted_w, ids = sorted_replicas(loads[active], counts[active])
        tg = target[active]
        pairs = pair_sums(sorted_w)
        over = np.maximum(pairs - tg[:, None], 0.0)  # [A, bins]
        # Excess carried per expert: each pair's on both of its replicas' experts.
        flat = (np.arange(A)[:, None] * E + np.concatenate([ids[:, :bins], ids[:, ::-1][:, :bins]], axis=1)).ravel()
        carried = np.bincount(flat, weights=np.concatenate([over, over], axis=1).ravel(), minlength=A * E)
        c = counts[active]
        ld = loads[active]
        carried = np.where(c < limit, carried.reshape(A, E), -1.0)
        g_over = np.argsort(-carried, axis=1, kind="stable")[:, :gainers]
        g_light = np.argsort(np.where(c < limit, ld * c, np.inf), axis=1, kind="stable")[:, : max(1, gainers // 4)]
        gain = np.concatenate([g_over, g_light], axis=1)
        rows, ge, gf = move_candidates(ld, c, gain, donors, limit, spend)
        if rows.size == 0:
            break
        score = _excess(moved_replicas(sorted_w, ids, ld, c, rows, ge, gf), tg[rows])
        order = np.lexsort((score, rows))
        first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
        r_best = rows[first]
        win = score[first] < cur[active[r_best]] * (1 - 1e-9)
        x = active[r_best[win]]
        pick = first[win]
        counts[x] = c[rows[pick]]
        counts[x, ge[pick]] += 1
        counts[x, gf[pick]] -= 1
        cur[x] = score[pick]
        active = x[cur[x] > 0]
    return counts, cur


def target_search(
    loads: np.ndarray,
    counts: np.ndarray,
    bins: int,
    cap: int | None,
    *,
    lo: np.ndarray,
    steps: int = 8,
    iterations: int = 64,
    spend: Callable[[int], int] | None = None,
    gainers: int = _GAINERS,
    donors: int = _DONORS,
) -> np.ndarray:
    """``loads``, ``counts`` ``[X, E]`` (``2 * bins`` replicas per row, at most ``cap`` per
    expert) → counts ``[X, E]`` whose paired busiest bin (``paired_max``) is never higher.

    Up to ``steps`` targets ``T`` between ``lo`` ``[X]`` (a bound, or a target the row need
    not go below) and the busiest pair reached ``hi``: the first ``_FIRST_STEP`` below ``hi``
    (never below the middle of ``[lo, hi]``), the step doubling after a target reached and
    halving after one missed. For each ``T`` an :func:`excess_descent` (``iterations`` steps)
    from where the last one stopped; zero excess makes its counts the best so far and their
    busiest pair the new ``hi``, else ``T`` becomes the new ``lo``. ``spend`` as for
    :func:`excess_descent`; the same input gives the same counts."""
    loads = np.asarray(loads, dtype=np.float64)
    best = counts.copy()
    hi = paired_max(loads, best)
    lo = np.minimum(np.asarray(lo, dtype=np.float64), hi).copy()
    cur = best.copy()
    step = np.full(hi.shape, _FIRST_STEP)
    for _ in range(steps):
        rows = np.flatnonzero(hi > lo * (1 + 1e-9))
        if rows.size == 0:
            break
        T = np.maximum(hi[rows] * (1 - step[rows]), (lo[rows] + hi[rows]) / 2)
        got, ex = excess_descent(
            loads[rows],
            cur[rows],
            bins,
            cap,
            target=T,
            iterations=iterations,
            spend=spend,
            gainers=gainers,
            donors=donors,
        )
        cur[rows] = got
        reached = ex <= 0
        r = rows[reached]
        best[r] = got[reached]
        hi[r] = paired_max(loads[r], got[reached]) if r.size else hi[r]
        step[r] *= 2
        f = rows[~reached]
        lo[f] = T[~reached]
        step[f] /= 2
    return best
