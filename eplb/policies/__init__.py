"""The registered policies: ``global``, ``hierarchical``, ``auto``, ``deepseek`` and ``ilp``.

``global``, ``hierarchical`` and ``auto`` plan with ``eplb.place`` and take its
``PlanOptions``; they are registered with ``replans=True``, so ``rebalance`` makes their plans
migration-aware from ``previous=``. ``deepseek`` is eplb.py bit for bit and takes no options;
``ilp`` (``eplb.policies.ilp``) is the exact reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..bounds import group_bound
from ..loads import check_layer_sums
from ..metrics import gpu_loads, imbalance
from ..place.anytime import PlanOptions, flat_topology, plan_placement
from ..placement import Placement
from ..plan import SearchStats
from ..registry import PolicyResult, register_policy
from ..topology import Topology
from .deepseek import FLOAT32_LAYER_SUM, deepseek_rebalance

__all__ = ["AUTO_TOLERANCE"]


def _search_notes(stats: SearchStats, opts: PlanOptions) -> tuple[str, ...]:
    if stats.timed_out:
        return (f"time_limit ({opts.time_limit} s) stopped the search after the first plan early",)
    return ()


def _replicate_and_pack(
    loads: np.ndarray, topology: Topology, by_node: bool, name: str, opts: PlanOptions
) -> PolicyResult:
    phy2log, stats = plan_placement(loads, topology if by_node else flat_topology(topology), opts)
    return PolicyResult(phy2log, name, _search_notes(stats, opts), groups_on_nodes=by_node, search=stats)


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
    if t.num_nodes > 1 and t.num_groups > 1 and t.hierarchical_ok:
        # Group-limited routing: compare the first plans (cheap), then plan the one chosen in full.
        quick = dataclasses.replace(options, effort="fast", workers=1, time_limit=None)
        flat, flat_stats = plan_placement(loads, flat_topology(t), quick)
        g = float(imbalance(gpu_loads(loads, Placement(flat, t))).mean())
        # Where no grouping of experts onto nodes can come within the tolerance of global's first
        # plan, hierarchical's first plan cannot either: skip it (v3-prefill lognormal 1.0: the
        # bound is 1.06 against 1.001, and the first plan cost a third of auto's fast plan).
        mean = loads.sum(axis=1) / t.num_gpus
        hb = float(np.divide(group_bound(loads, t), mean, out=np.ones_like(mean), where=mean > 0).mean())
        if hb > g * (1 + AUTO_TOLERANCE) * (1 + 1e-9):
            h, hier = hb, None
        else:
            hier, hier_stats = plan_placement(loads, t, quick)
            h = float(imbalance(gpu_loads(loads, Placement(hier, t))).mean())
        if hier is not None and h <= g * (1 + AUTO_TOLERANCE):
            note = (
                f"auto: groups fit nodes and hierarchical's first plan ({h:.4f}) is within "
                f"{AUTO_TOLERANCE:.0%} of global's ({g:.4f}); planned with hierarchical",
            )
            if options.effort == "fast":  # the first plan is the plan
                res = PolicyResult(hier, "hierarchical", groups_on_nodes=True, search=hier_stats)
            else:
                res = _hierarchical(loads, t, options)
            return dataclasses.replace(res, notes=note + res.notes)
        what = "first plan" if hier is not None else "grouping bound (no placement with groups on nodes is better)"
        why = (
            f"auto: hierarchical's {what} ({h:.4f}) is more than {AUTO_TOLERANCE:.0%} above global's "
            f"({g:.4f}); planned with global (tokens may reach more nodes)",
        )
        if options.effort == "fast":
            return PolicyResult(flat, "global", why, groups_on_nodes=False, search=flat_stats)
    elif t.num_nodes > 1 and t.num_groups > 1:
        why = (
            f"auto: num_groups ({t.num_groups}) is not a multiple of num_nodes ({t.num_nodes}), so groups "
            "cannot stay whole on nodes; planned with global",
        )
    elif t.num_nodes > 1:
        why = ("auto: one expert group, so routing is not group-limited; planned with global",)
    else:
        why = ()
    res = _global(loads, t, options)
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
