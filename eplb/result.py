"""What ``rebalance`` returns: a placement and how good it is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .placement import Placement

__all__ = ["Plan", "SearchStats", "ReplanStats", "SolverStats"]


@dataclass(frozen=True)
class SearchStats:
    """What the anytime search after the first plan did: ``work`` units spent,
    ``layers_searched`` (layers not within ``gap`` of their bound after the first plan),
    ``layers_at_bound`` (within ``gap`` of their bound at the end, counted by the search: 0 with
    ``effort="fast"``, where none runs; ``Plan.imbalance`` against ``Plan.imbalance_lb`` tells
    for any plan), whether ``time_limit`` cut it short
    (``timed_out``) and whether the first plan alone ran past the limit (``first_plan_over``:
    the first plan always runs whole, so the plan took longer than the limit)."""

    work: float = 0.0
    layers_searched: int = 0
    layers_at_bound: int = 0
    timed_out: bool = False
    first_plan_over: bool = False

    def __add__(self, other: SearchStats) -> SearchStats:
        return SearchStats(
            self.work + other.work,
            self.layers_searched + other.layers_searched,
            self.layers_at_bound + other.layers_at_bound,
            self.timed_out or other.timed_out,
            self.first_plan_over or other.first_plan_over,
        )


@dataclass(frozen=True)
class ReplanStats:
    """How a migration-aware re-plan (``previous=``) treated the layers: how many kept the
    previous placement as it was, took a repair of it (``repaired``; ``recounted``: replica
    counts reset first; ``regrouped``: expert groups swapped between nodes first) or the fresh
    plan relabelled onto it (``replanned``); ``budget_limited``: a move budget (``max_moves``,
    ``max_layer_moves``) held the re-plan above its imbalance tolerance."""

    layers_kept: int = 0
    layers_repaired: int = 0
    layers_recounted: int = 0
    layers_regrouped: int = 0
    layers_replanned: int = 0
    budget_limited: bool = False

    def layers(self) -> dict[str, int]:
        """Layers per way, by name (``"kept"``, ``"repaired"``, ...)."""
        return {
            "kept": self.layers_kept,
            "repaired": self.layers_repaired,
            "recounted": self.layers_recounted,
            "regrouped": self.layers_regrouped,
            "replanned": self.layers_replanned,
        }


@dataclass(frozen=True, eq=False)
class SolverStats:
    """What an exact solver (the ``ilp`` policy) reported per layer: ``status`` (CP-SAT's, e.g.
    ``"OPTIMAL"``), ``bound`` ``[L]`` (proven lower bound on the busiest gpu's load),
    ``objective`` ``[L]`` (the busiest gpu's load it reached, in its units), ``seconds`` ``[L]``
    and ``method`` (``"enumeration"``, ``"cp-sat"`` or ``"out of time"``)."""

    status: tuple[str, ...]
    bound: np.ndarray
    objective: np.ndarray
    seconds: np.ndarray
    method: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Plan:
    """A placement plus per-layer figures, all ``[L]`` arrays.

    - ``imbalance``: max / mean gpu load under the loads it was planned for (1.0 is perfect);
    - ``imbalance_lb``: the lower bound over mean gpu load, no placement can go below it;
    - ``balancedness``: mean / max gpu load, what vLLM and SGLang log;
    - ``moves``: slots whose expert differs from ``previous`` (zeros without one);
    - ``gpu_load``: ``[L, G]`` tokens per gpu (NaN for a down gpu: absent).
    ``single_homed`` and ``single_node`` count the experts at risk when one gpu (one node) fails.
    ``policy`` is the policy asked for, ``policy_used`` what ran (``auto`` resolves to one),
    ``notes`` say why (e.g. a fallback). Typed facts, ``None`` where they do not apply:
    ``search`` (``SearchStats``: what the anytime search after the first plan did), ``replan``
    (``ReplanStats``: how a migration-aware re-plan treated the layers) and ``solver``
    (``SolverStats``: an exact solver's status and bound per layer; ``solver_status`` and
    ``solver_bound`` read it). ``predicted_ms``: with ``kernel_curve=``, the expected MoE
    milliseconds per step (summed over layers) at each planned tokens-per-gpu batch size.
    """

    placement: Placement
    policy: str
    policy_used: str
    imbalance: np.ndarray
    imbalance_lb: np.ndarray
    balancedness: np.ndarray
    moves: np.ndarray
    gpu_load: np.ndarray
    solve_seconds: float
    notes: tuple[str, ...] = ()
    search: SearchStats | None = None
    replan: ReplanStats | None = None
    solver: SolverStats | None = None
    predicted_ms: dict[int, float] | None = None

    @property
    def solver_status(self) -> tuple[str, ...] | None:
        return None if self.solver is None else self.solver.status

    @property
    def solver_bound(self) -> np.ndarray | None:
        return None if self.solver is None else self.solver.bound

    @property
    def phy2log(self) -> np.ndarray:
        return self.placement.phy2log

    @property
    def log2phy(self) -> np.ndarray:
        return self.placement.log2phy

    @property
    def logcnt(self) -> np.ndarray:
        return self.placement.logcnt

    @property
    def down_gpus(self) -> tuple[int, ...]:
        """The gpus the plan leaves empty (``rebalance(..., down_gpus=...)``)."""
        return self.placement.down_gpus

    @property
    def single_homed(self) -> np.ndarray:
        """int64 ``[L]``: experts with exactly one replica (lost if that gpu fails)."""
        return (self.placement.logcnt == 1).sum(axis=1)

    @property
    def single_node(self) -> np.ndarray | None:
        """int64 ``[L]``: experts whose every replica is on one node (lost if that node fails);
        ``None`` with one node."""
        topo = self.placement.topology
        if topo.num_nodes == 1:
            return None
        l2p = self.placement.log2phy
        node = np.where(l2p >= 0, l2p // topo.slots_per_node, -1)
        return ((node == node[:, :, :1]) | (node < 0)).all(axis=2).sum(axis=1)

    @property
    def mean_imbalance(self) -> float:
        return float(self.imbalance.mean())

    @property
    def max_imbalance(self) -> float:
        return float(self.imbalance.max())

    @property
    def total_moves(self) -> int:
        return int(self.moves.sum())

    def __repr__(self) -> str:
        """A summary on one line (the arrays are ``[L]`` and ``[L, P]``: printed whole, a plan
        of 58 layers ran to hundreds of lines): shape, policy, imbalance, moves, time."""
        t = self.placement.topology
        policy = self.policy if self.policy == self.policy_used else f"{self.policy} -> {self.policy_used}"
        down = f", gpus down {list(self.down_gpus)}" if self.down_gpus else ""
        notes = f", {len(self.notes)} note{'s' if len(self.notes) > 1 else ''}" if self.notes else ""

        def n(count: int, noun: str) -> str:
            return f"{count} {noun}" if count == 1 else f"{count} {noun}s"

        return (
            f"Plan({n(t.num_layers, 'layer')} x {n(t.num_experts, 'expert')} in {n(t.num_slots, 'slot')} on "
            f"{n(t.num_gpus, 'gpu')} ({n(t.num_nodes, 'node')}, {n(t.num_groups, 'group')}){down}, policy {policy}, imbalance mean "
            f"{self.mean_imbalance:.4f} max {self.max_imbalance:.4f} (lower bound {float(self.imbalance_lb.mean()):.4f}), "
            f"{self.total_moves} moves, {self.solve_seconds:.3f} s{notes})"
        )

    def summary(self) -> dict[str, Any]:
        """Plain-Python figures for reports and the wire."""
        return {
            "policy": self.policy,
            "policy_used": self.policy_used,
            "mean_imbalance": self.mean_imbalance,
            "max_imbalance": self.max_imbalance,
            "mean_imbalance_lb": float(self.imbalance_lb.mean()),
            "mean_balancedness": float(self.balancedness.mean()),
            "total_moves": self.total_moves,
            "solve_seconds": self.solve_seconds,
            "notes": list(self.notes),
        } | ({} if self.predicted_ms is None else {"predicted_ms": {str(b): v for b, v in self.predicted_ms.items()}})
