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

import heapq
import math
from bisect import bisect_right, insort
from collections.abc import Callable

import numpy as np

from ..layout import take_rows

__all__ = [
    "pair_counts",
    "pair_counts_sweep",
    "pair_descent",
    "paired_max",
    "pair_sums",
    "move_candidates",
    "moved_replicas",
    "sorted_replicas",
]

# Relative allowance on comparisons with the target (float noise, not a real overshoot).
_EPS = 1e-12


def paired_max(loads: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``loads``, ``counts`` ``[X, E]`` (counts >= 1) → ``[X]``: the busiest bin when the
    replicas go two to a bin, i-th heaviest with i-th lightest (optimal for two per bin, up to
    two replicas of one expert meeting in the middle, which a packing then swaps apart)."""
    X, E = loads.shape
    ids = np.repeat(np.tile(np.arange(E), X), counts.ravel()).reshape(X, -1)
    return pair_sums(np.sort(take_rows(loads / counts, ids), axis=1)).max(axis=1)


def pair_sums(w: np.ndarray) -> np.ndarray:
    """Sorted replicas ``[K, 2 * bins]`` → ``[K, bins]``: the i-th lightest plus the i-th heaviest,
    each pair once (half the additions of ``(w + w[:, ::-1])[:, :bins]``, the same values)."""
    half = w.shape[1] // 2
    return w[:, :half] + w[:, : half - 1 : -1]


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
    # Each row's loads as Python floats, in descending order (ties by expert) and ascending:
    # the construction below is scalar work, which numpy scalars slow down several times.
    desc = np.argsort(-loads, axis=1, kind="stable")
    for x in range(X):
        row = loads[x].tolist()
        order = desc[x].tolist()
        asc = sorted(row)
        a, b = float(lo[x]), float(hi[x])
        found = []
        for _ in range(steps):
            mid = (a + b) / 2
            counts = _build(row, order, asc, mid, bins, limit)
            if counts is None:
                a = mid
                continue
            b = mid
            found.append(counts)
        if found:
            # The first of the lowest pairings, judged in one batch.
            val = paired_max(np.broadcast_to(loads[x], (len(found), E)), np.array(found, dtype=np.int64))
            out[x] = found[int(val.argmin())]
    return out


def _build(row: list[float], order: list[int], asc: list[float], T: float, bins: int, cap: int) -> list[int] | None:
    """One row's loads ``row`` ``[E]`` (``order``: experts by descending load, ties by index;
    ``asc``: the loads ascending) → counts ``[E]`` whose pairing keeps every bin at most ``T``,
    or ``None``."""
    half = T / 2 * (1 + _EPS)
    counts = [1] * len(row)
    light = asc[: bisect_right(asc, half)]  # unpaired light replicas, ascending
    pairs = 0
    for e in order:
        le = row[e]
        if le <= half:
            break
        c = max(1, math.ceil(le / T - _EPS))
        while c <= cap and le / c > half:
            k = bisect_right(light, T * (1 + _EPS) - le / c)
            if k >= c:  # the c heaviest partners that fit
                del light[k - c : k]
                pairs += c
                break
            c += 1
        else:
            m = math.ceil(2 * le / T - _EPS)
            if m > cap:
                return None
            c = m
            for _ in range(m):
                insort(light, le / m)
        counts[e] = c
    if 2 * pairs + len(light) + len(light) % 2 > 2 * bins:
        return None
    # Slots left over: to the experts with the heaviest replicas, as water-filling would (the
    # first expert on ties; one at the cap counts as -1, as an argmax over them would).
    left = 2 * bins - sum(counts)
    if left > 0:
        heap = [(-row[e] / c if c < cap else 1.0, e) for e, c in enumerate(counts)]
        heapq.heapify(heap)
        for _ in range(left):
            # One sift instead of a pop and a push: the same items come out (they are distinct).
            e = heap[0][1]
            counts[e] += 1
            heapq.heapreplace(heap, (-row[e] / counts[e] if counts[e] < cap else 1.0, e))
    return counts


# pair_descent: experts of the busiest pairs and the lightest experts gain a replica, from the
# donors whose replicas stay smallest or grow least; ties in the busiest pair are broken by a
# soft count of the pairs near it, at this width (a fraction of the mean bin).
_GAINERS_LIGHT = 4
_GAINERS_MANY = 4
_TIE_WIDTH = 0.005


def sorted_replicas(loads: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``loads``, ``counts`` ``[K, E]`` → replica sizes in ascending order ``[K, P]`` and the
    expert of each ``[K, P]`` (ties by expert)."""
    K, E = loads.shape
    ids = np.repeat(np.tile(np.arange(E), K), counts.ravel()).reshape(K, -1)
    w = take_rows(loads / counts, ids)
    order = np.argsort(w, axis=1, kind="stable")
    return take_rows(w, order), take_rows(ids, order)


def moved_replicas(
    sorted_w: np.ndarray,
    ids: np.ndarray,
    ld: np.ndarray,
    c: np.ndarray,
    rows: np.ndarray,
    ge: np.ndarray,
    gf: np.ndarray,
) -> np.ndarray:
    """Rows' sorted replicas ``sorted_w`` and their experts ``ids`` ``[A, P]``, loads ``ld`` and
    counts ``c`` ``[A, E]``, count moves ``rows``, gainer ``ge``, donor ``gf`` ``[K]`` → ``[K, P]``:
    each move's replicas, sorted: its row's with the gainer's and the donor's resized and one
    of the donor's handed to the gainer."""
    size_g = ld[rows, ge] / (c[rows, ge] + 1)
    size_f = ld[rows, gf] / (c[rows, gf] - 1)
    base = ids[rows]
    is_f = base == gf[:, None]
    # Masked copies into the gathered rows: a third less traffic than two nested wheres.
    w = sorted_w[rows]
    np.copyto(w, size_g[:, None], where=base == ge[:, None])
    np.copyto(w, size_f[:, None], where=is_f)
    w[np.arange(rows.size), is_f.argmax(axis=1)] = size_g
    w.sort(axis=1)
    return w


def move_candidates(
    ld: np.ndarray,
    c: np.ndarray,
    gain: np.ndarray,
    donors: int,
    limit: int,
    spend: Callable[[int], int] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``ld``, ``c`` ``[A, E]`` (loads and counts of the rows searched), ``gain`` ``[A, ng]``
    experts that may take one more replica → the count moves to judge, flat: ``rows`` (into the
    ``A`` rows), gainer ``ge`` and donor ``gf``. Each row's ``donors`` donors are half those whose
    replicas stay smallest after giving one up, half those whose replicas grow least; a move
    needs a gainer below ``limit`` replicas and a donor with two or more. With ``spend``, only
    the rows whose candidates it pays for, whole and in order (deterministic)."""
    size_after = np.where(c >= 2, ld / np.maximum(c - 1, 1), np.inf)
    half = max(1, donors // 2)
    d1 = np.argsort(size_after, axis=1, kind="stable")[:, :half]
    d2 = np.argsort(size_after - ld / c, axis=1, kind="stable")[:, : donors - half]
    give = np.concatenate([d1, d2], axis=1)  # [A, nd]
    ng, nd = gain.shape[1], give.shape[1]
    rows = np.repeat(np.arange(ld.shape[0]), ng * nd)
    ge = np.repeat(gain, nd, axis=1).ravel()
    gf = np.tile(give, (1, ng)).ravel()
    ok = (ge != gf) & (c[rows, ge] < limit) & (c[rows, gf] >= 2)
    rows, ge, gf = rows[ok], ge[ok], gf[ok]
    if spend is not None:
        fit = int(spend(rows.size))
        if fit < rows.size:
            keep = rows < (rows[fit] if fit > 0 else 0)
            rows, ge, gf = rows[keep], ge[keep], gf[keep]
    return rows, ge, gf


def pair_descent(
    loads: np.ndarray,
    counts: np.ndarray,
    bins: int,
    cap: int | None,
    *,
    target: np.ndarray,
    iterations: int = 32,
    donors: int = 24,
    spend: Callable[[int], int] | None = None,
    pairs_k: int = 2,
) -> np.ndarray:
    """Steepest descent on replica counts judged by ``paired_max``: ``loads``, ``counts``
    ``[X, E]`` (``2 * bins`` replicas per row, at most ``cap`` per expert) → counts ``[X, E]``
    whose paired busiest bin is never higher.

    A step moves one replica from a donor to a gainer. Gainers: both experts of the
    ``pairs_k`` busiest pairs (the heavy replica shrinks, or the light partner splits into
    smaller partners), the lightest experts (split, they partner the heaviest replicas) and
    the experts with the most replicas (every count shifts the pairing); donors: experts with
    two or more replicas whose replicas stay smallest, or grow least, with one fewer (``donors``
    in all). Of all candidates each row takes the lowest busiest pair, ties broken by how many
    pairs sit within ``_TIE_WIDTH`` of it, so the step walks along plateaus of the maximum.
    Rows stop at ``target`` ``[X]``, when no candidate helps, after ``iterations`` steps, or
    when ``spend`` runs out: called with each step's candidate count, it returns how many of
    them may be judged (the step then keeps the rows whose candidates all fit). Same input,
    same counts."""
    loads = np.asarray(loads, dtype=np.float64)
    X, E = loads.shape
    counts = counts.copy()
    limit = 2 * bins if cap is None else cap
    scale = loads.sum(axis=1) / bins
    tau = _TIE_WIDTH * scale

    def key(w: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted replicas ``[K, 2 * bins]`` → the busiest pair and the pairs near it ``[K]``."""
        pairs = pair_sums(w)
        top = pairs.max(axis=1)
        soft = np.count_nonzero(pairs > top[:, None] - tau[rows, None], axis=1)
        return top, soft

    w, _ = sorted_replicas(loads, counts)
    cur_top, cur_soft = key(w, np.arange(X))
    active = np.flatnonzero(cur_top > target)
    ng_pairs = pairs_k
    for _ in range(iterations):
        if active.size == 0:
            break
        A = active.size
        ra = np.arange(A)
        sorted_w, ids = sorted_replicas(loads[active], counts[active])
        pairs = pair_sums(sorted_w)
        # Experts of the ng_pairs busiest pairs (light and heavy side).
        top_i = np.argsort(-pairs, axis=1, kind="stable")[:, :ng_pairs]
        g_pair = np.concatenate([ids[ra[:, None], top_i], ids[ra[:, None], 2 * bins - 1 - top_i]], axis=1)
        c = counts[active]
        ld = loads[active]
        light_key = np.where(c < limit, ld * c, np.inf)  # lightest total, fewest replicas first
        g_light = np.argsort(light_key, axis=1, kind="stable")[:, :_GAINERS_LIGHT]
        g_many = np.argsort(-np.where(c < limit, c, -1), axis=1, kind="stable")[:, :_GAINERS_MANY]
        gain = np.concatenate([g_pair, g_light, g_many], axis=1)  # [A, ng]
        rows, ge, gf = move_candidates(ld, c, gain, donors, limit, spend)
        if rows.size == 0:
            break
        # Each candidate's replicas: its row's sorted replicas with the gainer's and the donor's
        # resized and one of the donor's handed to the gainer, sorted again.
        top, soft = key(moved_replicas(sorted_w, ids, ld, c, rows, ge, gf), active[rows])
        # Lexicographic (busiest pair, soft count): the soft count is at most ``bins``, so a
        # tiny multiple of it never outweighs a real change of the maximum.
        score = top / scale[active[rows]] + 1e-9 * soft / bins
        order = np.lexsort((score, rows))
        first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
        r_best = rows[first]
        now = cur_top[active[r_best]] / scale[active[r_best]] + 1e-9 * cur_soft[active[r_best]] / bins
        win = score[first] < now - 1e-15
        x = active[r_best[win]]
        pick = first[win]
        counts[x] = c[rows[pick]]
        counts[x, ge[pick]] += 1
        counts[x, gf[pick]] -= 1
        cur_top[x], cur_soft[x] = top[first[win]], soft[first[win]]
        active = x[cur_top[x] > target[x]]
    return counts


def pair_counts_sweep(
    loads: np.ndarray, bins: int, cap: int | None, lo: np.ndarray, hi: np.ndarray, steps: int = 10
) -> np.ndarray:
    """As :func:`pair_counts` (``loads`` ``[X, E]`` → int64 counts ``[X, E]`` of the lowest
    target reached by bisection in ``[lo, hi]``, zeros where none was) with another
    construction for one target ``T`` (``_sweep``): heavy replicas in descending size take the
    lightest unpaired light replicas, and an expert whose replicas do not all find a partner
    gets one more replica and waits for its smaller size. ``pair_counts`` gives each heavy
    expert its replicas at once, in descending load, and takes partners from the heavy end;
    which one comes closer depends on the loads, so the search tries both. Deterministic."""
    loads = np.asarray(loads, dtype=np.float64)
    X, E = loads.shape
    out = np.zeros((X, E), dtype=np.int64)
    limit = 2 * bins if cap is None else cap
    order = np.argsort(loads, axis=1, kind="stable")  # ascending
    for x in range(X):
        asc = loads[x, order[x]].tolist()
        a, b = float(lo[x]), float(hi[x])
        best = None
        for _ in range(steps):
            mid = (a + b) / 2
            counts = _sweep(asc, mid, bins, limit)
            if counts is None:
                a = mid
            else:
                b, best = mid, counts
        if best is not None:
            out[x, order[x]] = best
    return out


def _sweep(asc: list[float], T: float, bins: int, cap: int) -> list[int] | None:
    """One row of loads in ascending order → counts (same order) whose pairing keeps every
    bin at most ``T``, or ``None`` (see :func:`pair_counts_sweep`). Slots left over split the
    heaviest light replicas."""
    half = T / 2 * (1 + _EPS)
    top = T * (1 + _EPS)
    n = len(asc)
    k = bisect_right(asc, half)  # asc[:k] are light
    counts = [1] * n
    light = asc[:k]  # light replicas, ascending
    used = 0  # the lightest `used` of them partner heavy replicas already
    heap = []  # (-replica size, position) of heavy experts not yet placed
    for i in range(k, n):
        v = asc[i]
        c = max(1, -int(-v // T))
        while v / c > top:
            c += 1
        if c > cap:
            return None
        counts[i] = c
        heap.append((-v / c, i))
    heapq.heapify(heap)
    while heap:
        neg, i = heapq.heappop(heap)
        p, c = -neg, counts[i]
        if p <= half:  # split down to light replicas: they partner the rest
            for _ in range(c):
                insort(light, p)
            continue
        if used + c <= len(light) and light[used + c - 1] <= top - p:
            used += c
            continue
        if c + 1 > cap:
            return None
        counts[i] = c + 1
        heapq.heappush(heap, (-asc[i] / (c + 1), i))
    left = 2 * bins - sum(counts)
    if left < 0:
        return None
    # Slots left over: to light experts with the heaviest replicas (a light replica split
    # stays light, and smaller partners only help the pairing).
    free = [(-asc[i] / counts[i], i) for i in range(n) if counts[i] < cap and asc[i] / counts[i] <= half]
    heapq.heapify(free)
    for _ in range(left):
        if not free:
            return None
        i = free[0][1]
        counts[i] += 1
        if counts[i] < cap:
            heapq.heapreplace(free, (-asc[i] / counts[i], i))
        else:
            heapq.heappop(free)
    return counts
