"""Two replicas per bin: replica counts built for a target busiest bin.

With two slots per gpu every gpu holds exactly two replicas, and for given replica counts the
best packing pairs the i-th heaviest replica with the i-th lightest (``paired_max``). What is
left is choosing the counts, and water-filling (the busiest *replica* as light as possible)
is a poor choice there: a replica of ``T - s`` wants a partner of at most ``s``, so the heavy
experts' replica sizes should fit the light experts' loads, not each other.

``pair_counts`` bisects on a target ``T`` for the busiest bin. For one ``T`` it builds counts
greedily: experts heavier than ``T / 2`` in descending load each take the fewest replicas
whose size ``l / c`` fits ``c`` still-unpaired light replicas (``l / c + partner <= T``),
taking the heaviest partners that fit so the light ones stay for heavier replicas; an expert
whose replicas drop to ``T / 2`` first joins the light ones instead. ``T`` is reached when
the pairs and the light replicas paired among themselves fit the bins; slots left over go to
the experts with the heaviest replicas. The counts of the lowest ``T`` reached win.
"""

from __future__ import annotations

from bisect import bisect_right, insort

import numpy as np

__all__ = ["pair_counts", "paired_max"]

# Relative allowance on comparisons with the target (float noise, not a real overshoot).
_EPS = 1e-12


def paired_max(loads: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``loads``, ``counts`` ``[X, E]`` (counts >= 1) → ``[X]``: the busiest bin when the
    replicas go two to a bin, i-th heaviest with i-th lightest (optimal for two per bin, up to
    two replicas of one expert meeting in the middle, which a packing then swaps apart)."""
    X, E = loads.shape
    ids = np.repeat(np.tile(np.arange(E), X), counts.ravel()).reshape(X, -1)
    w = np.sort((loads / counts)[np.arange(X)[:, None], ids], axis=1)
    return (w + w[:, ::-1]).max(axis=1)


def pair_counts(
    loads: np.ndarray, bins: int, cap: int | None, lo: np.ndarray, hi: np.ndarray, steps: int = 14
) -> np.ndarray:
    """``loads`` ``[X, E]`` with ``2 * bins`` replicas (at most ``cap`` per expert) → int64 counts
    ``[X, E]`` of the lowest target the greedy reached (see module doc) by bisection in
    ``[lo, hi]`` (``[X]``: a bound and a busiest bin already reached) over ``steps`` steps;
    rows where no target was reached are all zeros. Deterministic."""
    loads = np.asarray(loads, dtype=np.float64)
    X, E = loads.shape
    out = np.zeros((X, E), dtype=np.int64)
    limit = 2 * bins if cap is None else cap
    for x in range(X):
        a, b = float(lo[x]), float(hi[x])
        best, best_val = None, np.inf
        for _ in range(steps):
            mid = (a + b) / 2
            counts = _build(loads[x], mid, bins, limit)
            if counts is None:
                a = mid
                continue
            b = mid
            val = paired_max(loads[x][None], counts[None])[0]
            if val < best_val:
                best, best_val = counts, val
        if best is not None:
            out[x] = best
    return out


def _build(loads: np.ndarray, T: float, bins: int, cap: int) -> np.ndarray | None:
    """One row ``[E]``: counts whose pairing keeps every bin at most ``T``, or ``None``."""
    E = loads.size
    half = T / 2 * (1 + _EPS)
    counts = np.ones(E, dtype=np.int64)
    light = sorted(float(v) for v in loads[loads <= half])  # unpaired light replicas, ascending
    pairs = 0
    for e in np.argsort(-loads, kind="stable"):
        le = float(loads[e])
        if le <= half:
            break
        c = max(1, int(np.ceil(le / T - _EPS)))
        while c <= cap and le / c > half:
            k = bisect_right(light, T * (1 + _EPS) - le / c)
            if k >= c:  # the c heaviest partners that fit
                del light[k - c : k]
                pairs += c
                break
            c += 1
        else:
            m = int(np.ceil(2 * le / T - _EPS))
            if m > cap:
                return None
            c = m
            for _ in range(m):
                insort(light, le / m)
        counts[e] = c
    if 2 * pairs + len(light) + len(light) % 2 > 2 * bins:
        return None
    # Slots left over: to the experts with the heaviest replicas, as water-filling would.
    for _ in range(2 * bins - int(counts.sum())):
        w = np.where(counts < cap, loads / counts, -1.0)
        counts[w.argmax()] += 1
    return counts
