"""Lower bounds on the busiest gpu: what no placement can beat.

- the mean gpu load;
- the largest replica: replica counts sum to the slot count and (capped at the gpu count)
  water-filling minimises the largest ``loads[e] / count[e]``;
- with two slots per gpu, the pairing bound: every gpu holds exactly two replicas, so a
  replica heavier than half the target needs a gpu of its own and a light partner;
- with two slots per gpu, the profile bound: the pairing condition at every threshold, mixed
  two thresholds at a time (``profile_bound``). It is tighter where replicas cannot all find
  partners (1.5 experts per gpu under a steep zipf) but takes about a second per full model,
  so ``row_bound`` and ``Plan.imbalance_lb`` leave it out; benchmarks report it.

``row_bound`` works on rows of any packing problem (a layer, or one node of a layer);
``lower_bound`` on a topology's layers. Two more serve single steps: ``pigeonhole_bound``
(what a few hot experts' replica counts force on one gpu; ``eplb.planner.hot`` picks counts by
it) and ``integer_bound`` (the simple bound in the ILP's integer units).
"""

from __future__ import annotations

from itertools import combinations

import numpy as np

from .planner.replicate import replica_cap, waterfill
from .topology import Topology

__all__ = [
    "lower_bound",
    "row_bound",
    "simple_bound",
    "pairing_bound",
    "profile_bound",
    "pigeonhole_bound",
    "integer_bound",
    "item_bound",
    "counts_bound",
    "group_bound",
]

# Bisection steps of the pairing bound: 2**-40 of the starting interval is far below float noise
# in any figure we report.
_STEPS = 40
# Rounding allowance that keeps the pairing test permissive (a bound must never be too high).
_EPS = 1e-9


def simple_bound(loads: np.ndarray, bins: int, slots: int, cap: int | None) -> np.ndarray:
    """``loads`` ``[X, n]`` → ``[X]``: the larger of the mean bin and the largest replica of the
    water-filled counts (``slots`` replicas in all, at most ``cap`` per expert)."""
    loads = np.asarray(loads, dtype=np.float64)
    counts = waterfill(loads, slots, cap)
    return np.maximum(loads.sum(axis=1) / bins, (loads / counts).max(axis=1))


def pairing_bound(loads: np.ndarray, bins: int, cap: int | None, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """``loads`` ``[X, n]`` with two slots per bin (``2 * bins`` replicas) → ``[X]`` lower bound on
    the busiest bin, between ``start`` (a known bound) and ``stop`` (a known feasible value).

    If the busiest bin is at most ``T``, every replica weighs at most ``T`` (expert ``e`` has at
    least ``h_e = ceil(l_e / T)`` replicas) and a replica above ``T / 2`` shares its bin with one
    below it, so at most ``bins`` replicas are above ``T / 2``. An expert either keeps heavy
    replicas (at least ``h_e`` of them, each using up a bin) or has only light ones (at least
    ``m_e = ceil(2 l_e / T)``). ``T`` is impossible when even the best such choice — solved as
    a fractional knapsack, which only relaxes it — needs more than ``2 * bins`` replicas. The
    largest ``T`` found impossible by bisection is the bound.
    """
    loads = np.asarray(loads, dtype=np.float64)
    lo = np.asarray(start, dtype=np.float64).copy()
    hi = np.maximum(np.asarray(stop, dtype=np.float64), lo)
    # Only rows with an interval left: an all-zero row has none (and a target of 0).
    rows = np.flatnonzero(hi > lo * (1 + 1e-6))
    for _ in range(_STEPS):
        if rows.size == 0:
            break
        mid = (lo[rows] + hi[rows]) / 2
        bad = _impossible(loads[rows], mid, bins, cap)
        lo[rows] = np.where(bad, mid, lo[rows])
        hi[rows] = np.where(bad, hi[rows], mid)
    return lo


def _impossible(loads: np.ndarray, T: np.ndarray, bins: int, cap: int | None) -> np.ndarray:
    """``[X]``: whether no replica counts let every bin (two replicas) stay at most ``T`` ``[X]``."""
    t = T[:, None]
    h = np.maximum(np.ceil(loads / t - _EPS), 1.0)
    m = np.maximum(np.ceil(2 * loads / t - _EPS), 1.0)
    heavy_able = loads / h > t / 2 * (1 + _EPS)  # h replicas are heavy; else h == m
    limit = np.inf if cap is None else cap
    too_many = (h > limit).any(axis=1)
    forced = heavy_able & (m > limit)  # light would need more replicas than allowed
    room = bins - np.where(forced, h, 0.0).sum(axis=1)
    saved_forced = np.where(forced, m - h, 0.0).sum(axis=1)
    # The rest: heavy saves m - h replicas for h bins; take the best ratios first, fractionally.
    # The knapsack's value depends only on the ratios (a few distinct ones: (m - h) / h of small
    # integers), so the items are summed per ratio and the classes taken in falling ratio, the
    # last in part: no sort of each row's items, half of this test's time at two slots per gpu.
    # The value is the per-item sort's to rounding, and ``need`` is an integer less a fraction
    # of small denominator, never within rounding of ``2 bins (1 + _EPS)``: the same verdicts.
    free = heavy_able & ~forced
    X = loads.shape[0]
    cls, C = _ratio_classes(h, m - h, free)
    key = (np.arange(X)[:, None] * C + cls).ravel()
    # Items that are not free weigh 0 in their class: the sums add the free items in the same
    # order as over those alone, and x + 0.0 is x.
    cost_c = np.bincount(key, weights=np.where(free, h, 0.0).ravel(), minlength=X * C).reshape(X, C)
    gain_c = np.bincount(key, weights=np.where(free, m - h, 0.0).ravel(), minlength=X * C).reshape(X, C)
    before = np.cumsum(cost_c, axis=1) - cost_c
    take = np.clip((np.maximum(room, 0.0)[:, None] - before) / np.maximum(cost_c, 1.0), 0.0, 1.0)
    saved = saved_forced + (take * gain_c).sum(axis=1)
    need = m.sum(axis=1) - saved
    return too_many | (room < 0) | (need > 2 * bins * (1 + _EPS))


def _ratio_classes(cost: np.ndarray, gain: np.ndarray, free: np.ndarray) -> tuple[np.ndarray, int]:
    """``cost`` >= 1 and ``gain`` >= 0, integer-valued ``[X, n]``, ``free`` ``[X, n]`` → each item's
    class ``[X, n]`` (0 where not free) and the number of classes ``C``: the index of
    ``-(gain / cost)`` among the distinct values over the free items, ascending, as
    ``np.unique(..., return_inverse=True)`` numbers them. The pairs are few small integers, so
    the distinct ones come from a count of ``gain * K + cost`` codes and only those are sorted:
    sorting every free item's ratio was 40 % of the pairing bound's time (128 gpus x 2 slots)."""
    if not free.any():
        return np.zeros(cost.shape, dtype=np.int64), 1
    K = int(cost[free].max()) + 1
    G = int(gain[free].max()) + 1
    if G * K > 4 * cost.size:  # large counts (no cap): the plain way
        r_, c_ = np.nonzero(free)
        cls = np.zeros(cost.shape, dtype=np.int64)
        ratios, inv = np.unique(-(gain[r_, c_] / cost[r_, c_]), return_inverse=True)
        cls[r_, c_] = inv.reshape(-1)
        return cls, max(ratios.size, 1)
    code = np.where(free, gain * K + cost, G * K).astype(np.int64)
    present = np.flatnonzero(np.bincount(code.ravel(), minlength=G * K + 1)[:-1])
    # The same float values as -(gain / cost) of the items: integers convert exactly.
    ratios, inv = np.unique(-((present // K).astype(np.float64) / (present % K)), return_inverse=True)
    table = np.zeros(G * K + 1, dtype=np.int64)
    table[present] = inv.reshape(-1)
    return table[code], max(ratios.size, 1)


# Thresholds y / T and mixing weights the profile bound tries (more: tighter and slower).
_Y = np.linspace(0.5, 0.96, 12)
_ALPHA = np.linspace(0.0, 1.0, 7)


def profile_bound(loads: np.ndarray, bins: int, cap: int | None, start: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """``loads`` ``[X, n]`` with two slots per bin → ``[X]`` lower bound on the busiest bin,
    between ``start`` (a known bound) and ``stop`` (a known feasible value), by bisection.

    If every bin is at most ``T``, the replicas sorted and paired i-th heaviest with i-th
    lightest stay within ``T``, which holds iff for every threshold ``y`` in ``[T/2, T]`` the
    replicas above ``y`` are at most those of at most ``T - y``. Counting all ``2 bins`` slots,
    that reads ``F(y) = #(T - y, y] + 2 #(y, T] <= 2 bins``, and ``F`` adds up over experts: an
    expert of ``c`` replicas of ``p = l / c`` adds ``c + c [y < p]`` when ``p > T / 2`` and
    ``c [y >= T - p]`` otherwise. Any weighted mean of ``F(T)`` (all replicas) and ``F(y)``
    must be at most ``2 bins`` too, and its least value splits into a choice of ``c`` per
    expert; ``T`` is impossible when that least value exceeds ``2 bins`` for some ``y`` and
    weight. Two replicas of one expert may share a bin here, which only relaxes it.
    """
    loads = np.asarray(loads, dtype=np.float64)
    lo = np.asarray(start, dtype=np.float64).copy()
    hi = np.maximum(np.asarray(stop, dtype=np.float64), lo)
    live = hi > lo * (1 + 1e-6)
    limit = np.inf if cap is None else float(cap)
    for _ in range(_STEPS // 2):
        if not live.any():
            break
        rows = np.flatnonzero(live)
        mid = (lo[rows] + hi[rows]) / 2
        bad = _profile_impossible(loads[rows], mid, bins, limit)
        lo[rows] = np.where(bad, mid, lo[rows])
        hi[rows] = np.where(bad, hi[rows], mid)
        live = hi > lo * (1 + 1e-5)
    return lo


def _profile_impossible(loads: np.ndarray, T: np.ndarray, bins: int, cap: float) -> np.ndarray:
    """``loads`` ``[X, n]``, ``T`` ``[X]`` → ``[X]``: whether some mix of ``F(T)`` and ``F(y)``
    proves ``T`` impossible (see ``profile_bound``)."""
    t = T[:, None, None]  # [X, 1, 1]
    y = _Y[None, :, None] * t  # [X, Y, 1]
    ld = loads[:, None, :]  # [X, 1, n]
    c0 = np.maximum(np.ceil(ld / t * (1 - _EPS)), 1.0)
    # The per-expert cost is increasing in c between the starts of the regions where F's form
    # changes (p <= y, p < T - y); the least value is at one of them (neighbours guard against
    # rounding, and any extra candidate only keeps the bound lower).
    ca = np.ceil(ld / y)
    cb = np.floor(ld / (t - y)) + 1
    cands = [np.broadcast_to(c0, ca.shape)] + [np.maximum(c, c0) for c in (ca - 1, ca, cb - 1, cb)]

    def cost(c: np.ndarray) -> np.ndarray:
        p = ld / c
        heavy = p > t / 2 * (1 + _EPS)
        fy = np.where(heavy, c + c * (y < p * (1 - _EPS)), c * (y >= (t - p) * (1 + _EPS)))  # [X, Y, n]
        ok = c <= cap
        # cost for each mixing weight a: a * c + (1 - a) * f(y)  -> [X, Y, A, n]
        mix = _ALPHA[None, None, :, None] * c[:, :, None, :] + (1 - _ALPHA)[None, None, :, None] * fy[:, :, None, :]
        return np.where(ok[:, :, None, :], mix, np.inf)

    best = cost(cands[0])
    for c in cands[1:]:
        best = np.minimum(best, cost(c))
    need = best.sum(axis=3)  # [X, Y, A]
    return (need > 2 * bins * (1 + _EPS)).any(axis=(1, 2)) | (c0 > cap).any(axis=(1, 2))


def row_bound(
    loads: np.ndarray, bins: int, slots_per_bin: int, cap: int | None, feasible: np.ndarray | None = None
) -> np.ndarray:
    """``loads`` ``[X, n]`` packed into ``bins`` bins of ``slots_per_bin`` replicas (at most
    ``cap`` per expert) → ``[X]``: the best bound we can prove on the busiest bin. With two
    slots per bin and ``feasible`` (``[X]``, a busiest bin some placement reaches; default:
    twice the simple bound) the pairing bound joins in."""
    loads = np.asarray(loads, dtype=np.float64)
    simple = simple_bound(loads, bins, bins * slots_per_bin, cap)
    if slots_per_bin != 2 or bins < 2:
        return simple
    stop = 2 * simple if feasible is None else feasible
    return np.maximum(simple, pairing_bound(loads, bins, cap, simple, stop))


def group_bound(loads: np.ndarray, topology: Topology) -> np.ndarray:
    """``loads`` ``[L, E]`` → ``[L]``: no placement that keeps expert groups whole on nodes
    (``num_groups / num_nodes`` groups per node, as ``hierarchical`` does) has a busiest gpu
    below this. The busiest node carries at least the mean node, and at least what the node
    holding the heaviest group carries with the lightest other groups; with two groups per node
    the groups paired heaviest with lightest are the best split, so its heaviest pair. The
    busiest gpu carries at least its node's mean gpu."""
    t = topology
    L, N = t.num_layers, t.num_nodes
    per_node = t.num_groups // N
    groups = np.sort(np.asarray(loads, dtype=np.float64).reshape(L, t.num_groups, -1).sum(axis=2), axis=1)
    node = groups.sum(axis=1) / N
    if per_node == 2:
        node = np.maximum(node, (groups + groups[:, ::-1]).max(axis=1))
    elif per_node > 2:
        node = np.maximum(node, groups[:, -1] + groups[:, : per_node - 1].sum(axis=1))
    else:
        node = np.maximum(node, groups[:, -1])
    return node / (t.num_gpus // N)


def lower_bound(loads: np.ndarray, topology: Topology) -> np.ndarray:
    """``loads`` ``[L, E]`` → ``[L]``: no placement's busiest gpu can carry less (see module doc)."""
    t = topology
    cap = replica_cap(t.num_experts, t.num_slots, t.num_gpus)
    return row_bound(loads, t.num_gpus, t.slots_per_gpu, cap)


def pigeonhole_bound(top: np.ndarray, grid: np.ndarray, bins: int) -> np.ndarray:
    """``top`` ``[R, k]`` loads of ``k`` experts, ``grid`` ``[V, k]`` candidate replica counts
    (at most one replica of an expert per bin) → ``[R, V]``: the busiest bin is at least
    - their largest replica;
    - the ``m`` smallest of their replicas, ``m = ceil(sum c / bins)``: some bin holds ``m``;
    - for every subset ``T`` with ``sum_T c > (|T| - 1) bins``, the sum of its replicas: some
      bin holds one of each (a bin without all of ``T`` holds at most ``|T| - 1`` of them).
    """
    R, k = top.shape
    w = top[:, None, :] / grid[None, :, :]  # [R, V, k]
    srt = np.sort(w, axis=2)
    m = -(-grid.sum(axis=1) // bins)  # [V]
    out = np.take_along_axis(
        np.cumsum(srt, axis=2), np.broadcast_to((m - 1)[None, :, None], (R, len(grid), 1)), axis=2
    )[..., 0]
    out = np.maximum(out, srt[:, :, -1])
    for size in range(2, k + 1):
        for subset in combinations(range(k), size):
            cols = list(subset)
            together = grid[:, cols].sum(axis=1) > (size - 1) * bins  # [V]
            out = np.maximum(out, np.where(together[None, :], w[:, :, cols].sum(axis=2), 0.0))
    return out


def integer_bound(w: np.ndarray, num_slots: int, num_gpus: int) -> int:
    """``w``: ``[E, C]`` → a lower bound on the busiest gpu in integer units.

    ``eplb.lower_bound`` on the rounded weights: the mean (total load over gpus, with each
    expert's cheapest total ``c * w[e, c]``), and the smallest per-replica load ``T`` for which
    giving each expert its fewest replicas with ``w[e, c] <= T`` fits in the slots.
    """
    counts = np.arange(1, w.shape[1] + 1)
    total = int((w * counts).min(axis=1).sum())
    mean = -(-total // num_gpus)
    # w[e, c] falls with c, so the fewest replicas reaching T are a count of entries above T.
    for t in np.unique(w):
        need = (w > t).sum(axis=1) + 1
        if (need <= w.shape[1]).all() and need.sum() <= num_slots:
            return max(mean, int(t))
    return mean  # unreachable: T = max(w) always fits


def item_bound(weights: np.ndarray, bins: int) -> np.ndarray:
    """``weights`` ``[X, n]`` items (replicas, or expert groups) packed into ``bins`` bins →
    ``[X]``: the heaviest bin carries at least the mean bin and the heaviest item."""
    return np.maximum(weights.sum(axis=1) / bins, weights.max(axis=1))


def counts_bound(loads: np.ndarray, vectors: np.ndarray, bins: int) -> np.ndarray:
    """``loads`` ``[X, E]``, ``vectors`` ``[V, E]`` replica counts → ``[X, V]``: with those counts
    the busiest bin carries at least the mean bin and the largest replica. Computed in chunks
    of rows so the ``[rows, V, E]`` temporary stays near 32 MB."""
    X = loads.shape[0]
    chunk = max(1, (1 << 22) // max(vectors.size, 1))
    largest = np.concatenate(
        [(loads[i : i + chunk, None, :] / vectors[None, :, :]).max(axis=2) for i in range(0, X, chunk)]
    )
    return np.maximum(largest, (loads.sum(axis=1) / bins)[:, None])
