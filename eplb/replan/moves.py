"""Repair moves for re-planning: bins above a target brought under it for few rewritten slots.

Ejection chains (``chain_improve``) fix ``k`` bins with ``k + 1`` slots. With the replica
counts fixed, every bin above the target needs one of its slots rewritten,
and the load it sheds must land on bins below the target, each of which then needs a slot
rewritten too. A swap pays two slots per bin fixed, a three-slot rotation 1.5. A chain pays
``1 + 1/k``: a light bin ``u`` hands its lightest item ``b`` to the first bin above the
target, which hands an item heavier by at least its excess to the second, and so on; the
last hands its item to ``u``. Each bin above the target sheds its excess, and ``u`` takes
the sum of all of them, so a chain runs while that sum fits under ``u``'s room.

Building one is greedy: each next bin is the one (among those above the target and not yet
in the chain) offering the item that sheds its excess with the least to spare, which keeps
the chain low and long. The chain is cut back to its longest prefix whose last item may go
to ``u``.

Rotations (``rotate_improve``) fix two bins with three slots. Count repairs
(``count_repair``) change counts instead: one slot gives an expert that grew another replica,
and every bin holding it sheds at once.
"""

from __future__ import annotations

import numpy as np

from ..budget import Clock
from ..layout import REL_TOL, count_true, replica_counts, slot_sums, take_rows

__all__ = ["chain_improve", "rotate_improve", "count_repair"]


def chain_improve(
    loads: np.ndarray,
    phy: np.ndarray,
    target: np.ndarray,
    rounds: int = 32,
    min_length: int = 2,
    clock: Clock | None = None,
) -> None:
    """``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` (at most one replica of an expert per bin, in
    place), ``target`` ``[X]``: ejection chains that bring bins above the target under it,
    counts unchanged. Each round every row with bins above its target makes one chain of at
    least ``min_length`` bins above it (shorter ones are rotations' and swaps' business),
    starting from its lightest bin (measured: trying the three lightest and keeping the longest
    chain saves nothing); a row stops when it finds none, every row when ``clock`` is out."""
    X, B, S = phy.shape
    if B < 3 or S < 1:
        return
    E = loads.shape[1]
    active = np.arange(X)
    for _ in range(rounds):
        # Each round leaves whole moves behind: a repair stopped by the clock is a candidate.
        if active.size == 0 or (clock is not None and clock.out()):
            return
        sub = phy[active]
        w = take_rows(loads[active] / np.maximum(replica_counts(sub, E), 1), sub)  # [A, B, S]
        load = slot_sums(w)
        excess = load - (target[active] * (1 + REL_TOL))[:, None]
        length, gs_all, ss_all, u, k0 = _chain(w, sub, excess, load.argmin(axis=1))
        made = length >= min_length
        if not made.any():
            return
        # Every chain at once: its bins are distinct and above the target, u below it, so no
        # two writes of a row meet. Each bin takes the item of the step before (the first
        # u's), u the last.
        a = np.flatnonzero(made)
        k = length[a]
        gs, ss = gs_all[a, : k.max()], ss_all[a, : k.max()]  # [M, K]
        items = sub[a[:, None], gs, ss]
        incoming = np.concatenate([sub[a, u[a], k0[a]][:, None], items[:, :-1]], axis=1)
        step = np.arange(gs.shape[1]) < k[:, None]
        rows = np.broadcast_to(active[a][:, None], gs.shape)
        phy[rows[step], gs[step], ss[step]] = incoming[step]
        phy[active[a], u[a], k0[a]] = items[np.arange(a.size), k - 1]
        active = active[made]


def _chain(w: np.ndarray, sub: np.ndarray, excess: np.ndarray, u: np.ndarray) -> tuple[np.ndarray, ...]:
    """One chain per row from bin ``u`` ``[A]`` (weights ``w`` and experts ``sub`` ``[A, B, S]``,
    ``excess`` ``[A, B]`` over the target) → its length ``[A]`` (0: none closes), the bins and
    slots along it ``[A, B]``, ``u`` and the slot of ``u``'s item ``[A]``."""
    A, B, S = w.shape
    ra = np.arange(A)
    room = -excess[ra, u]
    k0 = w[ra, u].argmin(axis=1)
    b_w = w[ra, u, k0]
    cur_w, cur_e = b_w.copy(), sub[ra, u, k0]
    free = excess > 0
    steps_g = np.zeros((A, B), dtype=np.int64)
    steps_s = np.zeros((A, B), dtype=np.int64)
    length = np.zeros(A, dtype=np.int64)
    going = free.any(axis=1) & (room > 0)
    # Only bins above the target can join a chain: each row's, in bin order, padded with bins
    # that cannot (the first least score in this order is the first in the row's).
    F = int(free.sum(axis=1).max(initial=0))
    fb = np.argsort(~free, axis=1, kind="stable")[:, :F]  # [A, F]
    wc, sc = (np.take_along_axis(v, fb[:, :, None], axis=1) for v in (w, sub))  # [A, F, S]
    ec, fr = (np.take_along_axis(v, fb, axis=1) for v in (excess, free))  # [A, F]
    # Staying within u's room does not change along the chain.
    roomy = (wc - b_w[:, None, None]) <= room[:, None, None]
    n = 0
    while n < B:
        # Rows whose chain still grows; the others are done.
        x = np.flatnonzero(going)
        if x.size == 0:
            break
        wx, ex, cw = wc[x], ec[x], cur_w[x]
        # Items that shed the bin's excess, stay within u's room, and whose bin lacks the
        # incoming expert.
        ok = fr[x][:, :, None] & (wx >= cw[:, None, None] + ex[:, :, None])
        ok &= roomy[x]
        # (Which bins hold the incoming expert: a scan of the rows' slots, cheaper than keeping
        # an [A, B, E] presence table for the few experts a chain passes on.)
        ok &= ~(sc[x] == cur_e[x][:, None, None]).any(axis=2)[:, :, None]
        # The item that sheds the excess with the least to spare first: the room below the
        # target is what limits a chain (measured: fewer slots than the lightest item).
        waste = wx - cw[:, None, None] - ex[:, :, None]
        score = np.where(ok, waste - 1e-6 * ex[:, :, None], np.inf).reshape(x.size, -1)
        pick = score.argmin(axis=1)
        found = np.isfinite(score[np.arange(x.size), pick])
        going[x[~found]] = False
        x, (f, s) = x[found], np.divmod(pick[found], S)
        steps_g[x, n], steps_s[x, n] = fb[x, f], s
        cur_w[x], cur_e[x] = wc[x, f, s], sc[x, f, s]
        fr[x, f] = False
        n += 1
        # The chain closes when u may take the last item.
        length[x[~(sub[x, u[x]] == cur_e[x][:, None]).any(axis=1)]] = n
    return length, steps_g, steps_s, u, k0


def count_repair(
    loads: np.ndarray,
    phy: np.ndarray,
    target: np.ndarray,
    cap: int,
    rounds: int = 16,
    gainers: int = 8,
    donors: int = 8,
    min_fixed: int = 1,
    clock: Clock | None = None,
) -> None:
    """``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` (in place), ``target`` ``[X]``: count moves that
    bring bins above the target under it for one rewritten slot each.

    A count move writes a replica of ``h`` over a replica of a donor ``f`` on bin ``q``: every
    bin holding ``h`` sheds ``w_h / (c_h (c_h + 1))`` at once, those holding ``f`` take
    ``w_f / (c_f (c_f - 1))``. When the bins above the target share a hot expert that grew, one
    slot relieves them all; no swap or chain does that. Gainers are the experts with the most
    excess they could relieve, donors those whose bins have the most room for what they would
    take. Each round every row makes the move that leaves the fewest bins above the target
    (then the least excess), if that is at least ``min_fixed`` fewer and the excess drops;
    ``h`` stays within ``cap`` replicas. Every row stops when ``clock`` is out."""
    X, B, S = phy.shape
    E = loads.shape[1]
    if B < 2 or cap < 2:
        return
    active = np.arange(X)
    H, D = min(gainers, E), min(donors, E)
    for _ in range(rounds):
        # Each round leaves whole moves behind: a repair stopped by the clock is a candidate.
        if active.size == 0 or (clock is not None and clock.out()):
            return
        sub = phy[active]
        A = active.size
        ra = np.arange(A)
        lo = loads[active]
        cnt = replica_counts(sub, E)
        w = lo / np.maximum(cnt, 1)
        load = slot_sums(take_rows(w, sub))  # [A, B]
        tgt = (target[active] * (1 + REL_TOL))[:, None]
        excess = np.maximum(load - tgt, 0.0)
        n_over = count_true(excess > 0)
        # A row with fewer than min_fixed bins above the target has no move that counts.
        live = n_over >= min_fixed
        if not live.all():
            active, sub, lo, cnt, w = active[live], sub[live], lo[live], cnt[live], w[live]
            load, tgt, excess, n_over = load[live], tgt[live], excess[live], n_over[live]
            A = active.size
            ra = np.arange(A)
            if A == 0:
                return
        flat = (ra[:, None, None] * E + sub).ravel()  # each slot's (row, expert)
        total = excess.sum(axis=1)
        # Gainers: relief each could give to the bins above the target. Only their slots add
        # anything (elsewhere the excess is zero), so only those go into the sum, in the
        # same order: the same values.
        shed = np.where(cnt < cap, w - lo / (cnt + 1), 0.0)  # [A, E]
        oa, ob = np.nonzero(excess > 0)
        keys = (oa[:, None] * E + sub[oa, ob]).ravel()
        part = np.minimum(excess[oa, ob][:, None], shed.reshape(-1)[keys].reshape(-1, S)).ravel()
        relief = np.bincount(keys, weights=part, minlength=A * E).reshape(A, E)
        gain = _first_smallest(-relief, H)  # [A, H]
        # Donors: replicated experts whose bins would go least above the target.
        take = np.where(cnt >= 2, lo / np.maximum(cnt - 1, 1) - w, 0.0)  # [A, E]
        harm = np.maximum(load[:, :, None] + take_rows(take, sub) - tgt[:, :, None], 0.0)
        harm = np.bincount(flat, weights=harm.ravel(), minlength=A * E).reshape(A, E)
        harm = np.where(cnt >= 2, harm + 1e-9 * take, np.inf)
        don = _first_smallest(harm, D)  # [A, D]
        d_h = take_rows(shed, gain)  # [A, H]
        t_f = take_rows(take, don)  # [A, D]
        t_ok = np.isfinite(take_rows(harm, don))  # fewer than D replicated experts: no donors
        # Which bins hold each gainer and donor: every slot's (row, expert) looked up in a
        # table of the gainers' (donors') ranks, instead of an [A, E, B] table of all experts.
        Hh, Hf = (_holders(flat, ra[:, None] * E + ids, (A, E, B, S)) for ids in (gain, don))  # [A, H | D, B]
        # Before q's own change a move (h, f) changes only the bins holding h (they shed d_h)
        # and those holding f (they take t_f): the excess after it is the current one plus what
        # h's bins change, what f's bins change, and a correction on the few bins holding both.
        # So the [A, H, D, B] grid of every bin's new load is never built.
        t3 = tgt[:, :, None]

        def over(x: np.ndarray) -> np.ndarray:
            return np.maximum(x - t3, 0.0)

        lb = load[:, None, :]
        shed_h = lb - d_h[:, :, None]  # [A, H, B]
        took_f = lb + t_f[:, :, None]  # [A, D, B]
        tot_h = np.where(Hh, over(shed_h) - over(lb), 0.0).sum(axis=2)  # [A, H]
        cnt_h = count_true(Hh & (shed_h > t3)) - count_true(Hh & (lb > t3))
        tot_f = np.where(Hf, over(took_f) - over(lb), 0.0).sum(axis=2)  # [A, D]
        cnt_f = count_true(Hf & (took_f > t3)) - count_true(Hf & (lb > t3))
        tot = total[:, None, None] + tot_h[:, :, None] + tot_f[:, None, :]  # [A, H, D]
        cnt_over = n_over[:, None, None] + cnt_h[:, :, None] + cnt_f[:, None, :]
        # Each bin q holding a donor ([n] entries, few: few bins hold a given donor), by the
        # gainers [n, H]: whether q holds that gainer too.
        fa, fd, fq = np.nonzero(Hf & t_ok[:, :, None])
        held = Hh[fa, :, fq]  # [n, H]
        # Bins holding both: they shed d_h and take t_f at once.
        bi, ih = np.nonzero(held)
        if bi.size:
            ia, i_d, iq = fa[bi], fd[bi], fq[bi]
            x, tb = load[ia, iq], tgt[ia, 0]
            xh, xf = x - d_h[ia, ih], x + t_f[ia, i_d]
            xb = xh + t_f[ia, i_d]

            def ov(v: np.ndarray) -> np.ndarray:
                return np.maximum(v - tb, 0.0)

            fix = ov(xb) - ov(xh) - ov(xf) + ov(x)
            fix_n = (xb > tb).astype(np.int64) - (xh > tb) - (xf > tb) + (x > tb)
            key = (ia * H + ih) * D + i_d
            tot += np.bincount(key, weights=fix, minlength=A * H * D).reshape(A, H, D)
            cnt_over += np.bincount(key, weights=fix_n, minlength=A * H * D).reshape(A, H, D).astype(np.int64)
        # Moves (h, f, q) that can be made: q holds f and not h. What q's own change does is
        # worked out per entry of the [n, H] grid, its parts per (q, f) and per h first.
        don_n = don[fa, fd]
        can = ~held & (gain[fa] != don_n[:, None]) & (d_h[fa] > 0)
        ci, h_ = np.nonzero(can)
        a_, d_, q_ = fa[ci], fd[ci], fq[ci]
        # At q (holding f, not h) the donor's replica leaves and h's new one arrives; before
        # that q had taken t_f like every bin of f.
        w_h_new = (take_rows(lo, gain) / (take_rows(cnt, gain) + 1))[a_, h_]
        load_q, tgt_q = load[fa, fq], tgt[fa, 0]
        at_q = (load_q - take_rows(w, don)[fa, fd])[ci] + w_h_new
        q_over = np.maximum(at_q - tgt_q[ci], 0.0)
        o_q = np.maximum(load_q + t_f[fa, fd] - tgt_q, 0.0)[ci]
        grid = (a_ * H + h_) * D + d_
        tot_q = tot.reshape(-1)[grid] - o_q + q_over  # with q = that bin
        cnt_q = cnt_over.reshape(-1)[grid] - (o_q > 0) + (q_over > 0)
        good = cnt_q <= (n_over - min_fixed)[a_]
        good &= tot_q < total[a_] * (1 - 1e-9)
        # Per row, so a row's choice never depends on which rows it is planned with: the least
        # score, ties to the first (h, f, q) in grid order. The entries come row by row, so
        # two segment minima do what a sort by (row, score, position) would.
        scale = total[a_] + 1.0
        a_, where_ = a_[good], ((h_ * D + d_) * B + q_)[good]
        value = (cnt_q + tot_q / scale)[good]
        if a_.size == 0:
            return
        starts = np.flatnonzero(np.concatenate(([True], a_[1:] != a_[:-1])))
        least = np.repeat(np.minimum.reduceat(value, starts), np.diff(starts, append=a_.size))
        a = a_[starts]
        best = np.minimum.reduceat(np.where(value == least, where_, H * D * B), starts)
        hi, di, q = np.unravel_index(best, (H, D, B))
        h, f = gain[a, hi], don[a, di]
        slot = (sub[a, q] == f[:, None]).argmax(axis=1)
        phy[active[a], q, slot] = h
        active = active[a]


def _holders(flat: np.ndarray, ids: np.ndarray, shape: tuple[int, int, int, int]) -> np.ndarray:
    """``flat`` ``[A * B * S]`` each slot's ``row * E + expert``, ``ids`` ``[A, K]`` keys of that
    form, distinct within a row, ``shape`` ``(A, E, B, S)`` → ``[A, K, B]`` whether bin ``b`` of
    row ``a`` holds ``ids[a, k]``."""
    A, E, B, S = shape
    K = ids.shape[1]
    rank = np.full(A * E, -1, dtype=np.int64)
    rank[ids] = np.arange(K)
    hit = np.flatnonzero(rank[flat] >= 0)
    out = np.zeros((A, K, B), dtype=bool)
    out[hit // (B * S), rank[flat[hit]], hit // S % B] = True
    return out


def _first_smallest(key: np.ndarray, k: int) -> np.ndarray:
    """``key`` ``[A, E]`` → ``[A, k]``: ``np.argsort(key, axis=1, kind="stable")[:, :k]`` (ties to
    the lower index) without sorting whole rows: the ``k``-th smallest value splits the row,
    the ties at it are taken in index order, and only the ``k`` taken are sorted."""
    A, E = key.shape
    # On short rows one sort costs less than the steps around the partition (measured).
    if k >= E or E <= 128:
        return np.argsort(key, axis=1, kind="stable")[:, :k]
    kth = np.partition(key, k - 1, axis=1)[:, k - 1 : k]
    take = key <= kth
    # Only rows with more ties at the k-th value than places left need them counted off.
    crowded = np.flatnonzero(take.sum(axis=1) > k)
    if crowded.size:
        sub, at = key[crowded], kth[crowded]
        below, tie = sub < at, sub == at
        take[crowded] = below | (tie & (np.cumsum(tie, axis=1) <= k - below.sum(axis=1, keepdims=True)))
    idx = np.nonzero(take)[1]  # k per row, in index order
    # One stable sort by (row, key) for all rows: a sort per row of k costs more.
    rows = np.repeat(np.arange(A), k)
    return idx[np.lexsort((key[rows, idx], rows))].reshape(A, k)


# Cells of one block of rotate_improve's [triples, S, S, S] score grid (float64: 32 MiB). The
# whole grid was 805 MB at 256 slots per gpu; a block gives the same argmin.
_GRID_CELLS = 1 << 22


def _grid_argmin(m1: np.ndarray, m2: np.ndarray, mq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``m1`` ``[T, S, S]`` (axes i, j), ``m2`` ``[T, S, S]`` (j, k), ``mq`` ``[T, S, S]`` (i, k) →
    per triple the first (row-major) argmin over ``[i, j, k]`` of their largest and its value:
    ``np.argmin`` of the whole ``[T, S, S, S]`` grid, made in blocks of at most
    ``_GRID_CELLS`` cells (whole triples, or slabs of ``i`` when one triple is larger). A later
    block takes over only where strictly lower, so ties stay with the first, as argmin's."""
    T, S = m1.shape[0], m1.shape[1]
    cube = S * S * S
    triples = max(1, _GRID_CELLS // max(cube, 1))
    slab = S if cube <= _GRID_CELLS else max(1, _GRID_CELLS // (S * S))
    inner = np.zeros(T, dtype=np.int64)
    value = np.full(T, np.inf)
    for a in range(0, T, triples):
        b = min(a + triples, T)
        rows = np.arange(b - a)
        for i0 in range(0, S, slab):
            i1 = min(i0 + slab, S)
            # Axes: [triple, i (a's slot on h1), j (c's slot on h2), k (b's slot on q)].
            score = np.maximum(m1[a:b, i0:i1, :, None], m2[a:b, None, :, :])
            np.maximum(score, mq[a:b, i0:i1, None, :], out=score)
            score = score.reshape(b - a, -1)
            at = score.argmin(axis=1)
            got = score[rows, at]
            better = (got < value[a:b]) | (i0 == 0)
            inner[a:b] = np.where(better, at + i0 * S * S, inner[a:b])
            value[a:b] = np.where(better, got, value[a:b])
    return inner, value


def rotate_improve(
    loads: np.ndarray,
    phy: np.ndarray,
    target: np.ndarray,
    rounds: int = 32,
    partners: int = 4,
    seconds: int = 4,
    clock: Clock | None = None,
) -> None:
    """Three-slot rotations that bring two bins above ``target`` (``[X]``) under it at once, in
    place on ``phy`` ``[X, B, S]`` (counts unchanged): the heaviest bin ``h1`` hands an item
    ``a`` to a light bin ``q`` (one of the ``partners`` lightest), ``q`` hands ``b`` to another
    bin above the target ``h2`` (one of the ``seconds`` least above it), and ``h2`` hands ``c``
    to ``h1``. Two swaps would rewrite four slots for the same two bins. Each round every row
    with two bins above its target makes the feasible rotation (all three at most the target,
    no expert twice on a bin) that leaves the heaviest of the three lightest; a row stops when
    it has none, every row when ``clock`` is out."""
    X, B, S = phy.shape
    if B < 3 or S < 1:
        return
    E = loads.shape[1]
    Q = min(partners, B - 2)
    H = min(seconds, B - 2)
    active = np.arange(X)
    for _ in range(rounds):
        # Each round leaves whole moves behind: a repair stopped by the clock is a candidate.
        if active.size == 0 or (clock is not None and clock.out()):
            return
        sub = phy[active]
        w = take_rows(loads[active] / replica_counts(sub, E), sub)  # [A, B, S]
        load = slot_sums(w)
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
        in_q = b_k[:, :, None, :] == a_k[:, None, :, None]  # [A, Q, i, k]
        bad_a = in_q.any(axis=3, keepdims=True) & ~in_q
        nq = Lq[:, :, None, None] - b_w[:, :, None, :] + a_w[:, None, :, None]  # [A, Q, i, k]
        mq = np.where((nq <= t4) & ~bad_a, nq, np.inf)
        # A rotation needs a feasible pair on each of the three bins: h2's pairs are scored only
        # for the (row, h2, q) triples where h1 and q have one, and the grid is built only for
        # the triples where some (i, j, k) is feasible on all three bins at once (few: most
        # triples have none, and the float grid costs several times more than this test).
        g1, gq = np.isfinite(m1), np.isfinite(mq)
        pa, ph, pq = np.nonzero(np.any(g1, axis=(2, 3))[:, :, None] & np.any(gq, axis=(2, 3))[:, None, :])
        th, tq = pa * H + ph, pa * Q + pq  # each triple's (row, h2) and (row, q), flat

        def at(v: np.ndarray, i: np.ndarray) -> np.ndarray:
            return v.reshape((-1,) + v.shape[2:])[i]

        c_wt, c_kt, b_wt = at(c_w, th), at(c_k, th), at(b_w, tq)  # [triple, S]
        in_h2 = c_kt[:, :, None] == at(b_k, tq)[:, None, :]  # [triple, j, k]
        bad_b = in_h2.any(axis=1, keepdims=True) & ~in_h2
        n2 = at(L2, th)[:, None, None] - c_wt[:, :, None] + b_wt[:, None, :]
        m2 = np.where((n2 <= tgt[pa][:, None, None]) & ~bad_b, n2, np.inf)
        # The j that would join an h1 slot i to a q slot k, as bits (packed over j, a byte per
        # eight slots): the test is [i, k] per triple.
        j1 = at(np.packbits(g1, axis=3, bitorder="little"), th)  # [triple, i, bytes]
        j2 = np.packbits(np.isfinite(m2), axis=1, bitorder="little")  # [triple, bytes, k]
        hit = j1[:, :, None, 0] & j2[:, None, 0, :]
        for byte in range(1, j1.shape[2]):
            hit |= j1[:, :, None, byte] & j2[:, None, byte, :]
        some = ((hit != 0) & at(gq, tq)).any(axis=(1, 2))
        pa, th, tq, m2 = pa[some], th[some], tq[some], m2[some]
        if pa.size == 0:
            return
        inner, value = _grid_argmin(at(m1, th), m2, at(mq, tq))
        # Per row the least value, ties to the first (h2, q) and then the first slots: what an
        # argmin over the row's whole [H, Q, S, S, S] grid gives. The triples come row by row,
        # so two segment minima do what a sort by (row, value, position) would.
        starts = np.flatnonzero(np.concatenate(([True], pa[1:] != pa[:-1])))
        least = np.repeat(np.minimum.reduceat(value, starts), np.diff(starts, append=pa.size))
        first = np.minimum.reduceat(np.where(value == least, np.arange(pa.size), pa.size), starts)
        x = pa[first]
        hi_, qi = th[first] % H, tq[first] % Q
        i, j, k = np.unravel_index(inner[first], (S, S, S))
        h2, q = h2s[x, hi_], qs[x, qi]
        rows_ = active[x]
        a_e, c_e, b_e = a_k[x, i], c_k[x, hi_, j], b_k[x, qi, k]
        phy[rows_, h1[x], i] = c_e
        phy[rows_, h2, j] = b_e
        phy[rows_, q, k] = a_e
        active = active[x]
