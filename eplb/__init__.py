"""eplb: expert-parallel load balancing for mixture-of-experts inference.

``rebalance(loads [L, E], topology, policy="auto", previous=None, **options) -> Plan``
is the entry point; ``policies()`` lists what ``policy`` accepts and ``get_policy(name)``
what it is (its options, whether it re-plans migration-aware). The library's rooms:
``eplb.planner`` (the anytime planner and its steps), ``eplb.replan`` (re-planning from
a previous placement), ``eplb.bounds`` (every lower bound), ``eplb.layout`` (the
``[rows, gpus, slots]`` arrays the steps share), ``eplb.policies`` (the registered policies),
``eplb.survivors`` (plans with gpus down: ``rebalance(..., down_gpus=[...])``), ``eplb.progress`` (what
``rebalance(..., progress=callback)`` reports as layers finish), ``eplb.limits`` (the most memory
a plan may need, ``set_max_plan_bytes``). The tool modules
(``eplb.workloads``, ``eplb.transfer``, ``eplb.compat``, ``eplb.kernel``, ``eplb.timing``, ...) load on
first use. ``eplb.__version__`` is the installed release (package metadata).
"""

import importlib

from . import policies as _policies  # noqa: F401  (registers the built-in policies)
from .limits import set_max_plan_bytes
from .metrics import balancedness, gpu_loads, imbalance, imbalance_lb, lower_bound, moves
from .placement import Placement
from .planner.anytime import EFFORTS as _EFFORTS
from .planner.anytime import PlanOptions
from .progress import Progress
from .registry import (
    PolicyError,
    PolicyResult,
    PolicySpec,
    get_policy,
    policies,
    rebalance,
    register_policy,
    unregister_policy,
)
from .replan.migration import Migration
from .result import Plan, ReplanStats, SearchStats, SolverStats
from .topology import Topology

EFFORTS: tuple[str, ...] = _EFFORTS
"""What ``effort`` (``rebalance(..., effort=...)``, ``PlanOptions.effort``) accepts: ``"fast"``
the first plan only, ``"default"`` then the anytime search, ``"high"`` a wider search with four
times the work."""

__all__ = [
    "Topology",
    "Placement",
    "Plan",
    "PolicyError",
    "PolicyResult",
    "PolicySpec",
    "PlanOptions",
    "EFFORTS",
    "Migration",
    "Progress",
    "SearchStats",
    "ReplanStats",
    "SolverStats",
    "rebalance",
    "policies",
    "get_policy",
    "register_policy",
    "unregister_policy",
    "gpu_loads",
    "imbalance",
    "balancedness",
    "lower_bound",
    "imbalance_lb",
    "moves",
    "set_max_plan_bytes",
    # Public modules: what the docs teach (kernel models, timing, the transfer schedule, the
    # workloads, the simulator, bounds, limits, file formats, traces, eplb.py's own face).
    "bounds",
    "compat",
    "formats",
    "kernel",
    "limits",
    "simulate",
    "timing",
    "traces",
    "transfer",
    "workloads",
]

# Modules reachable as eplb.<name> after `import eplb`, loaded on first access: imported eagerly
# they added 10-30 ms to the ~110 ms of `import eplb` (python -X importtime, shared 2-core VM),
# which every engine rank pays at start-up.
_LAZY = ("compat", "formats", "kernel", "simulate", "timing", "traces", "transfer", "workloads")


def __getattr__(name: str) -> object:
    if name == "__version__":
        # Read on first use: importlib.metadata costs `import eplb` several ms.
        from .survivor_rules import EPLB_VERSION

        return EPLB_VERSION
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "__version__"})
