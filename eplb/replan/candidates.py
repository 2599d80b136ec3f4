"""A re-plan's candidates per layer: the previous placement repaired towards targets.

Repairs change the previous placement only on gpus above a target: ejection chains, rotations,
swaps and count moves (``eplb.replan.moves``, ``eplb.planner.packing``, ``eplb.planner.counts``)
in three orders, the best per layer; ``recounted`` first resets replica counts to the fresh
plan's, ``regrouped`` (hierarchical) first swaps expert groups between nodes. ``candidates``
makes them for all layers, in worker processes if asked, with the kept placement first and the
fresh plan aligned onto it last (``eplb.replan.align``), scored for ``eplb.replan.pick``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from ..budget import Budget, Clock
from ..layout import GOOD_ENOUGH, REL_TOL, bin_loads, distinct_rows, replica_counts, slot_sums, take_rows
from ..placement import Placement
from ..planner.counts import refine_counts
from ..planner.packing import swap_improve
from ..planner.replicate import replica_cap, waterfill
from ..topology import Topology
from ..workers import worker_pool
from .align import align_slots, align_to_previous
from .moves import chain_improve, count_repair, rotate_improve
from .pick import score

__all__ = ["Candidates", "candidates", "repair_previous", "recount", "groups_whole"]

# Repairs try ejection chains without count moves first (besides count moves then chains, and
# rotations first) only on rows of at most this many slots per gpu. Elsewhere that order won
# a third of the rows it was tried on but saved 0.3 % of the slots at kimi-64 and 0.5 % at
# v3-prefill (drift 0.05 and 0.2, 3 steps each) for one of three repair passes; with two
# slots per gpu it saved 0.75 points of the slots over 5 re-plans across v3-decode-144's
# shift (drift_bench --steps 6).
_CHAINS_FIRST_SLOTS = 2

# Count moves per row at the end of a repair (``_finish``), and for survivor plans at
# effort="fast" (``quick``, which also leaves out the third order with few slots per gpu).
# Together at 128 gpus x 2 slots (survivor_bench, 1, 2 and a node's gpus down) the fast plans
# are the same placements in 102/110/121 ms instead of 132/145/164 (cpu, load ~4 on 2 cores);
# at v3-decode-144 a node down takes 1308 moves instead of 1301 (imbalance 1.6846 vs 1.6848),
# the others are the same placements.
_COUNT_MOVES = 32
_QUICK_COUNT_MOVES = 16

# Cells of one chunk of layers' [l, N*K, N*K] group swaps (``_swap_groups``): a few tens of MB.
_SWAP_CELLS = 1 << 20


def repair_previous(
    loads: np.ndarray,
    previous: Placement,
    topology: Topology,
    target: np.ndarray,
    by_node: bool,
    fresh: np.ndarray | None = None,
    give_up: float | None = None,
    every_order: bool = True,
    repeats: int = 1,
    clock: Clock | None = None,
    quick: bool = False,
) -> dict[str, np.ndarray]:
    """``loads`` ``[L, E]``, ``target`` ``[L]`` busiest-gpu load to reach → candidate
    ``phy2log`` arrays ``[L, P]`` by name, each changed from ``previous`` only until each
    layer's busiest gpu is at most its target (or as far as it got; the caller checks):

    - swaps of two slots between gpus (within a node when ``by_node``), then count moves (one
      slot rewritten with another expert, see ``eplb.planner.counts``) with swaps after them;
    - a recount: replica counts changed in one go to those of ``fresh`` ``[L, P]`` (for
      ``by_node``, water-filling within each node), each lost replica taken from the busiest
      gpu holding it and each new one written into a freed slot on the lightest gpu that lacks
      it, then the same swaps and count moves. With few slots per gpu the balance hangs on
      the counts and one count move at a time stalls: the donor's replicas often share gpus
      with the expert that needs one more.

    ``give_up``: rows (layers, or nodes of a layer) whose busiest gpu is more than this many
    times their target are left as they are in the repair that keeps the counts (see
    ``_repair_rows``); ``None``: every row is repaired. ``every_order``: see ``_best_order``.
    ``repeats``: the layers may be that many copies of the first ``L / repeats`` (the stacked
    targets of ``_repairs``); the recount, which does not depend on the target, then runs on
    one copy.
    ``clock``: the re-plan's deadline; a repair it stops is still a candidate, as far as it got.
    ``quick``: fewer orders and count moves (see ``_best_order``), for survivor plans at
    ``effort="fast"``.
    """
    t = topology
    L, S = t.num_layers, t.slots_per_gpu
    prev = previous.phy2log
    node_exp = _node_experts(prev, t) if by_node and t.num_nodes > 1 else None
    if node_exp is None:
        phy = prev.reshape(L, t.num_gpus, S).astype(np.int64)
        if fresh is None:
            repaired = _repair_rows(
                loads,
                phy,
                target,
                None,
                None,
                t,
                give_up=give_up,
                every_order=every_order,
                repeats=repeats,
                clock=clock,
                quick=quick,
            )
            return {"repaired": _to_global(repaired.out, None, prev, t)}
        counts = replica_counts(fresh.reshape(L, t.num_gpus, S).astype(np.int64), t.num_experts)
        repaired, recounted = _repair_pair(
            loads, phy, target, counts, None, t, give_up, every_order, repeats, clock, quick
        )
        return {
            "repaired": _to_global(repaired.out, None, prev, t),
            "recounted": _to_global(recounted.out, None, prev, t),
        }
    rows, bins = L * t.num_nodes, t.gpus_per_node
    phy = _to_local(prev.reshape(rows, bins, S), node_exp, t.num_experts)
    repaired, recounted = _repair_pair(
        loads, phy, target, True, node_exp, t, give_up, every_order, repeats, clock, quick
    )
    out = {
        "repaired": _to_global(repaired.out, node_exp, prev, t),
        "recounted": _to_global(recounted.out, node_exp, prev, t),
    }
    # When the busiest node itself is above the target no repair within nodes can reach it:
    # swap groups between nodes (each time the swap that most lowers the busiest node, until
    # it is below the target), the incoming group's experts taking the outgoing group's
    # slots, then recount and repair.
    swapped, may = None, None
    for _ in range(0 if clock is not None and clock.expired else t.num_groups // 2):
        # A layer that did not swap has the same groups next time, so it would not swap then
        # either: only the layers that swapped are searched again.
        nxt = _swap_groups(loads, node_exp if swapped is None else swapped, t, target, may)
        if nxt is None:
            break
        swapped, may = nxt
    if swapped is not None:
        # Only the nodes that swapped a group start anywhere else than the recount did.
        regrouped = _repair_rows(
            loads,
            phy,
            target,
            True,
            swapped,
            t,
            like=recounted,
            give_up=give_up,
            every_order=every_order,
            clock=clock,
            quick=quick,
        )
        out["regrouped"] = _to_global(regrouped.out, swapped, prev, t)
    return out


def _repairs(
    loads: np.ndarray,
    previous: Placement,
    topology: Topology,
    targets: list[np.ndarray],
    by_node: bool,
    fresh: np.ndarray,
    pad: bool = False,
    give_up: float | None = None,
    every_order: bool = True,
    clock: Clock | None = None,
    quick: bool = False,
) -> tuple[list[tuple[str, np.ndarray]], bool]:
    """``repair_previous`` for each of ``targets`` (``[L]`` arrays) → (name, ``phy2log`` ``[L, P]``)
    pairs, target by target, and whether any layer swapped groups between nodes. The targets
    run as one stacked problem of ``K * L`` layers (rows are independent): one pass of each step
    instead of ``K`` keeps numpy's per-call cost down. With ``pad``, hierarchical repairs always
    carry a ``regrouped`` candidate (the ``recounted`` one where no layer swapped), so every
    chunk of layers has the same candidates; the caller drops them when no chunk swapped."""
    K, L = len(targets), topology.num_layers
    stacked = topology.with_layers(K * L)
    prev = Placement(np.tile(previous.phy2log, (K, 1)), stacked)
    out = repair_previous(
        np.tile(loads, (K, 1)),
        prev,
        stacked,
        np.concatenate(targets),
        by_node,
        np.tile(fresh, (K, 1)),
        give_up,
        every_order,
        K,
        clock,
        quick,
    )
    swapped = "regrouped" in out
    if pad and not swapped and "recounted" in out and by_node and topology.num_nodes > 1:
        out["regrouped"] = out["recounted"]
    return [(name, cand[k * L : (k + 1) * L]) for k in range(K) for name, cand in out.items()], swapped


@dataclass(frozen=True, eq=False)
class _Chunk:
    """``loads`` ``[l, E]``, ``old`` and ``fresh`` ``[l, P]``: one chunk of ``l`` layers' work for
    ``_ways``, with what ``candidates`` was asked (pickled to a worker process when it has several)."""

    loads: np.ndarray
    old: np.ndarray
    fresh: np.ndarray
    topology: Topology  # the chunk's: ``num_layers`` is ``l``
    targets: list[np.ndarray]  # repair targets, each ``[l]`` busiest-gpu load
    by_node: bool
    ends: bool  # whether the kept placement comes first and the fresh plan aligned last
    pad: bool  # see ``_repairs``
    give_up: float | None  # see ``repair_previous``
    every_order: bool  # see ``repair_previous``
    deadline: float | None  # a ``time.perf_counter()`` value, or ``None``: see ``candidates``
    quick: bool  # see ``repair_previous``


class Candidates(NamedTuple):
    """``names`` ``[C]``, ``cands`` ``[C, L, P]`` (``phy2log`` of each candidate), ``imb`` and
    ``moves`` ``[C, L]`` (see ``eplb.replan.pick.score``), and ``cut``: whether the deadline
    stopped a repair. For a chunk of layers (``_ways``) ``L`` is the chunk's."""

    names: list[str]
    cands: np.ndarray
    imb: np.ndarray
    moves: np.ndarray
    cut: bool


def _ways(job: _Chunk) -> tuple[Candidates, bool]:
    """One chunk of layers' candidates, scored (see ``eplb.replan.pick.score``), and whether any
    layer swapped groups. Layers are independent here, so a chunk's rows equal those of all
    layers at once."""
    clock = None if job.deadline is None else Clock(job.deadline)
    previous = Placement(job.old, job.topology)
    ways = [("kept", job.old)] if job.ends else []
    swapped = False
    if job.targets:
        repaired, swapped = _repairs(
            job.loads,
            previous,
            job.topology,
            job.targets,
            job.by_node,
            job.fresh,
            job.pad,
            job.give_up,
            job.every_order,
            clock,
            job.quick,
        )
        ways += repaired
    if job.ends:
        ways.append(("replanned", align_to_previous(job.fresh, previous, job.topology, job.by_node)))
    names, cands, imb, moves = score(ways, job.loads, job.old, job.topology)
    return Candidates(names, cands, imb, moves, clock is not None and clock.expired), swapped


def candidates(
    loads: np.ndarray,
    old: np.ndarray,
    fresh: np.ndarray,
    topology: Topology,
    targets: list[np.ndarray],
    by_node: bool,
    ends: bool,
    workers: int,
    give_up: float | None = None,
    every_order: bool = True,
    deadline: float | None = None,
    quick: bool = False,
) -> Candidates:
    """``loads`` ``[L, E]``, ``old`` and ``fresh`` ``[L, P]``, repair ``targets`` (``[L]`` arrays)
    → ``_ways`` over all layers (with ``ends``, the kept placement first and the fresh plan
    aligned last): in this process, or in ``workers`` processes, each taking an equal share of the layers (the
    same result: any split gives it). ``give_up``, ``every_order``, ``quick``: see ``repair_previous``.
    ``deadline`` (a ``time.perf_counter()`` value): repairs stop between their rounds when the
    next would pass it, where they got to; the kept placement and the fresh plan aligned are
    made whatever the time, so every layer has a candidate within the tolerances."""
    L = topology.num_layers
    step = -(-L // min(workers, L))
    jobs, pad = [], step < L
    for a in range(0, L, step):
        b = min(a + step, L)
        tg = [t[a:b] for t in targets]
        chunk = topology.with_layers(b - a)
        jobs.append(
            _Chunk(
                loads=loads[a:b],
                old=old[a:b],
                fresh=fresh[a:b],
                topology=chunk,
                targets=tg,
                by_node=by_node,
                ends=ends,
                pad=pad,
                give_up=give_up,
                every_order=every_order,
                deadline=deadline,
                quick=quick,
            )
        )
    parts = list(worker_pool(workers).map(_ways, jobs)) if len(jobs) > 1 else [_ways(jobs[0])]
    names = parts[0][0].names
    keep = np.ones(len(names), dtype=bool)
    if not any(swapped for _, swapped in parts):
        keep = np.array([n != "regrouped" for n in names])
    names = [n for n, k in zip(names, keep) if k]
    cands = np.concatenate([p.cands[keep] for p, _ in parts], axis=1)
    imb = np.concatenate([p.imb[keep] for p, _ in parts], axis=1)
    moves = np.concatenate([p.moves[keep] for p, _ in parts], axis=1)
    return Candidates(names, cands, imb, moves, any(p.cut for p, _ in parts))


class _Repair(NamedTuple):
    """``out`` and ``start`` ``[R, B, S]``: a repair's rows (local expert ids when by node) and
    where it started from (the rows recounted, or as they were); ``loads`` ``[R, E/N]`` (or
    ``[R, E]``) the rows' expert loads and ``target`` ``[R]`` the busiest-bin load they aimed at."""

    out: np.ndarray
    start: np.ndarray
    loads: np.ndarray
    target: np.ndarray


def _repair_rows(
    loads: np.ndarray,
    phy: np.ndarray,
    target: np.ndarray,
    counts: np.ndarray | Literal[True] | None,
    node_exp: np.ndarray | None,
    t: Topology,
    like: _Repair | None = None,
    give_up: float | None = None,
    every_order: bool = True,
    repeats: int = 1,
    clock: Clock | None = None,
    quick: bool = False,
) -> _Repair:
    """One repair from ``phy`` ``[R, B, S]`` (rows are layers, or (layer, node) pairs with
    local expert ids into ``node_exp`` ``[R, E/N]``): optionally a recount to ``counts``
    ``[R, E]`` (``True``: water-filling within each row), then the best per row of three
    orders of rotations, ejection chains, count repairs, swaps and count moves.
    Returns the repaired rows with where they started, their loads and targets (``_Repair``).

    Rows are independent, so a row that starts where it did in ``like`` (an earlier result of
    this function for the same targets), with the same loads, ends there too: only the other
    rows are worked out. So does a row whose busiest bin is already at its target, where
    every step leaves it as it is. ``give_up``: rows that keep their counts (no recount, or
    one that failed) and whose busiest bin is more than this many times their target are
    left as they are: from a start that far off, such as the contiguous first placement, a
    repair with counts kept does not come within the layer tolerance, and its count moves and
    swaps are most of a re-plan's time (``eplb.replan.choose`` says what it costs).
    ``repeats``: when the rows are that many copies of the first ``R / repeats`` (loads, start
    and counts; checked), the recount runs on one copy."""
    rep, rows, cap = _repair_start(loads, phy, target, counts, node_exp, t, give_up, repeats)
    if like is not None:
        same = _same_start(like, rep)
        rep.out[same] = like.out[same]
        rows = rows[~same[rows]]
    # The recount above is work of its own: check before the repairs start.
    if rows.size and not (clock is not None and clock.out()):
        rep.out[rows] = _best_order(
            rep.loads[rows], phy[rows], rep.start[rows], rep.target[rows], cap, every_order, clock, quick
        )
    return rep


def _repair_pair(
    loads: np.ndarray,
    phy: np.ndarray,
    target: np.ndarray,
    counts: np.ndarray | Literal[True],
    node_exp: np.ndarray | None,
    t: Topology,
    give_up: float | None = None,
    every_order: bool = True,
    repeats: int = 1,
    clock: Clock | None = None,
    quick: bool = False,
) -> tuple[_Repair, _Repair]:
    """``_repair_rows`` without a recount, then with ``counts`` (``like`` the first), as one
    pass: the rows of both that need a repair go through ``_best_order`` together. Rows are
    independent there, so each comes out as it would alone (the same result as two calls), and
    one pass of each step over twice the rows halves numpy's per-call cost, most of a repair's
    time with few slots per gpu (128 gpus x 2 slots: 58 layers, one target)."""
    a, rows_a, cap = _repair_start(loads, phy, target, None, node_exp, t, give_up, repeats)
    b, rows_b, _ = _repair_start(loads, phy, target, counts, node_exp, t, give_up, repeats)
    same = _same_start(a, b)
    rows_b = rows_b[~same[rows_b]]
    rows = np.concatenate([rows_a, rows_b])
    if rows.size and not (clock is not None and clock.out()):
        done = _best_order(
            np.concatenate([a.loads[rows_a], b.loads[rows_b]]),
            phy[rows],
            np.concatenate([a.start[rows_a], b.start[rows_b]]),
            np.concatenate([a.target[rows_a], b.target[rows_b]]),
            cap,
            every_order,
            clock,
            quick,
        )
        a.out[rows_a], b.out[rows_b] = done[: rows_a.size], done[rows_a.size :]
    b.out[same] = a.out[same]
    return a, b


def _same_start(like: _Repair, rep: _Repair) -> np.ndarray:
    """``[R]``: rows of ``rep`` that start where ``like`` (an earlier result of ``_repair_rows``
    for the same targets) started, with the same loads and target: they end where it ended."""
    return (
        (rep.start == like.start).all(axis=(1, 2)) & (rep.loads == like.loads).all(axis=1) & (rep.target == like.target)
    )


def _repair_start(
    loads: np.ndarray,
    phy: np.ndarray,
    target: np.ndarray,
    counts: np.ndarray | Literal[True] | None,
    node_exp: np.ndarray | None,
    t: Topology,
    give_up: float | None,
    repeats: int,
) -> tuple[_Repair, np.ndarray, int | None]:
    """Where ``_repair_rows`` starts: its output so far (``start`` copied) with ``start``, the rows'
    loads and targets; the rows that need a repair; the replica cap."""
    S = t.slots_per_gpu
    bins = phy.shape[1]
    if node_exp is not None:
        N = t.num_nodes
        # Each (layer, node) row's loads of its experts, gathered: a repeat of [L, E] per node first
        # is [L * N, E] (12 GiB at 3 targets x 128 layers x 512 nodes x 8192 experts).
        row_loads = loads[np.arange(node_exp.shape[0])[:, None] // N, node_exp]
        # No repair within a node takes a gpu below its node's mean, so where the layer's
        # busiest node's mean is above the target its rows aim at that mean (plus the search's
        # gap) instead: a target that is out of reach kept the busiest node's row searching to
        # the end and the others moving slots that do not lower the layer's busiest gpu
        # (v3-prefill: 13 % of the rows, 45 % of their moved slots).
        forced = (row_loads.sum(axis=1) / bins).reshape(-1, N).max(axis=1) * (1 + GOOD_ENOUGH)
        tgt = np.repeat(np.maximum(target, forced), N)
    else:
        tgt, row_loads = target, loads
    cap = replica_cap(row_loads.shape[1], bins * S, bins)
    start = phy
    if counts is not None and cap is not None:
        # The targets of a stacked repair share each row's start, and neither the water-filling
        # nor the recount depends on the target: one copy of the rows is enough.
        same = repeats > 1 and all(_copies(x, repeats) for x in (row_loads, phy, counts) if x is not True)
        one = slice(0, phy.shape[0] // repeats if same else phy.shape[0])
        counts = waterfill(row_loads[one], bins * S, cap) if counts is True else counts[one]
        recounted, ok = recount(row_loads[one], phy[one], counts)
        if same:
            recounted, ok = np.tile(recounted, (repeats, 1, 1)), np.tile(ok, repeats)
        start = np.where((ok & distinct_rows(phy))[:, None, None], recounted, phy)
    top = bin_loads(row_loads, start).max(axis=1)
    todo = top > tgt
    if give_up is not None:
        todo &= (top <= give_up * tgt) | (start != phy).any(axis=(1, 2))
    return _Repair(start.copy(), start, row_loads, tgt), np.flatnonzero(todo), cap


def _copies(x: np.ndarray, k: int) -> bool:
    """``x`` ``[R, ...]`` → whether it is ``k`` copies, one after the other, of its first ``R / k`` rows."""
    n = x.shape[0] // k
    return n * k == x.shape[0] and bool((x.reshape((k, n) + x.shape[1:]) == x[:n]).all())


def _best_order(
    loads: np.ndarray,
    phy: np.ndarray,
    cand: np.ndarray,
    tgt: np.ndarray,
    cap: int | None,
    every_order: bool = True,
    clock: Clock | None = None,
    quick: bool = False,
) -> np.ndarray:
    """``cand`` ``[R, B, S]`` (``phy`` recounted, or ``phy`` itself) repaired towards ``tgt``
    ``[R]`` in two orders (three with few slots per gpu), the best per row (fewest slots
    rewritten from ``phy``); without ``every_order`` only the one that starts with count moves
    (all three with few slots per gpu, where it loses most often), nor once ``clock`` is out.
    ``quick`` (survivor plans at ``effort="fast"``): with few slots per gpu the third order is
    left out, and the last count moves stop after ``_QUICK_COUNT_MOVES`` rounds."""
    rows = cand.shape[0]
    # Two orders, the better per row: count moves that relieve every gpu of an expert that
    # grew (one slot, see ``eplb.replan.moves``) then ejection chains (k bins with k + 1), or
    # rotations first (two bins above the target fixed with three slots); each then swaps
    # (one bin with two) and count moves. Chains use the room below the target tightly and
    # can strand a bin far above it that then costs several swaps, and count moves can leave
    # donors' gpus in the way, so neither wins every row (measured). A third order, chains
    # without the count moves first, runs only with few slots per gpu (``_CHAINS_FIRST_SLOTS``).
    c = cand.copy()
    if cap is not None:
        dist = np.flatnonzero(distinct_rows(cand))
        sub = c[dist]
        count_repair(loads[dist], sub, tgt[dist], cap, clock=clock)
        c[dist] = sub
    few = phy.shape[2] <= _CHAINS_FIRST_SLOTS
    if (not every_order and not few) or (clock is not None and clock.expired):
        # Rows without a count move take chains first.
        return _finish(loads, c, tgt, cap, chains=True, clock=clock, quick=quick)
    # The orders run as one stacked repair of their rows (rows are independent in _finish, so
    # each comes out as alone), with chains per row: a third of numpy's calls.
    # The third order (chains first from ``cand``) starts where the first does on rows that
    # count_repair left as they were, so it would end there too: only its other rows run
    # (11-25 % of the stacked rows at 128 gpus x 2 slots and v3-decode-144, survivor plans).
    third = (c != cand).any(axis=(1, 2)) if few and not quick else np.zeros(rows, dtype=bool)
    alone = np.flatnonzero(third)
    each = np.arange(rows)
    idx = np.concatenate([each, each, alone])
    mask = np.concatenate([np.ones(rows, dtype=bool), np.zeros(rows, dtype=bool), np.ones(alone.size, dtype=bool)])
    starts = np.concatenate([c, cand, cand[alone]])
    done = _finish(loads[idx], starts, tgt[idx], cap, chains=mask, clock=clock, quick=quick)
    outs = [done[:rows], done[rows : 2 * rows]]
    if few and not quick:
        outs.append(outs[0].copy())
        outs[2][alone] = done[2 * rows :]
    # Rows that reach the target first, then fewer rewritten slots, then the lower busiest bin;
    # compared per row (a sort by keys), so a row's pick never depends on the other rows. Ties
    # go to the order that starts with count moves.
    busiest = np.stack([bin_loads(loads, c).max(axis=1) for c in outs])  # [orders, R]
    moved_slots = np.stack([(c != phy).sum(axis=(1, 2)) for c in outs])
    missed = busiest > tgt * (1 + REL_TOL)
    best = np.lexsort((busiest, moved_slots, missed), axis=0)[0]
    return np.stack(outs)[best, np.arange(rows)]


def _to_global(local: np.ndarray, node_exp: np.ndarray | None, prev: np.ndarray, t: Topology) -> np.ndarray:
    """Repaired rows ``[R, B, S]`` (local ids into ``node_exp`` when given) → global ``phy2log``
    ``[L, P]`` with staying experts in their old slots of ``prev``."""
    S, rows = t.slots_per_gpu, local.shape[0]
    if node_exp is not None:
        local = np.take_along_axis(node_exp, local.reshape(rows, -1), axis=1)
    # A run of swaps can take an expert off a gpu and bring it back to another slot. A gpu
    # whose slots all hold what they held already is aligned as it is (most of them).
    new, old = local.reshape(-1, S), prev.reshape(-1, S)
    out = new.astype(prev.dtype, copy=True)
    moved = np.flatnonzero((new != old).any(axis=1))
    if moved.size:
        out[moved] = align_slots(new[moved], old[moved])
    return out.reshape(t.num_layers, t.num_slots)


def _finish(
    loads: np.ndarray,
    c: np.ndarray,
    tgt: np.ndarray,
    cap: int | None,
    chains: bool | np.ndarray,
    clock: Clock | None = None,
    quick: bool = False,
) -> np.ndarray:
    """``c`` ``[R, B, S]`` repaired towards ``tgt`` ``[R]``: chains (or not; ``chains`` may be
    ``[R]`` bool, per row), rotations, swaps, count moves and swaps again, each stopping
    between rounds once ``clock`` is out. Chains, rotations and count moves need one replica
    of an expert per bin, so rows that have two skip them (each row on its own). ``quick``:
    at most ``_QUICK_COUNT_MOVES`` count moves per row, not ``_COUNT_MOVES``."""
    dist = np.flatnonzero(distinct_rows(c))
    if dist.size:
        sub = c[dist]
        chained = np.flatnonzero(np.broadcast_to(chains, (c.shape[0],))[dist])
        if chained.size:
            part = sub[chained]
            chain_improve(loads[dist[chained]], part, tgt[dist[chained]], clock=clock)
            sub[chained] = part
        rotate_improve(loads[dist], sub, tgt[dist], clock=clock)
        c[dist] = sub
    # Swaps and count moves leave a row at its target as it is: only the others go in.
    above = np.flatnonzero(bin_loads(loads, c).max(axis=1) > tgt)
    if above.size:
        swap_improve(loads, c, above, 64, tgt, clock)
    if cap is not None:
        above = bin_loads(loads, c).max(axis=1) > tgt
        dist = np.flatnonzero(above & distinct_rows(c))
        if dist.size:
            budget = None if clock is None else Budget(None, clock)
            moves = _QUICK_COUNT_MOVES if quick else _COUNT_MOVES
            c[dist] = refine_counts(loads[dist], c[dist], cap, iterations=moves, target=tgt[dist], budget=budget)
            swap_improve(loads, c, dist, 64, tgt, clock)
    return c


def _swap_groups(
    loads: np.ndarray, node_exp: np.ndarray, t: Topology, target: np.ndarray, layers: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray] | None:
    """``node_exp`` ``[L * N, E/N]`` (each node's experts, group blocks in order) → the same with
    one group swapped between two nodes in every layer (of ``layers`` ``[L]`` bool, if given)
    whose busiest node's mean gpu load is above ``target`` ``[L]`` and where a swap lowers it,
    and ``[L]`` which layers swapped; ``None`` when no layer swaps."""
    L, N, gs = t.num_layers, t.num_nodes, t.experts_per_group
    K = t.num_groups // N
    groups = node_exp.reshape(L, N * K, gs)[:, :, 0] // gs  # [L, N*K] group at each position
    gload = loads.reshape(L, t.num_groups, gs).sum(axis=2)
    pos_load = np.take_along_axis(gload, groups, axis=1)  # [L, N*K]
    node_of = np.repeat(np.arange(N), K)
    node_load = pos_load.reshape(L, N, K).sum(axis=2)
    # Swapping positions i and j: node_of[i] gains load[j] - load[i], node_of[j] the opposite,
    # the other nodes keep theirs: their busiest is the first of the layer's three busiest
    # nodes that is neither. Only a swap with the busiest node can bring the layer below it,
    # so only those pairs are searched (i or j on it: 2 K N*K pairs, not all (N*K)^2 and never
    # an [L, N*K, N*K, N] array, 128 GiB at 128 layers x 512 nodes of one group); the best is
    # the same pair, the first (row-major) of the lowest, as over all pairs.
    top = np.argsort(-node_load, axis=1, kind="stable")[:, :3]
    top_load = np.take_along_axis(node_load, top, axis=1)
    if N < 3:
        top = np.pad(top, ((0, 0), (0, 3 - N)), constant_values=-1)
        top_load = np.pad(top_load, ((0, 0), (0, 3 - N)), constant_values=-np.inf)
    now = node_load.max(axis=1)
    act = now / t.gpus_per_node > target
    if layers is not None:
        act &= layers
    rows = np.flatnonzero(act)
    best = np.zeros(L, dtype=np.int64)
    lowest = np.full(L, np.inf)  # the busiest node after each layer's best swap
    NK = N * K
    step = max(1, _SWAP_CELLS // (2 * K * NK))
    for c in range(0, rows.size, step):
        r = rows[c : c + step]
        on = top[r, :1] * K + np.arange(K)  # [l, K] positions on the busiest node
        everywhere = np.arange(NK)
        worst, flat = [], []
        for i, j in ((on[:, :, None], everywhere[None, None, :]), (everywhere[None, :, None], on[:, None, :])):
            i, j = np.broadcast_arrays(i, j)
            rr = np.arange(r.size)[:, None, None]
            pl, nl = pos_load[r], node_load[r]
            delta = pl[rr, j] - pl[rr, i]
            a, b = node_of[i], node_of[j]
            tn, tl = top[r][:, :, None, None], top_load[r][:, :, None, None]
            hit = (tn == a[:, None]) | (tn == b[:, None])  # [l, 3, x, y]
            others = np.where(hit[:, 0], np.where(hit[:, 1], tl[:, 2], tl[:, 1]), tl[:, 0])
            w = np.maximum(np.maximum(others, nl[rr, a] + delta), nl[rr, b] - delta)
            w[a == b] = np.inf
            worst.append(w.reshape(r.size, -1))
            flat.append((i * NK + j).reshape(r.size, -1))
        w, f = np.concatenate(worst, axis=1), np.concatenate(flat, axis=1)
        lowest[r] = w.min(axis=1)
        best[r] = np.where(w == lowest[r][:, None], f, NK * NK).min(axis=1)
    act &= lowest < now
    if not act.any():
        return None
    blocks = node_exp.reshape(L, N * K, gs)
    out = blocks.copy()
    la = np.flatnonzero(act)
    i, j = np.unravel_index(best[la], (N * K, N * K))
    out[la, i] = _by_rank(loads[la], blocks[la, j], blocks[la, i])
    out[la, j] = _by_rank(loads[la], blocks[la, i], blocks[la, j])
    return out.reshape(L * N, -1), act


def _by_rank(loads: np.ndarray, incoming: np.ndarray, outgoing: np.ndarray) -> np.ndarray:
    """``incoming``, ``outgoing``: ``[X, gs]`` experts → ``incoming`` reordered so its k-th
    busiest expert takes the place (and so the slots and replica count) of ``outgoing``'s."""
    rx = np.arange(len(loads))[:, None]
    inc = np.take_along_axis(incoming, np.argsort(-loads[rx, incoming], axis=1, kind="stable"), axis=1)
    rank_out = np.argsort(np.argsort(-loads[rx, outgoing], axis=1, kind="stable"), axis=1)
    return np.take_along_axis(inc, rank_out, axis=1)


def recount(loads: np.ndarray, phy: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``loads`` ``[R, E]``, ``phy`` ``[R, B, S]``, ``counts`` ``[R, E]`` → ``phy`` with those
    replica counts and ``[R]`` whether each row could be rewritten without putting two replicas
    of one expert on one gpu. Only slots whose expert loses or gains a replica change."""
    R, B, S = phy.shape
    E = loads.shape[1]
    flat = phy.reshape(R, B * S).copy()
    w = loads / np.maximum(counts, 1)
    slot_w = take_rows(w, flat)
    gpu_load = slot_sums(slot_w.reshape(R, B, S))
    have = replica_counts(phy, E)
    # Replicas to drop: each losing expert's replicas on its busiest gpus first. Rank every
    # slot of a losing expert within its (row, expert) by the load of its gpu, heaviest first
    # (ties in slot order); the other slots keep their expert whatever their rank.
    drop = np.maximum(have - counts, 0)
    r_, p_ = np.nonzero(take_rows(drop, flat))
    e_ = flat[r_, p_]
    order = np.lexsort((-gpu_load[r_, p_ // S], e_, r_))
    key = r_[order] * E + e_[order]
    pos = np.arange(order.size)
    first = np.maximum.accumulate(np.where(np.concatenate(([True], key[1:] != key[:-1])), pos, 0))
    rank = np.empty_like(pos)
    rank[order] = pos - first
    free = np.zeros((R, B * S), dtype=bool)
    free[r_, p_] = rank < drop[r_, e_]
    gpu_load -= slot_sums(np.where(free, slot_w, 0.0).reshape(R, B, S))
    # Replicas to add, heaviest first (ties by expert id), each into the freed slot on the
    # lightest gpu lacking it: ``ids`` [R, K] lists each row's, padded with -1.
    gain = np.maximum(counts - have, 0)
    per_row = gain.sum(axis=1)
    K = int(per_row.max(initial=0))
    ids = np.full((R, max(K, 1)), -1, dtype=np.int64)
    gr, ge = np.nonzero(gain)
    reps = gain[gr, ge]
    gr, ge = np.repeat(gr, reps), np.repeat(ge, reps)
    order = np.lexsort((-w[gr, ge], gr))
    gr, ge = gr[order], ge[order]
    ids[gr, np.arange(gr.size) - (np.cumsum(per_row) - per_row)[gr]] = ge
    ok = np.ones(R, dtype=bool)
    for k in range(K):
        # Only the rows with a k-th replica to add.
        r = np.flatnonzero(ids[:, k] >= 0)
        e = ids[r, k]
        # A gpu holds e if a slot not free holds it (kept, or written in an earlier step).
        free_r = free[r].reshape(-1, B, S)
        holds = ((flat[r].reshape(-1, B, S) == e[:, None, None]) & ~free_r).any(axis=2)
        fits = free_r & ~holds[:, :, None]
        score = np.where(fits, gpu_load[r][:, :, None], np.inf).reshape(r.size, B * S)
        pick = score.argmin(axis=1)
        placed = np.isfinite(score[np.arange(r.size), pick])
        ok[r[~placed]] = False
        r, p, x = r[placed], pick[placed], e[placed]
        flat[r, p] = x
        free[r, p] = False
        gpu_load[r, p // S] += w[r, x]
    ok &= ~free.any(axis=1)
    return flat.reshape(R, B, S), ok


def groups_whole(phy2log: np.ndarray, t: Topology) -> np.ndarray:
    """``[L, P]`` → ``[L]`` bool: every node holds only whole groups, ``num_groups / num_nodes`` of
    them, each expert of those groups at least once (what a hierarchical plan guarantees)."""
    L, N, K, gs = phy2log.shape[0], t.num_nodes, t.num_groups // t.num_nodes, t.experts_per_group
    # Each node's distinct experts, sorted: a group is whole where its run of them is gs long.
    # Sorted rather than an [L * N, E] presence (512 MiB at 128 layers x 512 nodes x 8192 experts).
    # Modulo E: an empty slot (-1) counts as the last expert, as an index would.
    nodes = np.sort(phy2log.reshape(L * N, t.slots_per_node) % t.num_experts, axis=1)
    distinct = np.ones(nodes.shape, dtype=bool)
    distinct[:, 1:] = nodes[:, 1:] != nodes[:, :-1]
    row, col = np.nonzero(distinct)
    group = nodes[row, col] // gs
    starts = np.ones(row.size, dtype=bool)
    starts[1:] = (row[1:] != row[:-1]) | (group[1:] != group[:-1])
    first = np.flatnonzero(starts)
    length = np.diff(np.append(first, row.size))
    runs = np.bincount(row[first], minlength=L * N)
    broken = np.bincount(row[first], weights=length != gs, minlength=L * N)
    ok = (broken == 0) & (runs == K)
    return ok.reshape(L, N).all(axis=1)


def _node_experts(prev: np.ndarray, t: Topology) -> np.ndarray | None:
    """``[L, P]`` → ``[L * N, E/N]``: each node's experts ascending, or ``None`` when some node
    does not hold exactly ``num_groups / num_nodes`` whole groups (not a hierarchical plan)."""
    L, N, K = prev.shape[0], t.num_nodes, t.num_groups // t.num_nodes
    g = np.sort(prev.reshape(L * N, t.slots_per_node) // t.experts_per_group, axis=1)
    first = np.ones_like(g, dtype=bool)
    first[:, 1:] = g[:, 1:] != g[:, :-1]
    if not (first.sum(axis=1) == K).all():
        return None
    groups = g[first].reshape(L * N, K)
    return (groups[:, :, None] * t.experts_per_group + np.arange(t.experts_per_group)).reshape(L * N, -1)


def _to_local(phy: np.ndarray, node_exp: np.ndarray, num_experts: int) -> np.ndarray:
    """Global expert ids ``[R, B, S]`` → positions in each row's ``node_exp`` ``[R, E/N]``."""
    R, E = phy.shape[0], num_experts
    # Rows of ``node_exp`` are ascending, so ``row * E + expert`` is sorted over all rows: one
    # search, not an [R, E] inverse (4 GiB at 128 layers x 512 nodes x 8192 experts).
    # (Stride E + 1 and ids + 1 keep rows apart whatever the ids, -1 included.)
    keys = (np.arange(R, dtype=np.int64)[:, None] * (E + 1) + node_exp + 1).ravel()
    at = np.searchsorted(keys, np.arange(R, dtype=np.int64)[:, None, None] * (E + 1) + phy + 1)
    return at - np.arange(R, dtype=np.int64)[:, None, None] * node_exp.shape[1]
