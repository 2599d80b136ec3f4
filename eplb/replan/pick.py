"""Picking one candidate per layer: fewest moves within the imbalance allowed.

A step waits for the busiest gpu of every layer, so the sum of imbalance over layers is what
costs time: ``pick`` spends a budget on that sum where it saves the most moves (Lagrangian,
then greedy), ``pick_within`` adds per-layer caps and move budgets, ``score`` measures the
candidates.
"""

from __future__ import annotations

import numpy as np

from ..metrics import imbalance
from ..topology import Topology

__all__ = ["score", "pick_within", "pick"]


def score(
    ways: list[tuple[str, np.ndarray]], loads: np.ndarray, old: np.ndarray, topology: Topology
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """``ways`` (name, ``phy2log`` ``[L, P]``) pairs → names, candidates ``[C, L, P]``, their
    imbalance and moves ``[C, L]``."""
    names = [name for name, _ in ways]
    cands = np.stack([c for _, c in ways])
    # A repair from a previous placement with two replicas of an expert on one gpu can lose an
    # expert; such a layer falls back to the kept one rather than publish an invalid plan.
    E = topology.num_experts
    C, L, P = cands.shape

    def counts(c: np.ndarray) -> np.ndarray:
        keys = (np.arange(C * L)[:, None] * E + c.reshape(C * L, P)).ravel()
        return np.bincount(keys, minlength=C * L * E).reshape(C, L, E)

    cnt = counts(cands)
    lost = (cnt == 0).any(axis=2)
    if lost.any():
        cands = np.where(lost[:, :, None], old[None], cands)
        cnt = counts(cands)
    # eplb.metrics.gpu_loads for every candidate at once, the same arithmetic (so the same
    # values) without building and checking a Placement per candidate.
    per_replica = loads[None] / np.maximum(cnt, 1)
    load = np.take_along_axis(per_replica, cands, axis=2).reshape(C, L, topology.num_gpus, -1).sum(axis=3)
    imb = np.stack([imbalance(x) for x in load])
    moves = (cands != old[None]).sum(axis=2).astype(np.float64)
    return names, cands, imb, moves


def pick_within(
    moves: np.ndarray, imb: np.ndarray, cap: np.ndarray, budget: float, max_layer_moves: int | None
) -> np.ndarray:
    """``moves``, ``imb`` ``[C, L]`` (row 0 kept, the last fresh aligned) → the fewest moves that
    meet the mean ``budget`` with every layer within ``cap`` ``[L]`` and ``max_layer_moves``; a
    layer where nothing within its move budget meets its cap may take anything within it."""
    allowed = imb <= cap
    allowed[-1] = True  # fresh aligned has fresh's balance (and is "kept" when alone)
    if max_layer_moves is not None:
        fits = moves <= max_layer_moves
        fits[0] = True
        allowed &= fits
        stuck = ~allowed.any(axis=0)
        allowed[:, stuck] = fits[:, stuck]
    return pick(np.where(allowed, moves, np.inf), imb, budget)


def pick(cost: np.ndarray, imb: np.ndarray, budget: float) -> np.ndarray:
    """``cost``, ``imb``: ``[C, L]`` (``inf`` cost: not allowed) → ``[L]`` candidate per layer with
    the least total cost whose ``imb`` sums to at most ``budget`` (Lagrangian, then greedy)."""
    C, L = cost.shape
    cols = np.arange(L)

    def at(lam: float) -> np.ndarray:
        return np.argmin(cost + lam * imb, axis=0)  # first minimum: the earlier candidate

    best = np.argmin(np.where(np.isfinite(cost), imb, np.inf), axis=0)
    if imb[best, cols].sum() > budget:
        return best  # nothing meets the budget; the most balanced allowed candidates
    lo, hi = -3.0, 15.0  # log10 of lambda
    pick = at(10.0**hi)
    if imb[pick, cols].sum() > budget:
        pick = best
    for _ in range(50):
        mid = (lo + hi) / 2
        trial = at(10.0**mid)
        if imb[trial, cols].sum() <= budget:
            hi, pick = mid, trial
        else:
            lo = mid
    # Spend what the Lagrangian left of the budget on the cheapest swaps to fewer moves.
    left = budget - imb[pick, cols].sum()
    while True:
        saved = cost[pick, cols][None, :] - cost  # [C, L]
        extra = imb - imb[pick, cols][None, :]
        ok = (saved > 0) & np.isfinite(saved) & (extra <= left)
        if not ok.any():
            return pick
        rate = np.where(ok, saved / np.maximum(extra, 1e-300), -np.inf)
        c, layer = np.unravel_index(np.argmax(rate), rate.shape)
        left -= max(extra[c, layer], 0.0)
        pick[layer] = c
