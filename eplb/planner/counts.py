"""Count moves: re-choosing replica counts for the busiest gpu, one slot at a time.

Water-filling picks counts that minimise the busiest *replica*; with few slots per gpu the
busiest *gpu* is what matters, and big replicas that cannot share a gpu decide it. A count
move gives expert ``e`` on the busiest gpu one more replica, written over one replica of a
donor expert ``f`` on another gpu ``q``: every gpu holding ``e`` gets lighter, those holding
``f`` heavier, ``q`` trades ``f``'s replica for ``e``'s. Each layer makes the move that most
lowers its busiest gpu, then a few swap rounds rebalance; repeat while it pays. A move
rewrites one slot, so the same step also serves migration-aware repair (``eplb.replan``).
"""

from __future__ import annotations

import numpy as np

from ..budget import Budget
from ..layout import GOOD_ENOUGH, REL_TOL, bin_loads, replica_counts, slot_sums, take_rows
from .packing import swap_improve

__all__ = ["refine_counts"]

# How much worse than now a count move may leave the busiest bin before the swaps after it.
_SLACK = 0.1
# Moves a row may make without lowering its busiest bin before it stops.
_PATIENCE = 4


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
    # Rows whose busiest bin is already within GOOD_ENOUGH of the mean have nothing to gain.
    if target is None:
        target = loads.sum(axis=1) / B * (1 + GOOD_ENOUGH)
    active = np.flatnonzero(bin_loads(loads, phy).max(axis=1) > target)
    best = np.full(X, np.inf)
    idle = np.zeros(X, dtype=np.int64)
    clock = budget or Budget()
    for _ in range(iterations):
        if active.size == 0 or B < 2 or clock.out():
            break
        # Each (gainer, donor, bin) candidate is a few array operations: an eighth of a unit.
        clock.spend(active.size * B * S * min(donors, E) / 8)
        before = bin_loads(loads[active], phy[active]).max(axis=1)
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
            v_in = bin_loads(loads[active], phy[active]).max(axis=1)
            v_out = bin_loads(loads[active], trial[active]).max(axis=1)
            take = out & (~moved | (v_out < v_in * (1 - REL_TOL)))
            phy[active[take]] = trial[active[take]]
            moved |= take
        if moved.any():
            swap_improve(loads, phy, active[moved], swap_rounds, target)
        now = bin_loads(loads[active], phy[active]).max(axis=1)
        undo = moved & (now > before * (1 + REL_TOL))
        phy[active[undo]] = snapshot[undo]
        now = np.where(undo, before, now)
        moved &= ~undo
        # Ties at the top need moves that keep the maximum while unloading one busiest bin;
        # a row stops after a few of those in a row, or at once when nothing could move.
        changed = active[moved]
        now = now[moved]
        idle[changed] = np.where(now < best[changed] * (1 - REL_TOL), 0, idle[changed] + 1)
        best[changed] = np.minimum(best[changed], now)
        active = changed[(idle[changed] < _PATIENCE) & (now > target[changed])]
    return phy


def _busiest(loads: np.ndarray, phy: np.ndarray) -> tuple[np.ndarray, ...]:
    """``loads`` ``[A, E]``, ``phy`` ``[A, B, S]`` → replica counts ``[A, E]``, replica weights
    ``[A, E]``, bin loads ``[A, B]``, the busiest bin ``[A]`` and its load ``[A]``."""
    ra = np.arange(phy.shape[0])
    cnt = replica_counts(phy, loads.shape[1])
    w = loads / cnt
    load = slot_sums(take_rows(w, phy))
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
    c_g = take_rows(cnt, gain)
    l_g = take_rows(loads, gain)
    w_g = l_g / c_g
    d_e = w_g - l_g / (c_g + 1)  # how much each holder of e sheds
    w_new_e = w_g - d_e
    # Donors: the experts whose replicas grow least when they lose one.
    grown = np.where(cnt >= 2, loads / np.maximum(cnt - 1, 1), np.inf)
    D = min(donors, E)
    don = np.argpartition(grown, D - 1, axis=1)[:, :D] if D < E else np.broadcast_to(np.arange(E), (A, E))
    w_f = take_rows(w, don)
    g_f = take_rows(grown, don)
    d_f = np.where(np.isfinite(g_f), g_f - w_f, np.inf)  # [A, D]
    held = _holders(phy, E)
    He = _rows_of(held, gain)  # [A, S, B]: bin holds gainer
    Hf = _rows_of(held, don)  # [A, D, B]: bin holds donor
    # The [A, S, D, B] grids are the cost here: each is built once, in one buffer, and the
    # per-(gainer, donor) conditions are combined on the small arrays first.
    new = (load[:, None, :] - d_e[:, :, None] * He)[:, :, None, :] + np.where(Hf, d_f[:, :, None], 0.0)[:, None, :, :]
    # Max over bins other than q: the top two of `new` cover every q.
    arg1 = new.argmax(axis=3)[..., None]
    m1 = np.take_along_axis(new, arg1, axis=3)  # the maximum, gathered: a fifth of a second pass
    np.put_along_axis(new, arg1, -np.inf, axis=3)
    m2 = new.max(axis=3, keepdims=True)
    # The score: the larger of q's new load (at_q) and the busiest other bin (m1, or m2 at q
    # = arg1), written over `new`.
    score = np.add((load[:, None, :] - w_f[:, :, None])[:, None, :, :], w_new_e[:, :, None, None], out=new)
    at_arg1 = np.take_along_axis(score, arg1, axis=3)
    np.maximum(score, m1, out=score)
    np.put_along_axis(score, arg1, np.maximum(at_arg1, m2), axis=3)
    ok = (c_g < hi) & (d_e > REL_TOL * lmax[:, None])  # [A, S]; the busiest bin must really get lighter
    ok = ok[:, :, None] & np.isfinite(d_f)[:, None, :] & (gain[:, :, None] != don[:, None, :])  # [A, S, D]
    bad = ~Hf[:, None, :, :] | He[:, :, None, :]
    bad |= ~ok[:, :, :, None]
    np.putmask(score, bad, np.inf)  # half the time of boolean indexing
    score = score.reshape(A, -1)
    best = score.argmin(axis=1)
    val = score[ra, best]
    moved = val <= lmax * (1 + slack + REL_TOL)
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
    c_f = take_rows(cnt, give)
    w_f = take_rows(w, give)
    d_f = np.where(c_f >= 2, take_rows(loads, give) / np.maximum(c_f - 1, 1) - w_f, np.inf)  # [A, S]
    light = np.where(cnt < hi, loads / (cnt + 1), np.inf)
    D = min(gainers, E)
    gain = np.argpartition(light, D - 1, axis=1)[:, :D] if D < E else np.broadcast_to(np.arange(E), (A, E))
    w_g = take_rows(w, gain)
    w_new_g = take_rows(light, gain)  # [A, D]
    d_g = w_g - w_new_g
    held = _holders(phy, E)
    Hf = _rows_of(held, give)  # [A, S, B]
    Hg = _rows_of(held, gain)  # [A, D, B]
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
    moved = val <= lmax * (1 + slack + REL_TOL)
    if moved.any():
        s, d = np.unravel_index(best[moved], (S, D))
        a = ra[moved]
        phy_all[rows[a], h[a], s] = gain[a, d]
    return moved


def _holders(phy: np.ndarray, num_experts: int) -> np.ndarray:
    """``phy`` ``[A, B, S]`` → bool ``[A, E, B]``: whether bin ``b`` holds expert ``e``. One
    scatter; comparing every slot with every candidate expert costs several times more."""
    A, B, S = phy.shape
    held = np.zeros(A * num_experts * B, dtype=bool)
    held[((np.arange(A) * num_experts)[:, None, None] + phy) * B + np.arange(B)[:, None]] = True
    return held.reshape(A, num_experts, B)


def _rows_of(held: np.ndarray, experts: np.ndarray) -> np.ndarray:
    """``held`` ``[A, E, B]``, ``experts`` ``[A, K]`` → ``[A, K, B]``: ``held[a, experts[a, k]]``,
    gathered as whole rows of ``[A * E, B]`` (one flat index array)."""
    A, E, B = held.shape
    return held.reshape(A * E, B)[experts + (np.arange(A) * E)[:, None]]
