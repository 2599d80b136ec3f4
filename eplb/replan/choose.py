"""Migration-aware re-planning: keep experts where they are unless moving them pays.

A step waits for the busiest gpu of every layer, so what costs time is the imbalance summed
over layers. A re-plan moves as few slots as it can while the mean imbalance over layers stays
within ``(1 + tolerance)`` of a fresh plan's and no layer goes beyond ``(1 + layer_tolerance)``
of fresh's for that layer (``choose``). Per layer it picks one of these candidates, all
vectorised across layers:
- kept: the current placement as it is (zero moves);
- repaired: the current placement changed only on gpus above the target, by ejection chains
  (``k + 1`` slots for ``k`` gpus above it), rotations (three slots for two), swaps (two for
  one) and count moves (one slot that gives an expert another replica, relieving every gpu
  holding it; see ``eplb.replan.moves`` and ``eplb.planner.counts``), in three orders, the best
  per layer;
- recounted: replica counts first set to the fresh plan's (within each node: water-filling),
  touching only the slots of experts that lose or gain a replica, then repaired;
- regrouped (hierarchical plans): groups swapped between nodes until the busiest node is
  below the target, then recounted and repaired within the nodes;
- replanned: the fresh plan relabelled onto the current one. Gpus of a plan are
  interchangeable (within a node for the hierarchical policy, and nodes among themselves), as
  are slots within a gpu, so each fresh gpu takes the place of the current gpu holding most of
  the same experts and each surviving expert keeps its slot. Balance is the fresh plan's; only
  the slots whose expert really changes move.

Repairs aim at ``(1 + k tolerance)`` of fresh's busiest gpu for k = 0.5, 1 and 3 (where the
layer bound allows); one that falls short is still a candidate. In every candidate an expert
that stays on a gpu keeps its slot.
"""

from __future__ import annotations

import time

import numpy as np

from ..layout import REL_TOL
from ..limits import check_plan_bytes
from ..metrics import gpu_loads, imbalance
from ..placement import Placement
from ..result import ReplanStats
from ..topology import Topology
from .candidates import candidates, groups_whole
from .migration import Migration
from .pick import pick as cheapest
from .pick import pick_within, score

__all__ = ["choose"]


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


# Repair targets above fresh's busiest gpu, in units of the tolerance: the Lagrangian pick gets
# a deeper repair for layers whose balance makes up for others, and a looser, cheaper one
# (measured on drift_bench: adding 0.5 saves 0.9 % of slots per re-plan at v3-prefill drift 0.2).
_TARGETS = (0.5, 1.0, 3.0)

# Without move budgets, a layer (or node) that keeps its replica counts and whose busiest gpu
# is more than this many times a repair target is left unrepaired (the recount and the fresh
# plan aligned still run): from the contiguous first placement (about 4 times) such repairs
# never came within the layer tolerance and their count moves took 60 % of a kimi-64 re-plan.
# In the drift benchmarks they are almost never picked: only at kimi-64's shift (20 steps)
# did skipping them cost anything, 5 slots of 27 328 at the shift, and over the sequence the
# moves fell 0.007 pp and the mean imbalance rose 0.001 pp. Under a move budget any repair may
# be the cheapest step left, so all run.
_GIVE_UP = 2.5

# When move budgets bind: repairs going this share of the way from the current busiest gpu to
# fresh's, the cheaper steps a tight budget can still afford.
_PARTIAL = (0.75, 0.5, 0.25)


def choose(
    loads: np.ndarray,
    previous: Placement,
    fresh: np.ndarray,
    topology: Topology,
    migration: Migration,
    by_node: bool,
    workers: int = 1,
    reference: np.ndarray | None = None,
    deadline: float | None = None,
    quick: bool = False,
) -> tuple[np.ndarray, ReplanStats, tuple[str, ...]]:
    """``loads`` ``[L, E]``, ``fresh`` ``[L, P]`` (a fresh plan) → ``phy2log`` ``[L, P]`` moving as
    few slots from ``previous`` as it can while the mean imbalance over layers stays within
    ``(1 + tolerance)`` of fresh's and every layer's within ``(1 + layer_tolerance)`` of fresh's
    for that layer (``migration``); how many layers took each way; and notes. ``by_node``: the
    fresh plan keeps expert groups whole on nodes (hierarchical), and so must every candidate.

    A step waits for its busiest gpu in every layer, so the sum over layers is what costs time:
    moves go where they buy the most balance. Each layer picks one candidate (kept, the
    repairs of ``repair_previous`` aiming at ``(1 + 0.5 tolerance)``, ``(1 + tolerance)`` and
    ``(1 + 3 tolerance)`` of fresh's busiest gpu, or fresh aligned onto ``previous``); the pick
    minimises ``moves + lambda * imbalance`` per layer, with the smallest ``lambda`` that meets
    the mean, then cheaper candidates are taken greedily while the mean allows. Ties go to the
    earlier candidate, so a layer keeps its placement when that is as good.

    Move budgets are hard limits, the tolerances goals: no layer rewrites more than
    ``max_layer_moves`` slots and the re-plan no more than ``max_moves`` in all. When they
    stop the tolerances from being met, repairs that go only part of the way from the current
    busiest gpu to fresh's (a quarter, half, three quarters) join the candidates and the pick
    turns round: the lowest mean imbalance the budgets allow (``budget_limited`` in the result).

    ``workers`` > 1: that many processes make the candidates, each for a share of the layers
    (a layer's candidates depend on that layer alone); only the pick, which couples layers
    through the mean and ``max_moves``, runs here. The result is the same for any ``workers``.

    ``reference`` ``[L]``: the imbalance to measure against per layer in place of ``fresh``'s
    (``eplb.replan.fresh``: the bound plus the search's gap where ``fresh`` is a first plan
    near it); ``fresh`` stays the candidate and the source of replica counts.

    ``deadline`` (a ``time.perf_counter()`` value, the caller's time limit): repairs stop where
    they got to when their next round would pass it, and none start past it (nor the partial
    repairs of a binding move budget); kept and fresh aligned are always candidates, so the
    pick still meets the tolerances and the move budgets, with more moves.

    ``quick``: the repairs aim at ``(1 + tolerance)`` of fresh's busiest gpu alone, in the
    orders and with the count moves of ``candidates(quick=True)`` (a survivor plan at
    ``effort="fast"``, where the previous placement lost slots and the time is what counts).

    Raises ``ValueError`` when ``eplb.limits.plan_bytes(topology, replan=True)`` is above
    ``eplb.limits.max_plan_bytes()``, before the candidates are made.
    """
    check_plan_bytes(topology, replan=True)
    # No placement's imbalance exceeds num_gpus and a fresh plan's is >= 1, so a tolerance of
    # num_gpus - 1 already allows every placement; capping there keeps the repair targets
    # ((1 + k tolerance) x the busiest gpu's load) finite for any tolerance, inf included.
    most = float(topology.num_gpus - 1)
    tolerance, layer_tolerance = min(migration.tolerance, most), min(migration.layer_tolerance, most)
    max_moves, max_layer_moves = migration.max_moves, migration.max_layer_moves
    old = previous.phy2log
    L = topology.num_layers
    fresh_load = gpu_loads(loads, Placement(fresh, topology))
    fresh_imb, fresh_max = imbalance(fresh_load), fresh_load.max(axis=1)
    if reference is not None:
        # The yardstick in place of the fresh plan's imbalance (eplb.replan.fresh), in gpu load.
        fresh_imb = np.asarray(reference, dtype=np.float64)
        fresh_max = fresh_imb * fresh_load.mean(axis=1)
    kept_load = gpu_loads(loads, previous)
    keep_imb = imbalance(kept_load)
    budget = (1.0 + tolerance) * fresh_imb.sum() * (1 + REL_TOL)
    cap = (1.0 + layer_tolerance) * fresh_imb * (1 + REL_TOL)
    # A hierarchical plan keeps every group whole on one node; a previous placement that does
    # not (e.g. the contiguous first version) cannot be kept or repaired within nodes, so
    # those layers take the fresh plan aligned onto it.
    whole = groups_whole(old, topology) if by_node and topology.num_nodes > 1 else np.ones(L, dtype=bool)
    notes: tuple[str, ...] = ()
    cut = False
    if not whole.all():
        names, cands, imb, moves, _ = candidates(loads, old, fresh, topology, [], by_node, True, workers)
    elif keep_imb.sum() > budget or (keep_imb > cap).any():
        # Repairs aim at (1 + k * tolerance) of fresh for each k of _TARGETS that a layer may go
        # to: deeper ones make up for layers left cheaper.
        ks = [k for k in _TARGETS if k == 1.0 or (not quick and tolerance > 0 and k * tolerance <= layer_tolerance)]
        targets = [(1.0 + k * tolerance) * fresh_max for k in ks]
        give_up = _GIVE_UP if max_moves is None and max_layer_moves is None else None
        if _past(deadline):
            targets = []
            notes += (
                "time_limit: no time was left to repair the previous placement; layers kept it or took the fresh plan",
            )
        names, cands, imb, moves, cut = candidates(
            loads, old, fresh, topology, targets, by_node, True, workers, give_up, not quick, deadline, quick
        )
    else:
        names, cands, imb, moves = score([("kept", old)], loads, old, topology)
    if not whole.all():
        # Only the fresh plan keeps groups whole there: no move budget can hold it back.
        pick = np.where(whole, pick_within(moves, imb, cap, budget, max_layer_moves), len(names) - 1)
        return _result(
            names, cands, pick, imb, moves, fresh_imb, tolerance, max_moves, max_layer_moves, False, whole, notes
        )
    pick = pick_within(moves, imb, cap, budget, max_layer_moves)
    cols = np.arange(L)
    limited = False
    if max_moves is not None or max_layer_moves is not None:
        missed = imb[pick, cols].sum() > budget or (imb[pick, cols] > cap).any()
        if missed or (max_moves is not None and moves[pick, cols].sum() > max_moves):
            if _past(deadline):
                notes += ("time_limit: no time was left for the partial repairs a binding move budget takes",)
            else:
                # Budgets bind: partial repairs are the cheap steps a tight budget can still take.
                kept_max = kept_load.max(axis=1)
                targets = [
                    np.maximum(fresh_max + f * (kept_max - fresh_max), (1.0 + tolerance) * fresh_max) for f in _PARTIAL
                ]
                # Only the order that starts with count moves, a third of the work: on these
                # shallow targets it gave the same rows as the best of three on 74-97 % of the
                # rows and 0.1-2.1 % more slots in all (drift_bench sequences with a 5 % budget,
                # 5 steps).
                more = candidates(
                    loads, old, fresh, topology, targets, by_node, False, workers, every_order=False, deadline=deadline
                )
                # Fresh aligned stays last.
                names = names[:-1] + more.names + names[-1:]
                cands, imb, moves = (
                    np.concatenate([x[:-1], y, x[-1:]])
                    for x, y in zip((cands, imb, moves), (more.cands, more.imb, more.moves))
                )
                cut |= more.cut
                pick = pick_within(moves, imb, cap, budget, max_layer_moves)
            if max_moves is not None and moves[pick, cols].sum() > max_moves:
                fits = np.ones_like(moves, dtype=bool) if max_layer_moves is None else moves <= max_layer_moves
                fits[0] = True  # kept: no moves
                pick = cheapest(np.where(fits, imb, np.inf), moves, max_moves)
            limited = True
    if cut:
        notes += (
            "time_limit stopped the repairs of the previous placement early: layers took them as far as they got",
        )
    return _result(
        names, cands, pick, imb, moves, fresh_imb, tolerance, max_moves, max_layer_moves, limited, whole, notes
    )


def _result(
    names: list[str],
    cands: np.ndarray,
    pick: np.ndarray,
    imb: np.ndarray,
    moves: np.ndarray,
    fresh_imb: np.ndarray,
    tolerance: float,
    max_moves: int | None,
    max_layer_moves: int | None,
    limited: bool,
    whole: np.ndarray,
    notes: tuple[str, ...] = (),
) -> tuple[np.ndarray, ReplanStats, tuple[str, ...]]:
    """The picked candidate per layer, how many layers took each way, and notes (after
    ``notes``)."""
    cols = np.arange(pick.size)
    out = cands[pick, cols]
    taken = dict.fromkeys(("kept", "repaired", "recounted", "regrouped", "replanned"), 0)
    for i, name in enumerate(names):
        taken[name] += int((pick == i).sum())
    stats = ReplanStats(**{f"layers_{n}": v for n, v in taken.items()}, budget_limited=bool(limited))
    if not whole.all():
        notes += (
            f"previous placement splits expert groups across nodes in {int((~whole).sum())} layers: "
            "those layers take the fresh hierarchical plan, whatever the move budget",
        )
    if limited:
        got = imb[pick, cols]
        notes += (
            f"move budget (max_moves={max_moves}, max_layer_moves={max_layer_moves}) held the re-plan to "
            f"{int(moves[pick, cols].sum())} moves: mean imbalance {got.mean():.4f} against "
            f"{(1 + tolerance) * fresh_imb.mean():.4f} allowed by the tolerance (fresh plan {fresh_imb.mean():.4f})",
        )
    return out, stats, notes
