"""Re-choosing replica counts for the busiest gpu, one slot at a time.

Water-filling picks counts that minimise the busiest *replica*; with few slots per gpu the
busiest *gpu* is what matters, and big replicas that cannot share a gpu decide it. A count
move gives expert ``e`` on the busiest gpu one more replica, written over one replica of a
donor expert ``f`` on another gpu ``q``: every gpu holding ``e`` gets lighter, those holding
``f`` heavier, ``q`` trades ``f``'s replica for ``e``'s. Each layer makes the move that most
lowers its busiest gpu, then a few swap rounds rebalance; repeat while it pays. A move
rewrites one slot, so the same step also serves migration-aware repair.
"""

from __future__ import annotations

from itertools import combinations
from math import comb

import numpy as np

from .budget import Budget
from .packing import improve, pack
from .pairing import pair_counts, paired_max
from .replicate import count_vectors, waterfill

__all__ = ["refine_counts", "refine_thorough", "rotate_improve", "swap_improve", "separate_hot", "pigeonhole_bound"]

_REL_TOL = 1e-12
# Distance above the mean bin load below which a row is left alone.
_GOOD_ENOUGH = 1e-3
# How much worse than now a count move may leave the busiest bin before the swaps after it.
_SLACK = 0.1
# Moves a row may make without lowering its busiest bin before it stops.
_PATIENCE = 4


def _counts(phy: np.ndarray, num_experts: int) -> np.ndarray:
    """``phy`` ``[X, ...]`` expert ids → ``[X, E]`` int64 replicas of each expert per row."""
    X = phy.shape[0]
    # One bincount over (row, expert) keys: np.add.at is several times slower on the hot path.
    keys = (np.arange(X, dtype=np.int64)[:, None] * num_experts + phy.reshape(X, -1)).ravel()
    return np.bincount(keys, minlength=X * num_experts).reshape(X, num_experts).astype(np.int64, copy=False)


def refine_counts(
    loads: np.ndarray,
    phy: np.ndarray,
    cap: int | None,
    *,
    iterations: int = 8,
    donors: int = 8,
    swap_rounds: int = 2,
    target: np.ndarray | None = None,
    budget: Budget | None = None,
    reverse: bool = False,
) -> np.ndarray:
    """``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` (experts per bin, no duplicates in a bin) →
    improved ``phy`` ``[X, B, S]`` with the same shape; counts change, every expert keeps >= 1
    replica and at most ``cap`` (``None``: no cap). A row stops once its busiest bin is at
    most ``target[row]`` (``[X]``, default: within 0.1 % of the mean). ``reverse`` also tries
    the reverse move (``_count_move_out``) each step, keeping the better. ``budget`` (work units,
    see ``eplb.budget``) stops it between moves; deterministic unless it has a deadline.
    """
    X, B, S = phy.shape
    E = loads.shape[1]
    phy = phy.copy()
    hi = np.iinfo(np.int64).max if cap is None else cap
    # Rows whose busiest bin is already within _GOOD_ENOUGH of the mean have nothing to gain.
    if target is None:
        target = loads.sum(axis=1) / B * (1 + _GOOD_ENOUGH)
    active = np.flatnonzero(_bin_loads(loads, phy).max(axis=1) > target)
    best = np.full(X, np.inf)
    idle = np.zeros(X, dtype=np.int64)
    clock = budget or Budget()
    for _ in range(iterations):
        if active.size == 0 or B < 2 or clock.out():
            break
        # Each (gainer, donor, bin) candidate is a few array operations: an eighth of a unit.
        clock.spend(active.size * B * S * min(donors, E) / 8)
        before = _bin_loads(loads[active], phy[active]).max(axis=1)
        snapshot = phy[active]
        # A move may first overload the bin that keeps the donor's last replica; the swaps
        # after it often fix that, so try it and undo it if the busiest bin did not improve.
        moved = _count_move(loads[active], phy, active, hi, donors, _SLACK)
        if reverse:
            # The reverse move: an expert on the busiest bin gives up its replica there to a
            # cold expert. Water-filling can give two hot experts so many replicas that some
            # gpus must hold both; fewer replicas of one of them can be what helps.
            trial = phy.copy()
            out = _count_move_out(loads[active], trial, active, hi, donors, _SLACK)
            v_in = _bin_loads(loads[active], phy[active]).max(axis=1)
            v_out = _bin_loads(loads[active], trial[active]).max(axis=1)
            take = out & (~moved | (v_out < v_in * (1 - _REL_TOL)))
            phy[active[take]] = trial[active[take]]
            moved |= take
        if moved.any():
            swap_improve(loads, phy, active[moved], swap_rounds, target)
        now = _bin_loads(loads[active], phy[active]).max(axis=1)
        undo = moved & (now > before * (1 + _REL_TOL))
        phy[active[undo]] = snapshot[undo]
        now = np.where(undo, before, now)
        moved &= ~undo
        # Ties at the top need moves that keep the maximum while unloading one busiest bin;
        # a row stops after a few of those in a row, or at once when nothing could move.
        changed = active[moved]
        now = now[moved]
        idle[changed] = np.where(now < best[changed] * (1 - _REL_TOL), 0, idle[changed] + 1)
        best[changed] = np.minimum(best[changed], now)
        active = changed[(idle[changed] < _PATIENCE) & (now > target[changed])]
    return phy


def _bin_loads(loads: np.ndarray, phy: np.ndarray) -> np.ndarray:
    cnt = _counts(phy, loads.shape[1])
    ra = np.arange(phy.shape[0])[:, None, None]
    return (loads / np.maximum(cnt, 1))[ra, phy].sum(axis=2)


def _busiest(loads: np.ndarray, phy: np.ndarray) -> tuple[np.ndarray, ...]:
    """``loads`` ``[A, E]``, ``phy`` ``[A, B, S]`` → replica counts ``[A, E]``, replica weights
    ``[A, E]``, bin loads ``[A, B]``, the busiest bin ``[A]`` and its load ``[A]``."""
    ra = np.arange(phy.shape[0])
    cnt = _counts(phy, loads.shape[1])
    w = loads / cnt
    load = w[ra[:, None, None], phy].sum(axis=2)
    h = load.argmax(axis=1)
    return cnt, w, load, h, load[ra, h]


def _count_move(
    loads: np.ndarray, phy_all: np.ndarray, rows: np.ndarray, hi: int, donors: int, slack: float = 0.0
) -> np.ndarray:
    """One count move per row of ``rows``: the one leaving the lightest busiest bin, made when
    that is at most ``(1 + slack)`` times the current busiest; ``phy_all`` updated in place.
    Returns ``[A]`` bool: which rows moved."""
    phy = phy_all[rows]
    A, B, S = phy.shape
    E = loads.shape[1]
    ra = np.arange(A)
    cnt, w, load, h, lmax = _busiest(loads, phy)
    gain = phy[ra, h]  # [A, S] experts on the busiest bin
    c_g = cnt[ra[:, None], gain]
    w_g = loads[ra[:, None], gain] / c_g
    d_e = w_g - loads[ra[:, None], gain] / (c_g + 1)  # how much each holder of e sheds
    w_new_e = w_g - d_e
    # Donors: the experts whose replicas grow least when they lose one.
    grown = np.where(cnt >= 2, loads / np.maximum(cnt - 1, 1), np.inf)
    D = min(donors, E)
    don = np.argpartition(grown, D - 1, axis=1)[:, :D] if D < E else np.broadcast_to(np.arange(E), (A, E))
    w_f = w[ra[:, None], don]
    d_f = np.where(np.isfinite(grown[ra[:, None], don]), grown[ra[:, None], don] - w_f, np.inf)  # [A, D]
    He = (phy[:, None, :, :] == gain[:, :, None, None]).any(axis=3)  # [A, S, B]: bin holds gainer
    Hf = (phy[:, None, :, :] == don[:, :, None, None]).any(axis=3)  # [A, D, B]: bin holds donor
    He4, Hf4 = He[:, :, None, :], Hf[:, None, :, :]
    new = load[:, None, None, :] - d_e[:, :, None, None] * He4 + np.where(Hf4, d_f[:, None, :, None], 0.0)
    # Max over bins other than q: the top two of `new` cover every q.
    arg1 = new.argmax(axis=3)
    first = np.arange(B) == arg1[..., None]
    m1 = np.take_along_axis(new, arg1[..., None], axis=3)
    m2 = np.where(first, -np.inf, new).max(axis=3, keepdims=True)
    other = np.where(first, m2, m1)
    at_q = load[:, None, None, :] - w_f[:, None, :, None] + w_new_e[:, :, None, None]
    score = np.maximum(other, at_q)
    ok = Hf4 & ~He4 & (c_g < hi)[:, :, None, None] & np.isfinite(d_f)[:, None, :, None]
    ok &= gain[:, :, None, None] != don[:, None, :, None]
    # The busiest bin must really get lighter (not so for zero-load experts).
    ok &= (d_e > _REL_TOL * lmax[:, None])[:, :, None, None]
    score = np.where(ok, score, np.inf).reshape(A, -1)
    best = score.argmin(axis=1)
    val = score[ra, best]
    moved = val <= lmax * (1 + slack + _REL_TOL)
    if moved.any():
        s, d, q = np.unravel_index(best[moved], (S, D, B))
        a = ra[moved]
        e, f = gain[a, s], don[a, d]
        slot = (phy[a, q] == f[:, None]).argmax(axis=1)
        phy_all[rows[a], q, slot] = e
    return moved


def _count_move_out(
    loads: np.ndarray, phy_all: np.ndarray, rows: np.ndarray, hi: int, gainers: int, slack: float = 0.0
) -> np.ndarray:
    """One reverse count move per row of ``rows``: an expert ``f`` on the busiest bin ``h``
    (with at least two replicas) loses its replica there, written over with a new replica of a
    cold expert ``g`` (among the ``gainers`` whose new replica is lightest, not on ``h``): ``h``
    trades ``f``'s replica for ``g``'s, ``f``'s other holders get heavier, ``g``'s lighter. Made
    when the busiest bin after it is at most ``(1 + slack)`` times the current one;
    ``phy_all`` updated in place. Returns ``[A]`` bool: which rows moved."""
    phy = phy_all[rows]
    A, B, S = phy.shape
    E = loads.shape[1]
    ra = np.arange(A)
    cnt, w, load, h, lmax = _busiest(loads, phy)
    give = phy[ra, h]  # [A, S] experts on the busiest bin
    c_f = cnt[ra[:, None], give]
    w_f = w[ra[:, None], give]
    d_f = np.where(c_f >= 2, loads[ra[:, None], give] / np.maximum(c_f - 1, 1) - w_f, np.inf)  # [A, S]
    light = np.where(cnt < hi, loads / (cnt + 1), np.inf)
    D = min(gainers, E)
    gain = np.argpartition(light, D - 1, axis=1)[:, :D] if D < E else np.broadcast_to(np.arange(E), (A, E))
    w_g = w[ra[:, None], gain]
    w_new_g = light[ra[:, None], gain]  # [A, D]
    d_g = w_g - w_new_g
    Hf = (phy[:, None, :, :] == give[:, :, None, None]).any(axis=3)  # [A, S, B]
    Hg = (phy[:, None, :, :] == gain[:, :, None, None]).any(axis=3)  # [A, D, B]
    new = load[:, None, None, :] + np.where(Hf[:, :, None, :], d_f[:, :, None, None], 0.0)
    new = new - np.where(Hg[:, None, :, :], d_g[:, None, :, None], 0.0)
    new[ra, :, :, h] = -np.inf  # h itself is scored below
    at_h = lmax[:, None, None] - w_f[:, :, None] + w_new_g[:, None, :]
    score = np.maximum(new.max(axis=3), at_h)  # [A, S, D]
    ok = np.isfinite(d_f)[:, :, None] & np.isfinite(w_new_g)[:, None, :]
    ok &= ~Hg[ra, :, h][:, None, :]  # h must not hold g already
    ok &= give[:, :, None] != gain[:, None, :]
    score = np.where(ok, score, np.inf).reshape(A, -1)
    best = score.argmin(axis=1)
    val = score[ra, best]
    moved = val <= lmax * (1 + slack + _REL_TOL)
    if moved.any():
        s, d = np.unravel_index(best[moved], (S, D))
        a = ra[moved]
        phy_all[rows[a], h[a], s] = gain[a, d]
    return moved


def rotate_improve(
    loads: np.ndarray, phy: np.ndarray, target: np.ndarray, rounds: int = 32, partners: int = 4, seconds: int = 4
) -> None:
    """Three-slot rotations that bring two bins above ``target`` (``[X]``) under it at once, in
    place on ``phy`` ``[X, B, S]`` (counts unchanged): the heaviest bin ``h1`` hands an item
    ``a`` to a light bin ``q`` (one of the ``partners`` lightest), ``q`` hands ``b`` to another
    bin above the target ``h2`` (one of the ``seconds`` least above it), and ``h2`` hands ``c``
    to ``h1``. Two swaps would rewrite four slots for the same two bins. Each round every row
    with two bins above its target makes the feasible rotation (all three at most the target,
    no expert twice on a bin) that leaves the heaviest of the three lightest; a row stops when
    it has none."""
    X, B, S = phy.shape
    if B < 3 or S < 1:
        return
    E = loads.shape[1]
    Q = min(partners, B - 2)
    H = min(seconds, B - 2)
    active = np.arange(X)
    for _ in range(rounds):
        if active.size == 0:
            return
        sub = phy[active]
        w = (loads[active] / _counts(sub, E))[np.arange(active.size)[:, None, None], sub]  # [A, B, S]
        load = w.sum(axis=2)
        above = load > target[active][:, None]
        keep = above.sum(axis=1) >= 2
        if not keep.any():
            return
        active, sub, w, load, above = active[keep], sub[keep], w[keep], load[keep], above[keep]
        A = active.size
        ra = np.arange(A)
        tgt = target[active]
        order = np.argsort(-load, axis=1, kind="stable")
        h1, qs = order[:, 0], order[:, ::-1][:, :Q]  # [A], [A, Q]
        # Second bins: the least loaded of those above the target (the heaviest excluded).
        key = np.where(above, load, np.inf)
        key[ra, h1] = np.inf
        h2s = np.argsort(key, axis=1, kind="stable")[:, :H]  # [A, H]
        h2_ok = np.isfinite(np.take_along_axis(key, h2s, axis=1))  # [A, H]
        a_w, a_k, L1 = w[ra, h1], sub[ra, h1], load[ra, h1]  # [A, S]
        c_w, c_k, L2 = w[ra[:, None], h2s], sub[ra[:, None], h2s], load[ra[:, None], h2s]  # [A, H, S]
        b_w, b_k, Lq = w[ra[:, None], qs], sub[ra[:, None], qs], load[ra[:, None], qs]  # [A, Q, S]
        # Each bin's new load depends on two of the three items: score each pair of items once
        # (inf where that bin would go above the target or hold an expert twice), then take
        # the max over the three on the [H, Q, i, j, k] grid of each row.
        # No expert twice on a bin: an incoming item's expert may sit only in the slot it replaces.
        t4 = tgt[:, None, None, None]
        in_h1 = a_k[:, None, :, None] == c_k[:, :, None, :]  # [A, H, i, j]
        bad_c = in_h1.any(axis=2, keepdims=True) & ~in_h1
        n1 = L1[:, None, None, None] - a_w[:, None, :, None] + c_w[:, :, None, :]  # [A, H, i, j]
        m1 = np.where((n1 <= t4) & ~bad_c & h2_ok[:, :, None, None], n1, np.inf)
        in_h2 = c_k[:, :, None, :, None] == b_k[:, None, :, None, :]  # [A, H, Q, j, k]
        bad_b = in_h2.any(axis=3, keepdims=True) & ~in_h2
        n2 = L2[:, :, None, None, None] - c_w[:, :, None, :, None] + b_w[:, None, :, None, :]
        m2 = np.where((n2 <= tgt[:, None, None, None, None]) & ~bad_b, n2, np.inf)
        in_q = b_k[:, :, None, :] == a_k[:, None, :, None]  # [A, Q, i, k]
        bad_a = in_q.any(axis=3, keepdims=True) & ~in_q
        nq = Lq[:, :, None, None] - b_w[:, :, None, :] + a_w[:, None, :, None]  # [A, Q, i, k]
        mq = np.where((nq <= t4) & ~bad_a, nq, np.inf)
        # A rotation needs a feasible pair on each of the three bins: the grid is built only for
        # the (row, h2, q) triples that have all three (few, after the first rounds).
        f1 = np.isfinite(m1).any(axis=(2, 3))  # [A, H]
        f2 = np.isfinite(m2).any(axis=(3, 4))  # [A, H, Q]
        fq = np.isfinite(mq).any(axis=(2, 3))  # [A, Q]
        pa, ph, pq = np.nonzero(f1[:, :, None] & f2 & fq[:, None, :])
        if pa.size == 0:
            return
        # Axes: [triple, i (a's slot on h1), j (c's slot on h2), k (b's slot on q)].
        score = np.maximum(m1[pa, ph][:, :, :, None], m2[pa, ph, pq][:, None, :, :])
        np.maximum(score, mq[pa, pq][:, :, None, :], out=score)
        score = score.reshape(pa.size, -1)
        inner = score.argmin(axis=1)
        value = score[np.arange(pa.size), inner]
        # Per row the least value, ties to the first (h2, q) and then the first slots: what an
        # argmin over the row's whole [H, Q, S, S, S] grid gives.
        order = np.lexsort((np.arange(pa.size), value, pa))
        first = order[np.r_[True, pa[order][1:] != pa[order][:-1]]]
        first = first[np.isfinite(value[first])]
        if first.size == 0:
            return
        x = pa[first]
        hi_, qi = ph[first], pq[first]
        i, j, k = np.unravel_index(inner[first], (S, S, S))
        h2, q = h2s[x, hi_], qs[x, qi]
        rows_ = active[x]
        a_e, c_e, b_e = a_k[x, i], c_k[x, hi_, j], b_k[x, qi, k]
        phy[rows_, h1[x], i] = c_e
        phy[rows_, h2, j] = b_e
        phy[rows_, q, k] = a_e
        active = active[x]


def swap_improve(
    loads: np.ndarray, phy: np.ndarray, rows: np.ndarray, rounds: int, target: np.ndarray | None = None
) -> None:
    """Swap slots between bins of ``phy`` ``[X, B, S]`` (rows ``rows``, in place) to lower each
    row's busiest bin, stopping at ``target`` ``[X]``; counts stay as they are."""
    sub = phy[rows]
    A, B, S = sub.shape
    ra = np.arange(A)
    cnt = _counts(sub, loads.shape[1])
    keys = sub.reshape(A, B * S)
    weights = (loads[rows] / cnt)[ra[:, None], keys]
    assign = np.broadcast_to(np.arange(B * S).reshape(B, S), (A, B, S)).copy()
    improve(weights, keys, assign, max_rounds=rounds, target=None if target is None else target[rows])
    phy[rows] = np.take_along_axis(keys, assign.reshape(A, -1), axis=1).reshape(A, B, S)


def _pack_counts(loads: np.ndarray, counts: np.ndarray, bins: int, max_rounds: int = 16) -> np.ndarray:
    """``loads``, ``counts``: ``[X, E]`` → ``[X, B, S]`` experts per bin, freshly packed."""
    X, E = loads.shape
    ids = np.repeat(np.tile(np.arange(E), X), counts.ravel()).reshape(X, -1)
    w = (loads / counts)[np.arange(X)[:, None], ids]
    return ids[np.arange(X)[:, None, None], pack(w, bins, ids, max_rounds=max_rounds)]


# separate_hot re-packs guided counts only for rows at least this far above their bound, and
# only when the count grid (bins ** 3) is at most this big.
_GUIDED_MARGIN = 0.01
_GUIDED_GRID = 1 << 15

# repack_search with many candidates per row of at least _SCREEN_SLOTS slots screens them
# with a quick packing (_QUICK swap rounds) and packs only each row's best _SCREEN properly;
# small rows are cheap to pack, and there the quick ranking loses the optimum too often.
_SCREEN = 4
_QUICK = 2
_SCREEN_SLOTS = 128


def repack_search(
    loads: np.ndarray,
    phy: np.ndarray,
    cap: int | None,
    *,
    iterations: int = 12,
    batch: int = 768,
    target: np.ndarray | None = None,
    budget: Budget | None = None,
) -> np.ndarray:
    """Steepest descent over single count moves (one replica from ``f`` to ``e``), each
    candidate judged by packing its counts from scratch, all candidates of all rows packed in
    one batch of at most ``batch`` rows. Small layers try every (e, f) pair; larger ones the
    heaviest experts of the busiest bin against the donors whose replicas grow least. Rows stop
    at ``target`` ``[X]`` (default: within 0.1 % of the mean bin) or when ``budget`` is spent.
    ``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` → ``[X, B, S]``, never worse per row."""
    X, B, S = phy.shape
    E = loads.shape[1]
    hi = np.iinfo(np.int64).max if cap is None else cap
    best = phy.copy()
    best_max = _bin_loads(loads, best).max(axis=1)
    counts = _counts(best, E)
    if target is None:
        target = loads.sum(axis=1) / B * (1 + _GOOD_ENOUGH)
    active = np.flatnonzero(best_max > target)
    clock = budget or Budget()
    for _ in range(iterations):
        if active.size == 0 or clock.out():
            break
        # A step packs its candidates in one go: hold it to the units left, so a small
        # budget (a re-plan's) is not overrun several times by one step.
        step = batch if clock.units is None else min(batch, int((clock.units - clock.spent) // (B * S * S)))
        per_row = max(1, step // active.size)
        if E * (E - 1) <= per_row:
            e, f = np.nonzero(~np.eye(E, dtype=bool))
            gain = np.broadcast_to(e, (active.size, e.size))
            give = np.broadcast_to(f, (active.size, f.size))
        else:
            ng = max(1, min(S, int(np.sqrt(per_row))))
            nd = max(1, min(E - 1, per_row // ng))
            load = _bin_loads(loads[active], best[active])
            top = best[active, load.argmax(axis=1)]  # [A, S] experts on the busiest bin
            w_top = (loads[active] / counts[active])[np.arange(active.size)[:, None], top]
            g = np.take_along_axis(top, np.argsort(-w_top, axis=1, kind="stable")[:, :ng], axis=1)
            grown = np.where(counts[active] >= 2, loads[active] / np.maximum(counts[active] - 1, 1), np.inf)
            d = np.argsort(grown, axis=1, kind="stable")[:, :nd]
            gain = np.repeat(g, nd, axis=1)
            give = np.tile(d, (1, ng))
        M = gain.shape[1]
        rows = np.repeat(active, M)
        cand = counts[rows].copy()
        rr = np.arange(rows.size)
        ge, gf = gain.ravel(), give.ravel()
        ok = (ge != gf) & (cand[rr, ge] < hi) & (cand[rr, gf] >= 2)
        if not ok.any():
            break
        rows, rr, ge, gf = rows[ok], np.arange(ok.sum()), ge[ok], gf[ok]
        cand = cand[ok]
        cand[rr, ge] += 1
        cand[rr, gf] -= 1
        screen = S == 2 or (B * S >= _SCREEN_SLOTS and rows.size > _SCREEN * np.unique(rows).size)
        if screen:
            # Rank every candidate cheaply, then pack the best few of each row properly. Two
            # replicas per bin: pairing the i-th heaviest with the i-th lightest is the best
            # packing unless two replicas of one expert meet, so a sort gives the value.
            # Otherwise a quick packing (few swap rounds) ranks counts well enough.
            if S == 2:
                quick = paired_max(loads[rows], cand)
            else:
                quick = _bin_loads(loads[rows], _pack_counts(loads[rows], cand, B, max_rounds=_QUICK)).max(axis=1)
            order = np.lexsort((quick, rows))
            starts = np.r_[0, np.flatnonzero(rows[order][1:] != rows[order][:-1]) + 1]
            rank = np.arange(order.size) - np.repeat(starts, np.diff(np.r_[starts, order.size]))
            keep = order[rank < _SCREEN]
            # Pairing is one sort (an eighth of a slot's packing work); a quick packing is _QUICK rounds.
            clock.spend(quick.size * B * S * (0.125 if S == 2 else _QUICK))
            rows, cand = rows[keep], cand[keep]
        # A packing's swap rounds cost about S times its slots; screening far less.
        clock.spend(rows.size * B * S * S)
        packed = _pack_counts(loads[rows], cand, B)
        value = _bin_loads(loads[rows], packed).max(axis=1)
        # Best candidate per row: sort by (row, value) and take each row's first.
        order = np.lexsort((value, rows))
        first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
        win = first[value[first] < best_max[rows[first]] * (1 - _REL_TOL)]
        x = rows[win]
        best[x], counts[x], best_max[x] = packed[win], cand[win], value[win]
        active = x[best_max[x] > target[x]]
    return best


def exhaustive_counts(
    loads: np.ndarray, phy: np.ndarray, cap: int | None, *, limit: int = 20000, budget: Budget | None = None
) -> np.ndarray:
    """For small layers: every replica-count vector (at most ``limit`` of them) whose lower
    bound beats the current busiest bin is packed, lowest bound first, in batches of
    ``limit`` rows; the best packing wins. ``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` →
    ``[X, B, S]``, never worse per row; returned unchanged when there are too many vectors."""
    X, B, S = phy.shape
    E = loads.shape[1]
    P = B * S
    if comb(P - 1, E - 1) > limit:
        return phy
    hi = P if cap is None else cap
    vectors = count_vectors(E, P, hi)
    best = phy.copy()
    best_max = _bin_loads(loads, best).max(axis=1)
    # Lower bound of each (row, vector): the larger of the mean bin and the largest replica.
    chunk = max(1, (1 << 22) // vectors.size)  # rows per step, keeps [rows, V, E] near 32 MB
    bound = np.concatenate(
        [(loads[i : i + chunk, None, :] / vectors[None, :, :]).max(axis=2) for i in range(0, X, chunk)]
    )
    bound = np.maximum(bound, (loads.sum(axis=1) / B)[:, None])  # [X, V]
    rows, vec = np.nonzero(bound < best_max[:, None] * (1 - _REL_TOL))
    order = np.argsort(bound[rows, vec], kind="stable")
    rows, vec = rows[order], vec[order]
    clock = budget or Budget()
    for start in range(0, rows.size, limit):
        if clock.out():
            break
        r, v = rows[start : start + limit], vec[start : start + limit]
        keep = bound[r, v] < best_max[r] * (1 - _REL_TOL)  # bounds of earlier winners prune more
        r, v = r[keep], v[keep]
        if r.size == 0:
            break
        clock.spend(r.size * P * S)
        packed = _pack_counts(loads[r], vectors[v], B)
        value = _bin_loads(loads[r], packed).max(axis=1)
        order = np.lexsort((value, r))
        first = order[np.r_[True, r[order][1:] != r[order][:-1]]]
        win = first[value[first] < best_max[r[first]] * (1 - _REL_TOL)]
        best[r[win]], best_max[r[win]] = packed[win], value[win]
    return best


def refine_thorough(
    loads: np.ndarray,
    phy: np.ndarray,
    cap: int | None,
    budget: Budget | None = None,
    target: np.ndarray | None = None,
    wide: bool = False,
) -> np.ndarray:
    """The search after the first plan: count moves with a wider donor search, every count
    vector for small layers (:func:`exhaustive_counts`), then :func:`repack_search`, rows
    stopping at ``target`` ``[X]`` and all of it when ``budget`` is spent (``None``: run to the
    end). ``wide`` searches more candidates per step. ``loads`` ``[X, E]``, ``phy``
    ``[X, B, S]`` → ``[X, B, S]``, never worse per row; deterministic unless ``budget`` has a
    deadline."""
    budget = budget or Budget()
    _, B, S = phy.shape
    if S == 2 and B > 1:
        phy = _pair_start(loads, phy, cap, budget)
    # Count moves get three quarters of what is left, leaving room for a repack step.
    # Two slots per bin: the wide search's donors and steps at every effort, the pairing screen
    # keeps them cheap (v3-512 zipf 1.0: 1.0209 -> 1.0196 for the same work).
    donors = 64 if wide or S == 2 else 32
    first = budget.share(0.75)
    cand = refine_counts(loads, phy, cap, iterations=32, donors=donors, target=target, budget=first)
    budget.spend(first.spent)
    budget.timed_out |= first.timed_out
    better = _bin_loads(loads, cand).max(axis=1) < _bin_loads(loads, phy).max(axis=1)
    start = np.where(better[:, None, None], cand, phy)
    start = exhaustive_counts(loads, start, cap, budget=budget)
    # Two slots per bin: candidates are ranked by a sort (``paired_max``) and only the best few
    # packed, so the wide batch costs little more (v3-512 zipf 1.0: 1.023 -> 1.021, +6 % work).
    batch = 3072 if wide or S == 2 else 768
    return repack_search(
        loads, start, cap, iterations=24 if wide or S == 2 else 12, batch=batch, target=target, budget=budget
    )


def _pair_start(loads: np.ndarray, phy: np.ndarray, cap: int | None, budget: Budget) -> np.ndarray:
    """Two slots per bin: counts built for a target busiest bin (``eplb.pairing``), packed,
    where they beat ``phy`` ``[X, B, 2]``; the search goes on from the better of the two."""
    X, B, S = phy.shape
    now = _bin_loads(loads, phy).max(axis=1)
    # Each bisection step builds counts for one target: about one pass over the slots.
    budget.spend(X * _PAIR_STEPS * B * S)
    counts = pair_counts(loads, B, cap, loads.sum(axis=1) / B, now, steps=_PAIR_STEPS)
    rows = np.flatnonzero(counts.sum(axis=1) > 0)
    if rows.size == 0:
        return phy
    packed = _pack_counts(loads[rows], counts[rows], B)
    win = _bin_loads(loads[rows], packed).max(axis=1) < now[rows] * (1 - _REL_TOL)
    out = phy.copy()
    out[rows[win]] = packed[win]
    return out


# Bisection steps of the two-slot count construction: 2**-14 of the gap to the mean.
_PAIR_STEPS = 14


def separate_hot(
    loads: np.ndarray,
    phy: np.ndarray,
    cap: int | None,
    *,
    ks: tuple[int, ...] = (2, 3),
    refine: int = 8,
    target: np.ndarray | None = None,
    guided: bool = True,
    budget: Budget | None = None,
) -> np.ndarray:
    """``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` → ``[X, B, S]``, never worse per row.

    Water-filling can give the ``k`` busiest experts more replicas together than there are
    bins, and then some bin holds two of them: with few spare slots that bin decides the
    row. For ``k`` in ``ks``, where that happens, the ``k`` experts instead share ``B``
    replicas (water-filled among them, so no bin needs two), the other experts water-fill what
    is left, the counts are packed from scratch and improved by ``refine`` count moves; the
    better packing wins. With ``guided``, rows whose busiest bin holds one of the three
    busiest experts also try :func:`_guided_counts`. Rows whose busiest bin is at most
    ``target`` (``[X]``, e.g. what the layer carries elsewhere anyway) are left alone.
    """
    X, B, S = phy.shape
    E = loads.shape[1]
    P = B * S
    counts = _counts(phy, E)
    order = np.argsort(-loads, axis=1, kind="stable")
    binl = _bin_loads(loads, phy)
    busiest = phy[np.arange(X), binl.argmax(axis=1)]  # [X, S]
    # Only rows above their mean bin (and target) whose busiest bin holds two of the k:
    # elsewhere the sharing costs nothing.
    above = binl.max(axis=1) > binl.mean(axis=1) * (1 + _GOOD_ENOUGH)
    if target is not None:
        above &= binl.max(axis=1) > target
    rows_all, cands = [], []
    for k in ks:
        if k >= E or k > B or P - B < E - k or (cap is not None and cap * (E - k) < P - B):
            continue  # no valid counts: too few bins for k, or for the others' slots
        top = order[:, :k]
        shared = (busiest[:, :, None] == top[:, None, :]).any(axis=1).sum(axis=1) >= 2
        rows = np.flatnonzero(above & shared & (np.take_along_axis(counts, top, axis=1).sum(axis=1) > B))
        if rows.size == 0:
            continue
        rest = order[rows, k:]
        hot = waterfill(np.take_along_axis(loads[rows], top[rows], axis=1), B, None if cap is None else min(cap, B))
        cold = waterfill(np.take_along_axis(loads[rows], rest, axis=1), P - B, cap)
        cand = np.zeros((rows.size, E), dtype=np.int64)
        np.put_along_axis(cand, top[rows], hot, axis=1)
        np.put_along_axis(cand, rest, cold, axis=1)
        rows_all.append(rows)
        cands.append(cand)
    # And the counts of the three busiest experts that minimise a pigeonhole bound (what a bin
    # shared by some of them must carry, the row's mean bin), the rest water-filled.
    k = 3
    # The grid has up to B ** k count vectors; node-sized rows only.
    if guided and k < E and k <= B and B**k <= _GUIDED_GRID:
        hot_on = (busiest[:, :, None] == order[:, None, :k]).any(axis=(1, 2))
        rows = np.flatnonzero(above & hot_on)
        guess = _guided_counts(loads[rows], order[rows], B, S, cap, k) if rows.size else None
        if guess is not None:
            bound, cand = guess
            # Worth a re-pack only where the busiest bin is well above what those counts allow
            # and they differ from the current ones.
            differs = (
                np.take_along_axis(cand, order[rows, :k], axis=1)
                != np.take_along_axis(counts[rows], order[rows, :k], axis=1)
            ).any(axis=1)
            ok = differs & (binl.max(axis=1)[rows] > bound * (1 + _GUIDED_MARGIN))
            rows_all.append(rows[ok])
            cands.append(cand[ok])
    if not rows_all:
        return phy
    rows, cand = np.concatenate(rows_all), np.concatenate(cands)
    if rows.size == 0:
        return phy
    packed = _pack_counts(loads[rows], cand, B)
    # Water-filling the rest can still give a warm expert more replicas than the light bins
    # can take; count moves (both ways) settle that.
    packed = refine_counts(loads[rows], packed, cap, iterations=refine, reverse=True, budget=budget)
    value = _bin_loads(loads[rows], packed).max(axis=1)
    best, best_max = phy.copy(), binl.max(axis=1)
    for i in np.argsort(value, kind="stable"):  # a few rows; the best candidate per row wins
        if value[i] < best_max[rows[i]] * (1 - _REL_TOL):
            best[rows[i]], best_max[rows[i]] = packed[i], value[i]
    return best


def _guided_counts(
    loads: np.ndarray, order: np.ndarray, B: int, S: int, cap: int | None, k: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """``loads`` ``[R, E]``, ``order`` ``[R, E]`` experts by load (busiest first) → ``(bound [R],
    counts [R, E])``: the busiest ``k`` experts get the counts (each at most ``B``) whose
    pigeonhole bound is least — the largest of the row's mean bin, their largest replica and,
    for every subset whose counts exceed ``(|T| - 1) B``, the sum of its replicas, which then
    share a bin — and the others water-fill the remaining slots. ``None`` when no count vector
    leaves the others a slot each."""
    R, E = loads.shape
    P = B * S
    hi = B if cap is None else min(cap, B)
    grid = np.stack(np.meshgrid(*[np.arange(1, hi + 1)] * k, indexing="ij"), axis=-1).reshape(-1, k)
    left = P - grid.sum(axis=1)
    grid = grid[(left >= E - k) & ((cap is None) | (left <= (cap or 0) * (E - k)))]
    if len(grid) == 0:
        return None
    top = np.take_along_axis(loads, order[:, :k], axis=1)  # [R, k]
    bound = np.maximum(pigeonhole_bound(top, grid, B), (loads.sum(axis=1) / B)[:, None])
    chosen = grid[bound.argmin(axis=1)]  # [R, k]
    out = np.zeros((R, E), dtype=np.int64)
    np.put_along_axis(out, order[:, :k], chosen, axis=1)
    rest = order[:, k:]
    # Rows differ in how many slots are left: water-fill each group of equal count at once.
    remaining = P - chosen.sum(axis=1)
    for n_left in np.unique(remaining):
        rows = np.flatnonzero(remaining == n_left)
        sub = out[rows]
        np.put_along_axis(
            sub, rest[rows], waterfill(np.take_along_axis(loads[rows], rest[rows], axis=1), int(n_left), cap), axis=1
        )
        out[rows] = sub
    return bound[np.arange(R), bound.argmin(axis=1)], out


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
