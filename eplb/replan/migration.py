"""``Migration``: what a re-plan from ``previous=`` may trade (tolerances and move budgets), and
its defaults; ``eplb.replan.choose`` is the re-plan that keeps to it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Migration", "DEFAULT_TOLERANCE", "DEFAULT_LAYER_TOLERANCE"]


# Defaults for re-planning with `previous=` (bench/drift_bench.py measures the trade-off): the
# mean imbalance over layers may exceed a fresh plan's by 1 %, any one layer's by 5 %.
DEFAULT_TOLERANCE = 0.01
DEFAULT_LAYER_TOLERANCE = 0.05


@dataclass(frozen=True)
class Migration:
    """What a re-plan from ``previous=`` may trade, checked when made (``ValueError`` names the
    field and what it allows). ``tolerance``: the mean imbalance over layers may exceed a fresh
    plan's by this fraction; ``layer_tolerance``: any one layer's by this; ``max_moves`` and
    ``max_layer_moves``: slots rewritten in all and per layer (``None``: no limit), hard
    limits where the tolerances are goals. ``rebalance`` takes them as options of every policy
    registered with ``replans=True``."""

    tolerance: float = DEFAULT_TOLERANCE
    layer_tolerance: float = DEFAULT_LAYER_TOLERANCE
    max_moves: int | None = None
    max_layer_moves: int | None = None

    def __post_init__(self) -> None:
        for name in ("tolerance", "layer_tolerance"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float, np.integer, np.floating))
                or not value >= 0
            ):
                raise ValueError(f"{name} must be a number >= 0 (a fraction, 0.01 = 1 %), got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("max_moves", "max_layer_moves"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0 (slots rewritten) or None (no limit), got {value!r}")
            if value is not None:
                object.__setattr__(self, name, int(value))
