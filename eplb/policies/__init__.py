"""The registered policies: ``global``, ``hierarchical``, ``auto`` and ``deepseek``."""

from __future__ import annotations

import numpy as np

from ..placement import Placement
from ..registry import PolicyResult, register_policy
from ..topology import Topology
from .deepseek import deepseek_rebalance
from .hierarchical import place_global, place_hierarchical

__all__: list[str] = []


@register_policy("global")
def _global(loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object) -> PolicyResult:
    return PolicyResult(place_global(loads, topology, **options), "global")


@register_policy("hierarchical")
def _hierarchical(loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object) -> PolicyResult:
    return PolicyResult(place_hierarchical(loads, topology, **options), "hierarchical")


@register_policy("auto")
def _auto(loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object) -> PolicyResult:
    if topology.num_nodes > 1 and topology.hierarchical_ok:
        return PolicyResult(place_hierarchical(loads, topology, **options), "hierarchical")
    notes: tuple[str, ...] = ()
    if topology.num_nodes > 1:
        notes = (
            f"auto: num_groups ({topology.num_groups}) is not a multiple of num_nodes "
            f"({topology.num_nodes}), so groups cannot stay whole on nodes; planned with global",
        )
    return PolicyResult(place_global(loads, topology, **options), "global", notes)


@register_policy("deepseek")
def _deepseek(loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object) -> PolicyResult:
    if options:
        raise ValueError(f"policy 'deepseek' takes no options, got {sorted(options)}")
    t = topology
    phy2log, _, _, hier = deepseek_rebalance(loads, t.num_slots, t.num_groups, t.num_nodes, t.num_gpus)
    notes = () if hier else ("deepseek: num_groups % num_nodes != 0, eplb.py's global fallback ran",)
    return PolicyResult(phy2log.astype(np.int32), "deepseek", notes)
