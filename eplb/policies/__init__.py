"""The registered policies: ``global``, ``hierarchical``, ``auto`` and ``deepseek``."""

from __future__ import annotations

import numpy as np

from ..loads import check_layer_sums
from ..metrics import gpu_loads, imbalance
from ..migration import choose
from ..placement import Placement
from ..registry import PolicyResult, register_policy
from ..topology import Topology
from .deepseek import FLOAT32_LAYER_SUM, deepseek_rebalance
from .hierarchical import SearchStats, flat_topology, plan_placement

__all__: list[str] = []


# Defaults for re-planning with `previous=` (bench/drift_bench.py measures the trade-off): the
# mean imbalance over layers may exceed a fresh plan's by 1 %, any one layer's by 5 %.
DEFAULT_TOLERANCE = 0.01
DEFAULT_LAYER_TOLERANCE = 0.05


# Options that shape a re-plan from `previous=` rather than the fresh plan.
MIGRATION_OPTIONS = ("tolerance", "layer_tolerance", "max_moves", "max_layer_moves")


def _migration_options(options: dict) -> dict:
    """The re-plan options with defaults filled in, checked whether or not ``previous=`` is given
    (a caller that passes them on every call learns of a bad value on the first plan)."""
    out: dict = {}
    for name, default in (("tolerance", DEFAULT_TOLERANCE), ("layer_tolerance", DEFAULT_LAYER_TOLERANCE)):
        value = options.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0 (a fraction, 0.01 = 1 %), got {value!r}")
        out[name] = float(value)
    for name in ("max_moves", "max_layer_moves"):
        value = options.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0):
            raise ValueError(f"{name} must be an integer >= 0 (slots rewritten) or None (no limit), got {value!r}")
        out[name] = None if value is None else int(value)
    return out


def _migration_aware(
    phy2log: np.ndarray,
    loads: np.ndarray,
    topology: Topology,
    previous: Placement | None,
    by_node: bool,
    mig: dict,
    workers: int = 1,
) -> tuple[np.ndarray, dict, tuple[str, ...]]:
    """Fresh ``phy2log`` ``[L, P]`` → what to publish given ``previous`` (see eplb.migration), how
    many layers took each way, and notes. ``mig``: checked ``_migration_options``; ``workers``:
    processes making the layers' candidates."""
    if previous is None:
        return phy2log, {}, ()
    # No placement's imbalance exceeds num_gpus and a fresh plan's is >= 1, so a tolerance of
    # num_gpus - 1 already allows every placement; capping there keeps the repair targets
    # ((1 + k tolerance) x the busiest gpu's load) finite for any tolerance, inf included.
    most = float(topology.num_gpus - 1)
    tol, layer_tol = min(mig["tolerance"], most), min(mig["layer_tolerance"], most)
    return choose(
        loads,
        previous,
        phy2log,
        topology,
        tol,
        layer_tol,
        by_node,
        max_moves=mig["max_moves"],
        max_layer_moves=mig["max_layer_moves"],
        workers=workers,
    )


def _split(options: dict) -> tuple[dict, dict]:
    """Options → (the fresh plan's, checked re-plan options)."""
    migration = {k: options[k] for k in MIGRATION_OPTIONS if k in options}
    return {k: v for k, v in options.items() if k not in migration}, _migration_options(migration)


def _search_notes(stats: SearchStats, opts: dict) -> tuple[str, ...]:
    notes = []
    if stats.timed_out:
        notes.append(f"time_limit ({opts.get('time_limit')} s) stopped the search after the first plan early")
    return tuple(notes)


def _replicate_and_pack(
    loads: np.ndarray, topology: Topology, previous: Placement | None, by_node: bool, name: str, options: dict
) -> PolicyResult:
    opts, mig = _split(options)
    fresh, stats = plan_placement(loads, topology if by_node else flat_topology(topology), **opts)
    phy2log, extra, notes = _migration_aware(
        fresh, loads, topology, previous, by_node, mig, int(opts.get("workers", 1))
    )
    return PolicyResult(phy2log, name, _search_notes(stats, opts) + notes, extra=extra, search=stats)


@register_policy("global")
def _global(loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object) -> PolicyResult:
    return _replicate_and_pack(loads, topology, previous, False, "global", options)


@register_policy("hierarchical")
def _hierarchical(loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object) -> PolicyResult:
    return _replicate_and_pack(loads, topology, previous, True, "hierarchical", options)


# auto keeps hierarchical (a token's experts on few nodes) while its first plan's mean
# imbalance is within this fraction of global's; beyond it the busiest gpu costs more than the
# saved inter-node traffic (README's example: 1.070 hierarchical against 1.001 global).
AUTO_TOLERANCE = 0.02


@register_policy("auto")
def _auto(loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object) -> PolicyResult:
    t = topology
    if t.num_nodes > 1 and t.num_groups > 1 and t.hierarchical_ok:
        # Group-limited routing: compare the first plans (cheap), then plan the one chosen in full.
        opts, _ = _split(options)
        quick = {**opts, "effort": "fast", "workers": 1, "time_limit": None}
        hier, _ = plan_placement(loads, t, **quick)
        flat, _ = plan_placement(loads, flat_topology(t), **quick)
        h = float(imbalance(gpu_loads(loads, Placement(hier, t))).mean())
        g = float(imbalance(gpu_loads(loads, Placement(flat, t))).mean())
        if h <= g * (1 + AUTO_TOLERANCE):
            res = _hierarchical(loads, t, previous, **options)
            note = (
                f"auto: groups fit nodes and hierarchical's first plan ({h:.4f}) is within "
                f"{AUTO_TOLERANCE:.0%} of global's ({g:.4f}); planned with hierarchical",
            )
            return PolicyResult(res.phy2log, "hierarchical", note + res.notes, extra=res.extra, search=res.search)
        why = (
            f"auto: hierarchical's first plan ({h:.4f}) is more than {AUTO_TOLERANCE:.0%} above global's "
            f"({g:.4f}); planned with global (tokens may reach more nodes)",
        )
    elif t.num_nodes > 1 and t.num_groups > 1:
        why = (
            f"auto: num_groups ({t.num_groups}) is not a multiple of num_nodes ({t.num_nodes}), so groups "
            "cannot stay whole on nodes; planned with global",
        )
    elif t.num_nodes > 1:
        why = ("auto: one expert group, so routing is not group-limited; planned with global",)
    else:
        why = ()
    res = _global(loads, t, previous, **options)
    return PolicyResult(res.phy2log, "global", why + res.notes, extra=res.extra, search=res.search)


@register_policy("deepseek")
def _deepseek(loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object) -> PolicyResult:
    if options:
        raise ValueError(f"policy 'deepseek' takes no options, got {sorted(options)}")
    check_layer_sums(loads, FLOAT32_LAYER_SUM, "loads", "policy 'deepseek' computes in float32 as eplb.py does")
    t = topology
    phy2log, _, _, hier = deepseek_rebalance(
        loads, t.num_slots, t.num_groups, t.num_nodes, t.num_gpus, exact_ranks=False
    )
    notes = () if hier else ("deepseek: num_groups % num_nodes != 0, eplb.py's global fallback ran",)
    return PolicyResult(phy2log.astype(np.int32), "deepseek", notes)


from . import ilp  # noqa: E402,F401  (registers "ilp"; OR-Tools is imported lazily)
