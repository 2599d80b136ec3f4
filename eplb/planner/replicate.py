"""Choosing replica counts: water-filling, the next replica to the largest per-replica load."""

from __future__ import annotations

from itertools import combinations

import numpy as np

__all__ = ["replica_cap", "waterfill", "count_vectors"]


def replica_cap(num_experts: int, num_slots: int, num_bins: int) -> int | None:
    """Most replicas one expert may get so no bin must hold two copies of it.

    ``None`` (no cap) when even ``num_bins`` copies of every expert cannot fill the slots,
    because then some bin must hold two copies anyway.
    """
    return num_bins if num_experts * num_bins >= num_slots else None


def waterfill(loads: np.ndarray, num_replicas: int, cap: int | None = None) -> np.ndarray:
    """``loads``: ``[X, n]`` >= 0 → int64 counts ``[X, n]``, each >= 1, rows summing to ``num_replicas``.

    Minimises the largest per-replica load ``loads / counts`` subject to ``counts <= cap``.
    Each redundant replica goes to the expert with the largest ``load / count`` (lowest index
    on ties); zero-load experts share what is left round-robin so an all-zero row still
    spreads its replicas. Deterministic.
    """
    loads = np.asarray(loads, dtype=np.float64)
    rows, n = loads.shape
    if num_replicas < n:
        raise ValueError(f"num_replicas ({num_replicas}) must be >= the number of experts ({n})")
    if cap is not None and cap * n < num_replicas:
        raise ValueError(f"cap ({cap}) x experts ({n}) < num_replicas ({num_replicas}): no valid counts")
    redundant = num_replicas - n
    hi = num_replicas if cap is None else cap
    total = loads.sum(axis=1, keepdims=True)
    # Start below the answer to save steps: an expert with load l ends with > l * redundant / total
    # replicas at the water level (each extra replica carries at least total / redundant).
    start = np.floor(loads * redundant / np.where(total > 0, total, 1.0))
    counts = np.clip(start, 1, hi).astype(np.int64)
    left = num_replicas - counts.sum(axis=1)
    key = _key(loads, counts, hi)
    steps = int(left.max(initial=0))
    if steps and (loads > 0).all():
        # Every key is load / count (-inf at the cap): the same steps through flat views, a
        # third fewer array operations per replica.
        base = np.arange(rows) * n
        # C order, so that reshape(-1) is a view (loads may be a transposed view, and then so
        # would be the arrays computed from it).
        counts, key = np.ascontiguousarray(counts), np.ascontiguousarray(key)
        flat_key, flat_counts, flat_loads = key.reshape(-1), counts.reshape(-1), loads.reshape(-1)
        for _ in range(steps):
            pick = key.argmax(axis=1)
            pick += base
            active = left > 0
            c = flat_counts[pick] + active
            flat_counts[pick] = c
            left -= active
            new = flat_loads[pick] / c
            new[c >= hi] = -np.inf
            flat_key[pick] = new
        return counts
    arange = np.arange(rows)
    for _ in range(steps):
        active = left > 0
        pick = key.argmax(axis=1)
        counts[arange, pick] += active
        left -= active
        key[arange, pick] = _key(loads[arange, pick], counts[arange, pick], hi)
    return counts


def _key(loads: np.ndarray, counts: np.ndarray, hi: int) -> np.ndarray:
    # Zero-load experts rank below every loaded one and among themselves by fewest replicas.
    key = np.where(loads > 0, loads / counts, -counts.astype(np.float64))
    return np.where(counts >= hi, -np.inf, key)


def count_vectors(num_experts: int, num_replicas: int, cap: int) -> np.ndarray:
    """``[V, E]`` int64: every vector of replica counts in ``1 .. cap`` summing to
    ``num_replicas`` (compositions: ``E - 1`` cut points among ``num_replicas - 1`` gaps).
    There are up to ``comb(num_replicas - 1, E - 1)``; callers check that first."""
    E, P = num_experts, num_replicas
    if E == 1:
        return np.array([[P]], dtype=np.int64) if P <= cap else np.zeros((0, 1), dtype=np.int64)
    cuts = np.fromiter((c for combo in combinations(range(1, P), E - 1) for c in combo), dtype=np.int64)
    cuts = cuts.reshape(-1, E - 1)
    edges = np.concatenate([np.zeros((len(cuts), 1), np.int64), cuts, np.full((len(cuts), 1), P)], axis=1)
    vectors = np.diff(edges, axis=1)
    return vectors[(vectors <= cap).all(axis=1)]
