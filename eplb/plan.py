"""What ``rebalance`` returns: a placement and how good it is."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .placement import Placement

__all__ = ["Plan"]


@dataclass(frozen=True, eq=False)
class Plan:
    """A placement plus per-layer figures, all ``[L]`` arrays.

    - ``imbalance``: max / mean gpu load under the loads it was planned for (1.0 is perfect);
    - ``imbalance_lb``: the lower bound over mean gpu load, no placement can go below it;
    - ``balancedness``: mean / max gpu load, what vLLM and SGLang log;
    - ``moves``: slots whose expert differs from ``previous`` (zeros without one);
    - ``gpu_load``: ``[L, G]`` tokens per gpu.
    ``policy`` is the policy asked for, ``policy_used`` what ran (``auto`` resolves to one),
    ``notes`` say why (e.g. a fallback). ILP plans fill ``solver_status`` and
    ``solver_bound`` (``[L]`` proven lower bound on the busiest gpu's load). ``search`` is
    what the anytime search after the first plan did (``SearchStats``: work units spent,
    layers searched, layers within the gap of their bound, whether ``time_limit`` cut it),
    ``None`` for policies without one.
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
    solver_status: tuple[str, ...] | None = None
    solver_bound: np.ndarray | None = None
    extra: dict = field(default_factory=dict)
    search: object | None = None

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
    def mean_imbalance(self) -> float:
        return float(self.imbalance.mean())

    @property
    def max_imbalance(self) -> float:
        return float(self.imbalance.max())

    @property
    def total_moves(self) -> int:
        return int(self.moves.sum())

    def summary(self) -> dict:
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
        }
