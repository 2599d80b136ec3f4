"""Packing weighted items into bins of equal item count, minimising the heaviest bin.

``pack`` deals items and improves the deal by swaps; it is used twice by the first plan:
expert groups onto nodes, replicas onto gpus. On the ``[rows, bins, slots]`` layout
(``eplb.layout``), with counts fixed: ``pack_counts`` packs replica counts from scratch,
``swap_improve`` swaps slots between bins (count moves and re-plans use it).
"""

from __future__ import annotations

import numpy as np

from ..bounds import item_bound
from ..budget import Clock
from ..layout import GOOD_ENOUGH, REL_TOL, replica_counts, slot_sums, stable_argsort, take_rows

__all__ = [
    "WIDE_SPREAD",
    "pack",
    "swap_partners",
    "packed_loads",
    "improve",
    "swap_improve",
    "pack_counts",
    "descending_order",
]

# Partner bins the heaviest bin tries when the paired round finds nothing.
_WIDE = 16
# ... and the bins holding the smallest items it also tries.
_SMALL = 8
# Best-scoring swaps per heavy bin checked for key clashes.
_CANDIDATES = 4
# Improvement rounds a layer may go without lowering its heaviest bin before it stops.
_PATIENCE = 4
# Light bins each heavy bin chooses among in the first plan's paired rounds (``pack(spread=)``):
# at v3-prefill lognormal 1.0 the swaps end in 9 rounds instead of 19, and at 64 gpus the plan
# is better (v3-64 group-limited 1.0332 -> 1.0134), since the heaviest bin rarely finds its swap
# with the one light bin it is paired with. The search's re-packs keep one (``pack_counts``).
WIDE_SPREAD = 8
# ... but only in rows whose heaviest item is at most this share of their mean bin. Heavier
# items leave the other slots of their bin little room, and count moves decide such rows
# (zipf 1.5: a replica of 0.68-0.76 mean gpus); there the flatter top of the wider rounds left
# the count moves less to gain (v3-prefill zipf 1.5 fast 1.0227 -> 1.0313, v3-64's default
# 1.0051 -> 1.0067).
_WIDE_ITEM = 2 / 3


def pack(
    weights: np.ndarray,
    num_bins: int,
    keys: np.ndarray | None = None,
    *,
    max_rounds: int = 32,
    pairs: int = 8,
    floor: np.ndarray | None = None,
    spread: int = 1,
) -> np.ndarray:
    """``weights``: ``[X, n]`` → int64 ``[X, num_bins, n // num_bins]``: the items in each bin.

    1. Deal: items in descending weight (ties keep input order) form rounds of ``num_bins``;
       rounds merge by balanced largest differencing (see ``_deal``). Then no bin keeps two
       items with the same ``keys`` value (``[X, n]``, e.g. the expert of a replica) where a
       swap with another bin avoids it.
    2. Improve: up to ``max_rounds`` rounds in which the ``pairs`` heaviest bins are paired with
       the lightest (i-th heaviest with i-th lightest) and each pair makes the one item swap
       that most lowers its heavier bin; with ``spread`` > 1 each heavy bin chooses among that
       many light bins (the i-th heaviest among the i-th, (i + pairs)-th, ... lightest) where
       there are bins enough, in rows whose heaviest item is at most 2/3 of their mean bin.
       A layer where no pair can improve tries its heaviest
       bin against the 16 lightest bins and the 8 holding the smallest items. Keys stay distinct per bin. A layer stops after
       a few rounds without lowering its heaviest bin, or once its heaviest bin is within
       0.1 % of its lower bound or at most ``floor`` (``[X]``, e.g. what a row's layer must
       carry elsewhere anyway). Deterministic.
    """
    weights = np.asarray(weights, dtype=np.float64)
    rows, n = weights.shape
    if n % num_bins:
        raise ValueError(f"{n} items cannot fill {num_bins} bins equally")
    per_bin = n // num_bins
    distinct = keys is None
    if keys is None:
        keys = np.broadcast_to(np.arange(n), (rows, n))
    order = descending_order(weights)
    assign = _deal(weights, keys, order, num_bins, per_bin)
    # Distinct keys never clash. And two items per bin dealt without clashes are the heaviest
    # item paired with the lightest, the i-th with the i-th, where no swap between two bins
    # lowers the heavier (as groups onto nodes at v3-prefill: 8 groups, 4 nodes).
    if per_bin > 1 and not distinct:
        _repair(weights, keys, assign)
    if per_bin > 1 and num_bins > 1 and not (distinct and per_bin == 2):
        # Rows already within GOOD_ENOUGH of their bound (mean bin, heaviest item) skip the swaps.
        bound = item_bound(weights, num_bins) * (1 + GOOD_ENOUGH)
        target = bound if floor is None else np.maximum(bound, floor)
        narrow = None if spread == 1 else weights.max(axis=1) > weights.sum(axis=1) / num_bins * _WIDE_ITEM
        if narrow is None or narrow.all():
            _improve(weights, keys, assign, max_rounds, pairs, target)
        elif not narrow.any():
            _improve(weights, keys, assign, max_rounds, pairs, target, spread)
        else:  # rows are improved one by one, so each group on its own gives the same
            for part, width in ((np.flatnonzero(~narrow), spread), (np.flatnonzero(narrow), 1)):
                sub = assign[part]
                _improve(weights[part], keys[part], sub, max_rounds, pairs, target[part], width)
                assign[part] = sub
    return assign


def swap_partners(num_bins: int) -> int:
    """The most partner bins one heavy bin's swap grid spans in ``swap_improve`` (its wide
    round: the lightest bins and those holding the smallest items; its paired rounds span
    fewer), for ``eplb.limits.plan_bytes``: a row's grid holds ``swap_partners(B) * S * S``
    item pairs."""
    if num_bins < 2:
        return 0
    return min(num_bins - 1, _WIDE) + min(num_bins, _SMALL)


def descending_order(weights: np.ndarray) -> np.ndarray:
    """``weights`` ``[X, n]`` → ``[X, n]``: ``np.argsort(-weights, axis=1, kind="stable")``.

    A stable sort of floats costs four times a quicksort; ties (replicas of one expert) only
    need their indices ascending, which sorting ``run * n + index`` does in one integer sort."""
    X, n = weights.shape
    order = np.argsort(-weights, axis=1)
    srt = take_rows(weights, order)
    run = np.zeros((X, n), dtype=np.int64)
    np.cumsum(srt[:, 1:] != srt[:, :-1], axis=1, out=run[:, 1:])
    run *= n
    run += order
    run.sort(axis=1)
    run %= n
    return run


def packed_loads(weights: np.ndarray, assign: np.ndarray) -> np.ndarray:
    """``weights`` ``[X, n]``, ``assign`` ``[X, B, k]`` → ``[X, B]`` summed weights."""
    return slot_sums(take_rows(weights, assign))


def _deal(weights: np.ndarray, keys: np.ndarray, order: np.ndarray, num_bins: int, per_bin: int) -> np.ndarray:
    """Balanced largest differencing (Karmarkar-Karp for equal-count bins), vectorised over rows.

    Each round of ``num_bins`` items in weight order is a partial solution; the two partials
    with the largest spread (heaviest minus lightest bin) merge, heaviest bin of one with
    lightest of the other, until one is left. The merges are chosen on the bin sums alone,
    then composed backwards into each item's final bin.
    """
    X, m, S = weights.shape[0], num_bins, per_bin
    n = m * S
    r = np.arange(X)
    rc = r[:, None]
    sums = take_rows(weights, order).reshape(X, S, m)
    col = np.arange(m)
    # Each partial's spread, kept up to date: a merge changes only the merged partial's. A
    # round's items come in descending weight, so its spread is its first minus its last.
    spread = sums[:, :, 0] - sums[:, :, m - 1]
    # Partials as rows of [X * S, m] (and spreads as [X * S]) views: one flat index per access.
    sums2, spread1, rs = sums.reshape(X * S, m), spread.reshape(-1), r * S
    off = rc * m  # row offsets into an [X, m] array
    # The merges are decided on the sums alone; the items follow afterwards (see below).
    steps = []
    for left in range(S, 1, -1):
        # The two largest spreads, ties to the lower partial: a stable descending sort's first two.
        top = np.argsort(-spread[:, :left], axis=1, kind="stable")
        a, b = top[:, 0], top[:, 1]
        ia, ib, il = rs + a, rs + b, rs + (left - 1)
        lo, hi, last = np.minimum(a, b), np.maximum(a, b), left - 1
        ilo, ihi = np.minimum(ia, ib), np.maximum(ia, ib)
        sa, sb = sums2[ia], sums2[ib]
        oa = np.argsort(-sa, axis=1, kind="stable")
        ob = stable_argsort(sb)
        new_sum = np.take(sa, oa + off) + np.take(sb, ob + off)
        steps.append((a, b, lo, hi, last, oa, ob))
        sums2[ihi] = sums2[il]
        sums2[ilo] = new_sum
        spread1[ihi] = spread1[il]
        spread1[ilo] = new_sum.max(axis=1) - new_sum.min(axis=1)
    # A code is partial * m + bin. Compose the merges backwards: g[x, code] is the final bin
    # of a code before a merge, from one partial whose bins are final. The tables shrink with
    # the partials, so this costs about half of relabelling every item at every merge.
    # Tables hold flat indices into the previous g (row offsets included), so that each step is
    # flat takes and puts: indexing with a broadcast row index costs several times more.
    g = np.broadcast_to(col, (X, m)).reshape(-1)
    for a, b, lo, hi, last, oa, ob in reversed(steps):
        width = (last + 1) * m
        prev = rc * (last * m)  # row offsets into g, which has `last` partials
        table = prev + np.arange(width)
        flat = table.reshape(-1)
        here = rc * width
        # The last partial moves into the freed slot hi; a and b merge into slot lo, the j-th
        # heaviest bin of a with the j-th lightest of b (written after, so they win if last
        # is a or b).
        flat[here + (last * m + col)] = prev + hi[:, None] * m + col
        dest = prev + lo[:, None] * m + col
        flat[here + a[:, None] * m + oa] = dest
        flat[here + b[:, None] * m + ob] = dest
        g = np.take(g, table).reshape(-1)
    # g[x, p]: the bin of the item at position p of the weight order; the smallest integer
    # type sorts by radix.
    code = np.empty(X * n, dtype=np.min_scalar_type(m))
    code[order + rc * n] = g.reshape(X, n)
    code = code.reshape(X, n)
    return np.argsort(code, axis=1, kind="stable").reshape(X, m, S)


def _repair(weights: np.ndarray, keys: np.ndarray, assign: np.ndarray) -> None:
    """Swap away equal keys sharing a bin, one clash per row per pass, all rows at once.

    Each clash swaps with the item of closest weight whose bin lacks the clashing key and
    whose key the clashing bin lacks. Rows where no such item exists keep the clash.
    """
    X, B, S = assign.shape
    rows = np.arange(X)
    # (bin, key) codes: a row has a clash iff two of its codes are equal.
    span = int(keys.max(initial=0)) + 1
    bin_code = (np.arange(B) * span)[:, None]
    for step in range(B * S):
        if rows.size == 0:
            return
        # The first pass looks at every row: no copies of the whole arrays for it.
        k = take_rows(keys, assign) if step == 0 else take_rows(keys[rows], assign[rows])
        # Few rows clash: find them by sorting codes (a tenth of the pairwise test's time),
        # and locate the clashes in those rows only.
        code = np.sort((k + bin_code).reshape(len(rows), -1), axis=1)
        has = (code[:, 1:] == code[:, :-1]).any(axis=1)
        rows, k = rows[has], k[has]
        if rows.size == 0:
            return
        R = rows.size
        ri = np.arange(R)
        # The first slot (bin-major) whose key an earlier slot of its bin holds: in a stable
        # sort of the codes, every code equal to its predecessor is such a slot.
        flat = (k + bin_code).reshape(R, -1)
        pos = np.argsort(flat, axis=1, kind="stable")
        srt = take_rows(flat, pos)
        b, s = np.divmod(np.where(srt[:, 1:] == srt[:, :-1], pos[:, 1:], B * S).min(axis=1), S)
        e = k[ri, b, s]
        w = take_rows(weights[rows], assign[rows])
        # Partner (q, t): bin q lacks e, and bin b lacks the partner's key.
        ok = ~_any_last(k == e[:, None, None])[:, :, None] & ~_any_last(k[:, :, :, None] == k[ri, b][:, None, None, :])
        cost = np.where(ok, np.abs(w - w[ri, b, s][:, None, None]), np.inf).reshape(R, -1)
        best = cost.argmin(axis=1)
        fixable = np.isfinite(cost[ri, best])
        q, t = np.divmod(best[fixable], S)
        x, bb, ss = rows[fixable], b[fixable], s[fixable]
        tmp = assign[x, bb, ss].copy()
        assign[x, bb, ss] = assign[x, q, t]
        assign[x, q, t] = tmp
        stuck = rows[~fixable]
        if stuck.size:
            _cyclic(weights, keys, assign, stuck)
        rows = x


def _any_last(x: np.ndarray) -> np.ndarray:
    """``x`` ``[..., S]`` bool → ``[...]``: ``x.any(axis=-1)``. Up to 8 slots as that many vector
    ors: a reduction over a short last axis costs a call per element of the others (3000 rows
    of 3 slots: 46 us against 5 us)."""
    S = x.shape[-1]
    if S == 0 or S > 8:
        return x.any(axis=-1)
    out = x[..., 0].copy()
    for j in range(1, S):
        out |= x[..., j]
    return out


def _cyclic(weights: np.ndarray, keys: np.ndarray, assign: np.ndarray, rows: np.ndarray) -> None:
    """Rows where no single swap removes a clash: when no key has more items than there are
    bins, deal the items grouped by key round the bins (a run of at most B items lands on B
    distinct bins); the swap step that follows restores the balance. Such rows are rare."""
    X, B, S = assign.shape
    for x in rows:
        if np.bincount(keys[x]).max() <= B:
            order = np.lexsort((-weights[x], keys[x]))
            assign[x] = order.reshape(S, B).T


def improve(
    weights: np.ndarray,
    keys: np.ndarray,
    assign: np.ndarray,
    *,
    max_rounds: int = 32,
    pairs: int = 8,
    target: np.ndarray | None = None,
    clock: Clock | None = None,
) -> None:
    """Lower the heaviest bin of an existing packing by item swaps, in place.

    ``weights``, ``keys``: ``[X, n]``; ``assign``: ``[X, B, k]`` item indices. A row stops as
    soon as its heaviest bin is at most ``target[row]`` (``[X]``), so a re-plan makes only the
    swaps it needs; every row stops between rounds when ``clock`` is out.
    """
    _improve(weights, keys, assign, max_rounds, pairs, target, clock=clock)


def _improve(
    weights: np.ndarray,
    keys: np.ndarray,
    assign: np.ndarray,
    max_rounds: int,
    pairs: int,
    target: np.ndarray | None = None,
    spread: int = 1,
    clock: Clock | None = None,
) -> None:
    rows, num_bins, per_bin = assign.shape
    if num_bins < 2:
        return  # one bin (e.g. a node of one gpu): nothing to swap with
    # Only the heaviest bins decide the objective; pairing a few of them is most of the gain.
    half = min(num_bins // 2, pairs)
    # Light bins each heavy bin may swap with, disjoint between heavy bins so that a round's
    # swaps never touch one bin twice: heavy bin i takes the i-th, (i + half)-th, ... lightest.
    spread = max(1, min(spread, (num_bins - half) // half))
    light = (np.arange(half)[:, None] + half * np.arange(spread)).reshape(-1)
    w = take_rows(weights, assign)  # [X, B, S] kept in step with assign
    k = take_rows(keys, assign)
    wide = min(num_bins - 1, _WIDE)
    active = np.arange(rows)
    idle = np.zeros(rows, dtype=np.int64)  # rounds since the heaviest bin last got lighter
    # Bin loads of the active rows, summed once per round: the sums after a round's swaps are
    # both what tells whether the heaviest bin dropped and the next round's loads.
    load = slot_sums(w)
    for _ in range(max_rounds):
        if target is not None:
            keep = load.max(axis=1) > target[active]
            active, load = active[keep], load[keep]
        if active.size == 0 or (clock is not None and clock.out()):
            return
        srt = stable_argsort(load)
        # Cheap round: i-th heaviest with i-th lightest, all pairs at once.
        heavy, partner = srt[:, ::-1][:, :half], srt[:, light].reshape(-1, half, spread)
        # Bins already at or below the target are left alone: swaps there only cost moves.
        floor = None if target is None else target[active]
        found = _swap_best(assign, w, k, load, active, heavy, partner, floor)
        stalled = ~found.any(axis=1)
        if stalled.any():
            # Wider round for layers the cheap one left: the heaviest bin against the lightest
            # bins and against the bins holding the smallest items (a heavy bin often needs a
            # smaller partner for its big item, wherever that partner sits).
            st = np.flatnonzero(stalled)
            top = srt[st, -1:]
            ws = w[active[st]]
            # Two slots: one vector minimum, not a length-2 reduction per bin.
            smallest = np.minimum(ws[..., 0], ws[..., 1]) if per_bin == 2 else ws.min(axis=2)
            small = stable_argsort(smallest)[:, :_SMALL]
            part = np.concatenate([srt[st, :wide], small], axis=1)[:, None, :]
            again = _swap_best(assign, w, k, load[st], active[st], top, part, None if floor is None else floor[st])
            stalled[st] = ~again[:, 0]
        # A layer goes on while its heaviest bin got lighter within the last few rounds (ties
        # at the top need several swaps before the maximum moves).
        after = slot_sums(w[active])
        dropped = after.max(axis=1) < load.max(axis=1)
        idle[active] = np.where(dropped, 0, idle[active] + 1)
        keep = ~stalled & (idle[active] < _PATIENCE)
        active, load = active[keep], after[keep]


def _swap_best(
    assign: np.ndarray,
    w: np.ndarray,
    k: np.ndarray,
    load: np.ndarray,
    rows: np.ndarray,
    heavy: np.ndarray,
    partners: np.ndarray,
    floor: np.ndarray | None = None,
) -> np.ndarray:
    """Make, for each heavy bin, the item swap with one of its partner bins that most lowers it.

    ``rows``: ``[A]`` rows of ``assign``/``w``/``k`` (``[X, B, S]``, updated in place);
    ``load``: ``[A, B]``; ``heavy``: ``[A, H]`` distinct bins; ``partners``: ``[A, H, C]`` bins,
    each partner used by at most one heavy bin; heavy bins not above ``floor`` ``[A]`` are
    skipped. Returns ``[A, H]``: whether a swap was made.
    """
    per_bin = w.shape[2]
    A, H = heavy.shape
    B, C = w.shape[1], partners.shape[2]
    # The heavy bin and its partners' loads in one gather: [A, H, 1 + C].
    both = np.concatenate([heavy[:, :, None], partners], axis=2)
    lb = take_rows(load, both)
    # Bins as flat indices into [X * B] (rows of [X * B, S] views): every gather below is one
    # flat index array (the fast path).
    fb = both + (rows * B)[:, None, None]
    # Only (row, heavy bin) pairs above the floor can swap (a re-plan's targets leave few):
    # the item grids are built for those pairs alone, flat indices into [A, H].
    pair = None
    if floor is not None:
        above = lb[:, :, 0] > floor[:, None]
        if not above.all():
            pair = np.flatnonzero(above)
            if pair.size == 0:
                return above
            lb, fb = lb.reshape(A * H, 1 + C)[pair], fb.reshape(A * H, 1 + C)[pair]
    lb, fb = lb.reshape(-1, 1 + C), fb.reshape(-1, 1 + C)
    P = lb.shape[0]
    ar = np.arange(P)
    w2, k2 = w.reshape(-1, per_bin), k.reshape(-1, per_bin)
    fh, fp = fb[:, 0], fb[:, 1:]
    wh, kh = w2[fh], k2[fh]  # [P, S]
    wp = w2[fp]  # [P, C, S]
    lh = lb[:, :1, None, None]
    lp = lb[:, None, 1:, None]
    # Swapping items i (heavy bin) and j (partner) moves d = w_i - w_j; the pair's new maximum
    # is (lh + lp) / 2 + |d - (lh - lp) / 2|, an improvement iff that deviation is below
    # (lh - lp) / 2. So score by deviation plus lp / 2 (lh is fixed per heavy bin).
    mid = (lh - lp) * 0.5
    half = mid - REL_TOL * lh
    dev = wh[:, :, None, None] - wp[:, None, :, :]  # [P, S(heavy item), C, S(partner item)]
    dev -= mid
    np.abs(dev, out=dev)
    # In place, not np.where over three broadcast operands (three times slower): the same
    # values, dev + lp / 2 where dev < half, else inf.
    bad = dev >= half
    dev += lp * 0.5
    dev[bad] = np.inf
    score = dev.reshape(P, -1)
    # Check the best swap for a key clash; only pairs where it clashes look further.
    best = score.argmin(axis=1)
    # The least score is the one at the argmin: a gather, not a second reduction.
    found = np.isfinite(np.take(score.reshape(-1), ar * score.shape[1] + best))
    i, c, j = np.unravel_index(best, (per_bin, C, per_bin))
    fq = fp.reshape(-1)[ar * C + c]  # the chosen partner bins
    kp = k2[fq]  # [P, S]: their keys
    key_h = kh.reshape(-1)[ar * per_bin + i]
    key_p = kp.reshape(-1)[ar * per_bin + j]
    clash = found & (_any_last(kp == key_h[:, None]) | _any_last(kh == key_p[:, None]))
    if clash.any():
        cp = np.flatnonzero(clash)
        found[cp], best[cp] = _best_free(score[cp], kh[cp], k2[fp[cp]])
        i, c, j = np.unravel_index(best, (per_bin, C, per_bin))
        fq = fp.reshape(-1)[ar * C + c]
    if found.any():
        sel = np.flatnonzero(found)
        # Flat positions of the two items: distinct bins, each bin in at most one swap.
        ph_ = fh[sel] * per_bin + i[sel]
        pp_ = fq[sel] * per_bin + j[sel]
        for arr in (assign, w, k):
            if arr.flags.c_contiguous:
                flat = arr.reshape(-1)  # a view
                tmp = flat[ph_]
                flat[ph_] = flat[pp_]
                flat[pp_] = tmp
            else:  # a caller's non-contiguous assign
                x, bh = np.divmod(fh[sel], B)
                bp = fq[sel] % B
                tmp = arr[x, bh, i[sel]].copy()
                arr[x, bh, i[sel]] = arr[x, bp, j[sel]]
                arr[x, bp, j[sel]] = tmp
    if pair is None:
        return found.reshape(A, H)
    hit = np.zeros(A * H, dtype=bool)
    hit[pair] = found
    return hit.reshape(A, H)


def _best_free(score: np.ndarray, kh: np.ndarray, kp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``score`` ``[Q, S * C * S]`` swap scores (heavy item, partner bin, partner item), ``kh``
    ``[Q, S]`` heavy bin keys, ``kp`` ``[Q, C, S]`` partner bin keys → whether a swap is taken
    ``[Q]`` and which ``[Q]``: the best swap that leaves no bin two equal keys, taken only if it
    is among the ``_CANDIDATES`` best by score (ties by position), the swaps looked at one by one.
    """
    Q = kh.shape[0]
    # Heavy item i into partner bin c clashes when c holds its key; partner item j into the heavy
    # bin when the heavy bin holds j's key.
    into_p = (kh[:, :, None, None] == kp[:, None, :, :]).any(axis=3)  # [Q, S, C]
    into_h = (kp[:, :, :, None] == kh[:, None, None, :]).any(axis=3)  # [Q, C, S]
    clash = (into_p[:, :, :, None] | into_h[:, None, :, :]).reshape(Q, -1)
    free = np.where(clash, np.inf, score)
    best = free.argmin(axis=1)
    val = free[np.arange(Q), best]
    pos = np.arange(score.shape[1])
    ahead = ((score < val[:, None]) | ((score == val[:, None]) & (pos < best[:, None]))).sum(axis=1)
    return np.isfinite(val) & (ahead < _CANDIDATES), best


def swap_improve(
    loads: np.ndarray,
    phy: np.ndarray,
    rows: np.ndarray,
    rounds: int,
    target: np.ndarray | None = None,
    clock: Clock | None = None,
) -> None:
    """Swap slots between bins of ``phy`` ``[X, B, S]`` (rows ``rows``, in place) to lower each
    row's busiest bin, stopping at ``target`` ``[X]`` (every row once ``clock`` is out); counts
    stay as they are."""
    sub = phy[rows]
    A, B, S = sub.shape
    cnt = replica_counts(sub, loads.shape[1])
    keys = sub.reshape(A, B * S)
    weights = take_rows(loads[rows] / cnt, keys)
    assign = np.broadcast_to(np.arange(B * S).reshape(B, S), (A, B, S)).copy()
    improve(weights, keys, assign, max_rounds=rounds, target=None if target is None else target[rows], clock=clock)
    phy[rows] = take_rows(keys, assign)


# Under a deadline, candidate rows are packed in pieces of about this many work units
# (eplb.budget; a row of ``B`` bins of ``S`` slots costs ``B * S * S``), the clock checked
# between them: a whole batch is one step no prediction bounds, a piece a few tens of
# milliseconds at the standard scales.
PIECE_UNITS = 1 << 17


def pack_counts_in_time(
    loads: np.ndarray, counts: np.ndarray, bins: int, clock: Clock | None, max_rounds: int = 16
) -> np.ndarray:
    """``pack_counts`` of the rows in order, in pieces of ``PIECE_UNITS`` with ``clock`` checked
    between them: ``[n, B, S]`` for the first ``n`` rows of ``loads``, ``counts`` ``[X, E]``,
    all of them without a clock or while it is not out (rows are packed independently, so a
    row's packing does not depend on the pieces)."""
    X = counts.shape[0]
    if clock is None or X == 0:
        return pack_counts(loads, counts, bins, max_rounds)
    S = int(counts[0].sum()) // bins
    piece = max(1, PIECE_UNITS // (bins * S * S))
    parts = [pack_counts(loads[:piece], counts[:piece], bins, max_rounds)]
    for a in range(piece, X, piece):
        if clock.out():
            break
        parts.append(pack_counts(loads[a : a + piece], counts[a : a + piece], bins, max_rounds))
    return np.concatenate(parts)


def pack_counts(loads: np.ndarray, counts: np.ndarray, bins: int, max_rounds: int = 16) -> np.ndarray:
    """``loads``, ``counts``: ``[X, E]`` → ``[X, B, S]`` experts per bin, freshly packed."""
    X, E = loads.shape
    ids = np.repeat(np.tile(np.arange(E), X), counts.ravel()).reshape(X, -1)
    w = take_rows(loads / counts, ids)
    return take_rows(ids, pack(w, bins, ids, max_rounds=max_rounds))
