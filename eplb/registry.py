"""Policies by name, and the one entry point ``rebalance``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import metrics
from .loads import check_loads
from .placement import Placement
from .plan import Plan
from .topology import Topology

__all__ = ["PolicyResult", "Policy", "register_policy", "policies", "get_policy", "rebalance"]


@dataclass(frozen=True)
class PolicyResult:
    """What a policy hands back: ``phy2log`` ``[L, P]`` and optional solver facts."""

    phy2log: np.ndarray
    policy_used: str
    notes: tuple[str, ...] = ()
    solver_status: tuple[str, ...] | None = None
    solver_bound: np.ndarray | None = None
    extra: dict | None = None
    search: object | None = None


class Policy(Protocol):
    def __call__(
        self, loads: np.ndarray, topology: Topology, previous: Placement | None, **options: object
    ) -> PolicyResult: ...


_REGISTRY: dict[str, Policy] = {}


def register_policy(name: str) -> Callable[[Policy], Policy]:
    """Decorator: make ``fn(loads [L, E] float64, topology, previous, **options)`` a policy."""

    def deco(fn: Policy) -> Policy:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return deco


def policies() -> tuple[str, ...]:
    """Names of the registered policies."""
    return tuple(sorted(_REGISTRY))


def get_policy(name: str) -> Policy:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; registered policies: {', '.join(policies())}") from None


def rebalance(
    loads: object,
    topology: Topology,
    policy: str = "auto",
    previous: Placement | None = None,
    **options: object,
) -> Plan:
    """``loads``: ``[L, E]`` expert loads → a :class:`Plan` for ``topology``.

    ``policy`` names a registered policy (``policies()``). ``previous``, the placement in
    service now, makes migration-aware policies keep experts where they are unless moving
    pays, and is what ``Plan.moves`` counts against. Bad input raises ``ValueError``.
    """
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a Topology, got {type(topology).__name__}")
    fn = get_policy(policy)
    arr = check_loads(loads, topology)
    if previous is not None:
        if not isinstance(previous, Placement):
            raise ValueError(f"previous must be a Placement, got {type(previous).__name__}")
        if previous.topology != topology:
            raise ValueError(f"previous placement is for {previous.topology}, not {topology}")
    start = time.perf_counter()
    result = fn(arr, topology, previous, **options)
    seconds = time.perf_counter() - start
    placement = Placement(result.phy2log, topology)
    load = metrics.gpu_loads(arr, placement)
    moves = (
        metrics.moves(previous, placement) if previous is not None else np.zeros(topology.num_layers, dtype=np.int64)
    )
    return Plan(
        placement=placement,
        policy=policy,
        policy_used=result.policy_used,
        imbalance=metrics.imbalance(load),
        imbalance_lb=metrics.imbalance_lb(arr, topology),
        search=result.search,
        balancedness=metrics.balancedness(load),
        moves=moves,
        gpu_load=load,
        solve_seconds=seconds,
        notes=result.notes,
        solver_status=result.solver_status,
        solver_bound=result.solver_bound,
        extra=dict(result.extra or {}),
    )
