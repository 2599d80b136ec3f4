"""The registered policies: ``global``, ``hierarchical``, ``auto``, ``deepseek`` and ``ilp``.

``global``, ``hierarchical`` and ``auto`` plan with ``eplb.planner`` and take its
``PlanOptions``; they are registered with ``replans=True``, so ``rebalance`` makes their plans
migration-aware from ``previous=``. ``deepseek`` is eplb.py bit for bit and takes no options;
``ilp`` (``eplb.policies.ilp``) is the exact reference.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..bounds import group_bound
from ..loads import check_layer_sums
from ..metrics import gpu_loads, imbalance
from ..placement import Placement
from ..planner.anytime import PlanOptions, flat_topology, plan_placement
from ..registry import PolicyResult, register_policy
from ..result import SearchStats
from ..topology import Topology
from .deepseek import FLOAT32_LAYER_SUM, deepseek_rebalance

__all__ = ["AUTO_TOLERANCE"]


def _search_notes(stats: SearchStats) -> tuple[str, ...]:
    # No figure: a re-plan's fresh plan searches for a share of the caller's limit.
    if stats.first_plan_over:
        return (
            "time_limit ran out during the first plan, which always runs whole: this plan took longer "
            "than the limit and is the first plan without a search after it",
        )
    if stats.timed_out and stats.work == 0:
        return ("time_limit left no time for a search after the first plan",)
    if stats.timed_out:
        return ("time_limit stopped the search after the first plan early",)
    return ()


def _replicate_and_pack(
    loads: np.ndarray, topology: Topology, by_node: bool, name: str, opts: PlanOptions, deadline: float | None = None
) -> PolicyResult:
    phy2log, stats = plan_placement(loads, topology if by_node else flat_topology(topology), opts, deadline)
    return PolicyResult(phy2log, name, _search_notes(stats), groups_on_nodes=by_node, search=stats)


def _from_first(
    loads: np.ndarray,
    topology: Topology,
    by_node: bool,
    name: str,
    opts: PlanOptions,
    deadline: float | None,
    first: np.ndarray,
    took: float,
) -> PolicyResult:
    """``name``'s plan for ``opts`` when its first plan ``first`` ``[L, P]`` is already made (in
    ``took`` seconds): that plan itself where nothing would follow it (``effort="fast"``, or
    less than ``took`` left to ``deadline``: making the first plan again would use it all),
    else the whole plan (which makes the first plan again: a plan's layers search in chunks,
    each from its own first plan, in this process or a worker)."""
    now = time.perf_counter()
    short = deadline is not None and now + took >= deadline
    if opts.effort != "fast" and not short:
        return _replicate_and_pack(loads, topology, by_node, name, opts, deadline)
    over = deadline is not None and now >= deadline
    stats = SearchStats(timed_out=(short and opts.effort != "fast") or over, first_plan_over=over)
    return PolicyResult(first, name, _search_notes(stats), groups_on_nodes=by_node, search=stats)


@register_policy("global", options=PlanOptions, replans=True)
def _global(loads: np.ndarray, topology: Topology, options: PlanOptions) -> PolicyResult:
    return _replicate_and_pack(loads, topology, False, "global", options)


@register_policy("hierarchical", options=PlanOptions, replans=True)
def _hierarchical(loads: np.ndarray, topology: Topology, options: PlanOptions) -> PolicyResult:
    return _replicate_and_pack(loads, topology, True, "hierarchical", options)


# auto keeps hierarchical (a token's experts on few nodes) while its first plan's mean
# imbalance is within this fraction of global's; beyond it the busiest gpu costs more than the
# saved inter-node traffic (README's example: 1.070 hierarchical against 1.001 global).
AUTO_TOLERANCE = 0.02


@register_policy("auto", options=PlanOptions, replans=True)
def _auto(loads: np.ndarray, topology: Topology, options: PlanOptions) -> PolicyResult:
    t = topology
    # The time limit covers the comparison too: the chosen plan searches until it ends.
    start = time.perf_counter()
    deadline = None if options.time_limit is None else start + float(options.time_limit)
    if t.num_nodes > 1 and t.num_groups > 1 and t.hierarchical_ok:
        # Group-limited routing: compare the first plans (cheap), then plan the one chosen in full.
        # They run whole, as first plans do, also under a time limit.
        quick = dataclasses.replace(options, effort="fast", workers=1, time_limit=None)
        flat, _ = plan_placement(loads, flat_topology(t), quick, phase="global's first plan, to compare")
        took = {"global": time.perf_counter() - start}
        g = float(imbalance(gpu_loads(loads, Placement(flat, t))).mean())
        # Where no grouping of experts onto nodes can come within the tolerance of global's first
        # plan, hierarchical's first plan cannot either: skip it (v3-prefill lognormal 1.0: the
        # bound is 1.06 against 1.001, and the first plan cost a third of auto's fast plan).
        mean = loads.sum(axis=1) / t.num_gpus
        hb = float(np.divide(group_bound(loads, t), mean, out=np.ones_like(mean), where=mean > 0).mean())
        if hb > g * (1 + AUTO_TOLERANCE) * (1 + 1e-9):
            h, hier = hb, None
        else:
            half = time.perf_counter()
            hier, _ = plan_placement(loads, t, quick, phase="hierarchical's first plan, to compare")
            took["hierarchical"] = time.perf_counter() - half
            h = float(imbalance(gpu_loads(loads, Placement(hier, t))).mean())
        if hier is not None and h <= g * (1 + AUTO_TOLERANCE):
            res = _from_first(loads, t, True, "hierarchical", options, deadline, hier, took["hierarchical"])
            note = (
                f"auto: groups fit nodes and hierarchical's first plan ({h:.4f}) is within "
                f"{AUTO_TOLERANCE:.0%} of global's ({g:.4f}); planned with hierarchical",
            )
            return dataclasses.replace(res, notes=note + res.notes)
        what = "first plan" if hier is not None else "grouping bound (no placement with groups on nodes is better)"
        why: tuple[str, ...] = (
            f"auto: hierarchical's {what} ({h:.4f}) is more than {AUTO_TOLERANCE:.0%} above global's "
            f"({g:.4f}); planned with global (tokens may reach more nodes)",
        )
        res = _from_first(loads, t, False, "global", options, deadline, flat, took["global"])
        return dataclasses.replace(res, notes=why + res.notes)
    elif t.num_nodes > 1 and t.num_groups > 1:
        why = (
            f"auto: num_groups ({t.num_groups}) is not a multiple of num_nodes ({t.num_nodes}), so groups "
            "cannot stay whole on nodes; planned with global",
        )
    elif t.num_nodes > 1:
        why = ("auto: one expert group, so routing is not group-limited; planned with global",)
    else:
        why = ()
    res = _replicate_and_pack(loads, t, False, "global", options, deadline)
    return dataclasses.replace(res, notes=why + res.notes)


@register_policy("deepseek")
def _deepseek(loads: np.ndarray, topology: Topology, options: None) -> PolicyResult:
    check_layer_sums(loads, FLOAT32_LAYER_SUM, "loads", "policy 'deepseek' computes in float32 as eplb.py does")
    t = topology
    phy2log, _, _, hier = deepseek_rebalance(
        loads, t.num_slots, t.num_groups, t.num_nodes, t.num_gpus, exact_ranks=False
    )
    notes = () if hier else ("deepseek: num_groups % num_nodes != 0, eplb.py's global fallback ran",)
    return PolicyResult(phy2log.astype(np.int32), "deepseek", notes)


from . import ilp  # noqa: E402,F401  (registers "ilp"; OR-Tools is imported lazily)
