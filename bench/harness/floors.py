"""Lower bounds on a re-plan's moves when it keeps every replica count (``drift_bench``'s
"floor, counts kept"; ``moves_gap`` and ``replan_lns`` measure against them too)."""

from __future__ import annotations

import numpy as np


def floor_at(items: np.ndarray, cap: np.ndarray, nodes: int = 1, regroup: float = np.inf) -> np.ndarray:
    """``items`` ``[L, G, S]`` replica loads, ``cap`` ``[L]`` → ``[L]``: the fewest slots any
    re-plan that keeps every replica count must rewrite to bring each layer's busiest gpu to at
    most its cap (``inf`` where none can; see ``kept_count_floor``)."""
    L, G, S = items.shape
    n = np.arange(1, S + 1)
    rows = items.reshape(L, nodes, G // nodes, S)
    w_min = items.min(axis=(1, 2))[:, None, None, None]
    w_max = items.max(axis=(1, 2))[:, None, None, None]
    load = rows.sum(axis=3)  # [L, N, g]
    shed = np.cumsum(-np.sort(-rows, axis=3), axis=3) - n * w_min  # [L, N, g, S]: most shed with n slots
    take_max = n * w_max - np.cumsum(np.sort(rows, axis=3), axis=3)  # most taken with n slots, before room
    cap = cap[:, None, None]
    excess = np.maximum(load - cap, 0.0)  # [L, N, g]
    above = excess > 0
    own = np.where(above, (shed < excess[..., None]).sum(axis=3) + 1, 0)  # S + 1: cannot shed it
    room = np.where(above, 0.0, cap - load)
    taken = np.minimum(take_max, room[..., None])  # [L, N, g, S]
    gains = np.diff(taken, axis=3, prepend=0.0)  # each gpu's next slot takes less: concave
    best = np.cumsum(-np.sort(-gains.reshape(L, nodes, -1), axis=2), axis=2)  # [L, N, g * S]
    total = excess.sum(axis=2)
    takers = (best < total[..., None] - 1e-12).sum(axis=2) + (total > 0)
    ok = (own <= S).all(axis=2) & (best[..., -1] >= total - 1e-12)
    within = np.where(ok, own.sum(axis=2) + takers, np.inf).sum(axis=1)
    return np.minimum(within, regroup)


def kept_count_floor(
    items: np.ndarray,
    fresh_max: np.ndarray,
    fresh_imb: np.ndarray,
    tolerance: float,
    nodes: int = 1,
    regroup: float = np.inf,
) -> float:
    """``items`` ``[L, G, S]`` replica loads of the current placement under the new loads,
    ``fresh_max``, ``fresh_imb`` ``[L]`` → a lower bound on the slots any re-plan that keeps every
    replica count must rewrite to bring the mean imbalance within ``(1 + tolerance)`` of fresh's.

    With counts kept the replica loads stay as they are and so does the total. A gpu above its
    layer's cap ``T`` must shed its excess: with ``n`` slots rewritten it sheds at most its ``n``
    heaviest replicas less ``n`` of the lightest replica of the layer, which sets its fewest
    slots. What all of them shed lands on gpus below ``T``; with ``n`` slots rewritten one takes
    at most ``min(room, n x heaviest replica - its n lightest)``, and taking the largest of those
    gains slot by slot gives the fewest slots that hold the total excess. For plans that keep
    groups whole on nodes (``nodes`` > 1) replicas stay in their node, so this holds node by
    node, and a layer that cannot reach ``T`` that way must move groups between nodes: at least
    ``regroup`` slots (every replica of two groups' experts). Layers may trade balance for
    moves under the mean bound: the Lagrangian dual over caps on a grid (each layer's bound read
    at the next grid point up) is a lower bound on the total.
    """
    L = items.shape[0]
    mean = items.sum(axis=2).mean(axis=1)
    grid = np.linspace(0.0, 0.1, 201)
    caps = fresh_max[:, None] * (1 + grid[None, :])  # [L, K]
    floor = np.zeros((L, grid.size))
    for i in range(grid.size):
        floor[:, i] = floor_at(items, caps[:, min(i + 1, grid.size - 1)], nodes, regroup)
    imb = caps / mean[:, None]
    keep_imb = items.sum(axis=2).max(axis=1) / mean
    budget = (1 + tolerance) * fresh_imb.sum()
    best_val = 0.0
    for lam in np.concatenate([[0.0], np.logspace(-1, 7, 400)]):
        # A layer may also stay as it is, at its own imbalance and no moves.
        val = np.minimum((floor + lam * imb).min(axis=1), lam * keep_imb).sum() - lam * budget
        best_val = max(best_val, val)
    return best_val
