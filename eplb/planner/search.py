"""The anytime search after the first plan: replica counts searched by repacking.

``refine_thorough`` is the search a default plan runs on the rows its first plan left above
their bound: the two-slot pairing start (``eplb.planner.pairing``), count moves with a wide
donor search (``eplb.planner.counts``), every count vector for small rows
(``exhaustive_counts``) and a steepest descent over single count moves, each candidate packed
from scratch (``repack_search``). All of it spends work units (``eplb.budget``), so the same
input gives the same plan on any machine.
"""

from __future__ import annotations

from collections.abc import Callable
from math import comb

import numpy as np

from ..bounds import counts_bound
from ..budget import Budget, Clock
from ..layout import GOOD_ENOUGH, REL_TOL, bin_loads, replica_counts
from .counts import refine_counts
from .excess import target_search
from .packing import pack_counts, pack_counts_in_time
from .pairing import pair_counts, pair_counts_sweep, pair_descent, paired_max
from .replicate import count_vectors

__all__ = ["CHUNK", "refine_thorough", "repack_search", "exhaustive_counts"]

# Layers searched together (eplb.planner.anytime plans in chunks of them). Fixed so that a plan
# does not depend on `workers`: each chunk has its own budget and the same chunks run whichever
# process takes them.
CHUNK = 16

# repack_search with many candidates per row of at least _SCREEN_SLOTS slots screens them
# with a quick packing (_QUICK swap rounds) and packs only each row's best _SCREEN properly;
# small rows are cheap to pack, and there the quick ranking loses the optimum too often.
_SCREEN = 4
_QUICK = 2
_SCREEN_SLOTS = 128

# Share of the search budget the two-slot count descent may use (of what is left).
_POLISH_SHARE = 1.0
# Share of what is left after repack_search for the sweep line (construction and descent).
_SWEEP_SHARE = 0.6
# Share of what is left after the pairing descent for the target search (effort="high"): the
# rest stays for borrowing counts across layers (eplb.planner.borrow), which the zipf rows need
# (v3-512 zipf 1.0 high: 1.0177 with all of it, 1.0155 with half, as without the search).
_TARGET_SHARE = 0.5
# With ``excess`` (rows of a profile of their own, eplb.planner.anytime): the share of what is
# left after the sweep line for the pairing descent; a target search with few candidates per
# step (6 gainers x 8 donors: at this budget more steps of fewer candidates go further) takes
# the rest.
_EXCESS_SHARE = 0.5
_LEAN_GAINERS = 6
_LEAN_DONORS = 8
# Bisection steps of the sweep construction: 2**-10 of the gap between target and busiest bin.
_SWEEP_STEPS = 10


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
    best_max = bin_loads(loads, best).max(axis=1)
    counts = replica_counts(best, E)
    if target is None:
        target = loads.sum(axis=1) / B * (1 + GOOD_ENOUGH)
    active = np.flatnonzero(best_max > target)
    clock = budget or Budget()
    for _ in range(iterations):
        if active.size == 0 or clock.out():
            break
        # A step packs its candidates in one go: hold it to the units left, so a small
        # budget (a re-plan's) is not overrun several times by one step, and to the time left.
        step = clock.fit(batch, B * S * S)
        if clock.timed_out:
            break
        per_row = max(1, step // active.size)
        if E * (E - 1) <= per_row:
            e, f = np.nonzero(~np.eye(E, dtype=bool))
            gain = np.broadcast_to(e, (active.size, e.size))
            give = np.broadcast_to(f, (active.size, f.size))
        else:
            ng = max(1, min(S, int(np.sqrt(per_row))))
            nd = max(1, min(E - 1, per_row // ng))
            load = bin_loads(loads[active], best[active])
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
                rough = pack_counts_in_time(loads[rows], cand, B, clock.clock, max_rounds=_QUICK)
                rows, cand = rows[: len(rough)], cand[: len(rough)]
                quick = bin_loads(loads[rows], rough).max(axis=1)
            order = np.lexsort((quick, rows))
            starts = np.r_[0, np.flatnonzero(rows[order][1:] != rows[order][:-1]) + 1]
            rank = np.arange(order.size) - np.repeat(starts, np.diff(np.r_[starts, order.size]))
            keep = order[rank < _SCREEN]
            # Pairing is one sort (an eighth of a slot's packing work); a quick packing is _QUICK rounds.
            clock.spend(quick.size * B * S * (0.125 if S == 2 else _QUICK))
            rows, cand = rows[keep], cand[keep]
        # A packing's swap rounds cost about S times its slots; screening far less.
        clock.spend(rows.size * B * S * S)
        if screen and S == 2:
            packed, value = _pack_paired(loads, rows, cand, B, quick[keep], best_max[rows] * (1 - REL_TOL), clock.clock)
        else:
            # Under a deadline only the candidates packed in time count.
            packed = pack_counts_in_time(loads[rows], cand, B, clock.clock)
            rows, cand = rows[: len(packed)], cand[: len(packed)]
            value = bin_loads(loads[rows], packed).max(axis=1)
        # Best candidate per row: sort by (row, value) and take each row's first.
        order = np.lexsort((value, rows))
        first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
        win = first[value[first] < best_max[rows[first]] * (1 - REL_TOL)]
        x = rows[win]
        best[x], counts[x], best_max[x] = packed[win], cand[win], value[win]
        active = x[best_max[x] > target[x]]
    return best


def _pack_paired(
    loads: np.ndarray,
    rows: np.ndarray,
    cand: np.ndarray,
    bins: int,
    paired: np.ndarray,
    beat: np.ndarray,
    clock: Clock | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Two slots per bin: the screened candidates ``cand`` ``[K, E]`` of ``rows`` ``[K]`` (each
    row's in ascending ``paired``, their ``paired_max``) → packings ``[K, B, 2]`` and busiest
    bins ``[K]`` where they can matter: a candidate wins only below ``beat`` ``[K]``. A packing
    never beats its pairing (the sorted pairing is the best, in floats too: rounded sums are
    monotone), so rows whose best pairing is not below ``beat`` cannot win and are not packed,
    and a row whose first candidate's packing reaches its pairing has its winner. The
    candidates left unpacked get +inf (and zeros), so every row's pick is the same as with all
    of them packed. The first candidates are packed first, the others only in rows where that
    fails (two replicas of one expert met in the middle). Under ``clock`` only the candidates
    packed in time count (``pack_counts_in_time``); the rest stay at +inf."""
    first = np.r_[True, rows[1:] != rows[:-1]]
    owner = np.cumsum(first) - 1  # each candidate's row among the heads
    head = np.flatnonzero(first)
    hope = paired[head] < beat[head]
    packed = np.zeros((rows.size, bins, 2), dtype=np.int64)
    value = np.full(rows.size, np.inf)
    live = head[hope]
    if live.size == 0:
        return packed, value
    got = pack_counts_in_time(loads[rows[live]], cand[live], bins, clock)
    live = live[: len(got)]
    packed[live] = got
    value[live] = bin_loads(loads[rows[live]], got).max(axis=1)
    # The rows' other candidates, where the first one might win but did not settle it (a head
    # not packed in time settles nothing: its row's others stay unpacked too).
    settled = np.ones(head.size, dtype=bool)
    settled[np.flatnonzero(hope)[: len(got)]] = value[live] <= paired[live]
    rest = np.flatnonzero(~first & ~settled[owner] & (paired < beat))
    if rest.size and (clock is None or not clock.out()):
        got = pack_counts_in_time(loads[rows[rest]], cand[rest], bins, clock)
        rest = rest[: len(got)]
        packed[rest] = got
        value[rest] = bin_loads(loads[rows[rest]], got).max(axis=1)
    return packed, value


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
    best_max = bin_loads(loads, best).max(axis=1)
    bound = counts_bound(loads, vectors, B)  # [X, V]
    rows, vec = np.nonzero(bound < best_max[:, None] * (1 - REL_TOL))
    order = np.argsort(bound[rows, vec], kind="stable")
    rows, vec = rows[order], vec[order]
    clock = budget or Budget()
    start = 0
    while start < rows.size:
        if clock.out():
            break
        # Batches of ``limit``, fewer where the time left pays for fewer (the units are
        # checked between batches only, as they always were).
        size = limit if clock.clock is None else clock.clock.fit(limit, P * S)
        if clock.timed_out:
            break
        r, v = rows[start : start + size], vec[start : start + size]
        start += size
        keep = bound[r, v] < best_max[r] * (1 - REL_TOL)  # bounds of earlier winners prune more
        r, v = r[keep], v[keep]
        if r.size == 0:
            break
        clock.spend(r.size * P * S)
        packed = pack_counts_in_time(loads[r], vectors[v], B, clock.clock)
        r, v = r[: len(packed)], v[: len(packed)]
        value = bin_loads(loads[r], packed).max(axis=1)
        order = np.lexsort((value, r))
        first = order[np.r_[True, r[order][1:] != r[order][:-1]]]
        win = first[value[first] < best_max[r[first]] * (1 - REL_TOL)]
        best[r[win]], best_max[r[win]] = packed[win], value[win]
    return best


def refine_thorough(
    loads: np.ndarray,
    phy: np.ndarray,
    cap: int | None,
    budget: Budget | None = None,
    target: np.ndarray | None = None,
    wide: bool = False,
    excess: bool = False,
) -> np.ndarray:
    """The search after the first plan: count moves with a wider donor search, every count
    vector for small layers (:func:`exhaustive_counts`), then :func:`repack_search`, rows
    stopping at ``target`` ``[X]`` and all of it when ``budget`` is spent (``None``: run to the
    end). ``wide`` searches more candidates per step and, with two slots per bin, ends with a
    target search (``eplb.planner.excess``) on half of what is left; ``excess`` (two slots per
    bin, not ``wide``) hands the last half of the pairing descent's share to a lean target
    search. ``loads`` ``[X, E]``, ``phy``
    ``[X, B, S]`` → ``[X, B, S]``, never worse per row; deterministic unless ``budget`` has a
    deadline."""
    budget = budget or Budget()
    _, B, S = phy.shape
    # The pairing start is one step whatever the units left; only the deadline skips it.
    if S == 2 and B > 1 and not budget.late():
        phy = _pair_start(loads, phy, cap, budget)
    # Count moves get three quarters of what is left, leaving room for a repack step.
    # Two slots per bin: the wide search's donors and steps at every effort, the pairing screen
    # keeps them cheap (v3-512 zipf 1.0: 1.0209 -> 1.0196 for the same work).
    donors = 64 if wide or S == 2 else 32
    first = budget.share(0.75)
    cand = refine_counts(loads, phy, cap, iterations=32, donors=donors, target=target, budget=first)
    budget.spend(first.spent)
    better = bin_loads(loads, cand).max(axis=1) < bin_loads(loads, phy).max(axis=1)
    start = np.where(better[:, None, None], cand, phy)
    start = exhaustive_counts(loads, start, cap, budget=budget)
    # Two slots per bin: candidates are ranked by a sort (``paired_max``) and only the best few
    # packed, so the wide batch costs little more (v3-512 zipf 1.0: 1.023 -> 1.021, +6 % work).
    batch = 3072 if wide or S == 2 else 768
    out = repack_search(
        loads, start, cap, iterations=24 if wide or S == 2 else 12, batch=batch, target=target, budget=budget
    )
    if S == 2 and B > 1 and not budget.out():
        # With what is left, two more lines. Counts of the sweep construction improved by the
        # pairing descent: often better than where the count moves end up (256 experts on 192
        # gpus, zipf 1.0: 1.0527 -> 1.0445, the optimum), sometimes worse, so the better wins
        # per row. Then the pairing descent from the best placement so far.
        stage = budget.share(_SWEEP_SHARE)
        alt, _ = _pair_sweep(loads, phy, cap, stage, target)
        budget.spend(stage.spent)
        win = bin_loads(loads, alt).max(axis=1) < bin_loads(loads, out).max(axis=1) * (1 - REL_TOL)
        out = np.where(win[:, None, None], alt, out)
        if not budget.out():
            if excess and not wide:
                # Rows of a profile of their own: half to the pairing descent, then a lean
                # target search (eplb.planner.excess) from where it stopped. On routing counts
                # with dead experts (shapes_bench, 256 experts on 192 gpus) 1.0405 -> 1.0392 and
                # 1.0408 -> 1.0393; all of it to the target search gains more there but loses
                # up to 0.2 % on 128 experts on 128 gpus.
                stage = budget.share(_EXCESS_SHARE)
                out = _pair_polish(loads, out, cap, stage, target)
                budget.spend(stage.spent)
                out = _pair_target(loads, out, cap, budget, target, lean=True)
            else:
                out = _pair_polish(loads, out, cap, budget, target)
        if wide and not budget.out():
            # Half of what the lines above leave: they stop in local optima of the busiest
            # pair, the excess over a target walks on (``eplb.planner.excess``; 256 experts on
            # 192 gpus with dead experts: 1.0386 -> 1.0340). Not at the default effort: there
            # the hard rows spend the budget before this, and rows that stop early would spend
            # the rest here (several times the time per plan).
            stage = budget.share(_TARGET_SHARE)
            out = _pair_target(loads, out, cap, stage, target)
            budget.spend(stage.spent)
    return out


def _pair_start(loads: np.ndarray, phy: np.ndarray, cap: int | None, budget: Budget) -> np.ndarray:
    """Two slots per bin: counts built for a target busiest bin (``eplb.planner.pairing``), packed,
    where they beat ``phy`` ``[X, B, 2]``; the search goes on from the better of the two."""
    X, B, S = phy.shape
    now = bin_loads(loads, phy).max(axis=1)
    # Each bisection step builds counts for one target: about one pass over the slots.
    budget.spend(X * _PAIR_STEPS * B * S)
    counts = pair_counts(loads, B, cap, loads.sum(axis=1) / B, now, steps=_PAIR_STEPS)
    rows = np.flatnonzero(counts.sum(axis=1) > 0)
    if rows.size == 0:
        return phy
    packed = pack_counts_in_time(loads[rows], counts[rows], B, budget.clock)
    rows = rows[: len(packed)]
    win = bin_loads(loads[rows], packed).max(axis=1) < now[rows] * (1 - REL_TOL)
    out = phy.copy()
    out[rows[win]] = packed[win]
    return out


# Bisection steps of the two-slot count construction: 2**-14 of the gap to the mean.
_PAIR_STEPS = 14


def _pair_sweep(
    loads: np.ndarray, phy: np.ndarray, cap: int | None, budget: Budget, target: np.ndarray | None
) -> tuple[np.ndarray, float]:
    """Two slots per bin: counts of ``pair_counts_sweep`` where their pairing beats ``phy``
    ``[X, B, 2]``, improved by ``pair_descent`` within ``budget`` and packed → ``([X, B, 2]``,
    never worse per row, units spent)."""
    X, B, S = phy.shape
    now = bin_loads(loads, phy).max(axis=1)
    # Each bisection step builds counts for one target: about one pass over the slots. Below
    # ``target`` the search would stop anyway, so the bisection starts there.
    budget.spend(X * _SWEEP_STEPS * B * S)
    mean = loads.sum(axis=1) / B
    lo = mean if target is None else np.clip(target, mean, now)
    counts = pair_counts_sweep(loads, B, cap, lo, now, steps=_SWEEP_STEPS)
    rows = np.flatnonzero(counts.sum(axis=1) > 0)
    if rows.size == 0 or budget.out():
        return phy, budget.spent
    rows = rows[paired_max(loads[rows], counts[rows]) < now[rows] * (1 - REL_TOL)]
    if rows.size == 0:
        return phy, budget.spent
    out = phy.copy()
    out[rows] = _pair_polish(
        loads[rows], phy[rows], cap, budget, None if target is None else target[rows], counts[rows]
    )
    return out, budget.spent


def _pair_polish(
    loads: np.ndarray,
    phy: np.ndarray,
    cap: int | None,
    budget: Budget,
    target: np.ndarray | None,
    start: np.ndarray | None = None,
) -> np.ndarray:
    """Two slots per bin: ``pair_descent`` on the counts of ``phy`` ``[X, B, 2]`` (or on
    ``start`` ``[X, E]``) within ``budget``, packed where the result beats ``phy``;
    ``[X, B, 2]``, never worse per row."""
    X, B, S = phy.shape
    now = bin_loads(loads, phy).max(axis=1)
    if target is None:
        target = loads.sum(axis=1) / B * (1 + GOOD_ENOUGH)
    stage = budget.share(_POLISH_SHARE)

    # A candidate is judged by one sort of its replicas: an eighth of a slot, as in
    # repack_search's screen (a sixteenth undercharged it: plans took longer per unit).
    unit = B * S / 8

    spend = _spender(stage, unit)
    start = replica_counts(phy, loads.shape[1]) if start is None else start
    counts = pair_descent(loads, start, B, cap, target=target, spend=spend)
    budget.spend(stage.spent)
    return _packed_where_better(loads, phy, counts, now)


def _packed_where_better(loads: np.ndarray, phy: np.ndarray, counts: np.ndarray, now: np.ndarray) -> np.ndarray:
    """``counts`` ``[X, E]`` found by a two-slot search → ``phy`` ``[X, B, 2]`` with the rows whose
    counts pair below their busiest gpu ``now`` ``[X]`` packed from them, where that wins."""
    B = phy.shape[1]
    rows = np.flatnonzero(paired_max(loads, counts) < now * (1 - REL_TOL))
    if rows.size == 0:
        return phy
    packed = pack_counts(loads[rows], counts[rows], B)
    win = bin_loads(loads[rows], packed).max(axis=1) < now[rows] * (1 - REL_TOL)
    out = phy.copy()
    out[rows[win]] = packed[win]
    return out


def _spender(budget: Budget, unit: float) -> Callable[[int], int]:
    """``spend(candidates)`` for the pairing searches: how many of ``candidates``, ``unit`` work
    units each, ``budget`` still pays for (charged to it), 0 once it is out."""

    def spend(candidates: int) -> int:
        if budget.out():
            return 0
        fit = budget.fit(candidates, unit)
        budget.spend(fit * unit)
        return fit

    return spend


def _pair_target(
    loads: np.ndarray,
    phy: np.ndarray,
    cap: int | None,
    budget: Budget,
    target: np.ndarray | None,
    lean: bool = False,
) -> np.ndarray:
    """Two slots per bin: ``target_search`` on the counts of ``phy`` ``[X, B, 2]`` within
    ``budget`` (no lower than ``target``), packed where the result beats ``phy``;
    ``[X, B, 2]``, never worse per row."""
    X, B, S = phy.shape
    now = bin_loads(loads, phy).max(axis=1)
    mean = loads.sum(axis=1) / B
    lo = mean if target is None else np.clip(target, mean, now)
    # A candidate is judged by one sort of its replicas, as in _pair_polish.
    unit = B * S / 8

    spend = _spender(budget, unit)
    size = {"gainers": _LEAN_GAINERS, "donors": _LEAN_DONORS} if lean else {}
    counts = target_search(loads, replica_counts(phy, loads.shape[1]), B, cap, lo=lo, spend=spend, **size)
    return _packed_where_better(loads, phy, counts, now)
