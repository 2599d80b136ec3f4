"""``Migration``: what a re-plan from ``previous=`` may trade (tolerances and move budgets), and
its defaults; ``eplb.replan.choose`` is the re-plan that keeps to it."""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks

__all__ = ["Migration", "DEFAULT_TOLERANCE", "DEFAULT_LAYER_TOLERANCE"]


# Defaults for re-planning with `previous=` (bench/drift_bench.py measures the trade-off): the
# mean imbalance over layers may exceed a fresh plan's by 1 %, any one layer's by 5 %.
DEFAULT_TOLERANCE = 0.01
DEFAULT_LAYER_TOLERANCE = 0.05
_TOLERANCES = ("tolerance", "layer_tolerance")
_BUDGETS = ("max_moves", "max_layer_moves")


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
        for name in _TOLERANCES + _BUDGETS:
            value = getattr(self, name)
            if value is not None or name in _TOLERANCES:
                object.__setattr__(self, name, self.check_field(name, value))

    @staticmethod
    def check_field(name: str, value: object, *, finite: bool = False, none: str | None = None) -> float | int:
        """``value`` for the field ``name`` (a float for a tolerance, an int for a move budget) if
        it keeps that field's rule, else ``ValueError`` naming it: a tolerance is a number >= 0
        (``finite``: not infinity either, the wire's rule; ``none``: what a tolerance of None
        means to the caller, for the message); a move budget an integer >= 0 or None (no limit)."""
        if name in _TOLERANCES:
            return checks.nonneg_number(name, value, "a fraction, 0.01 = 1 %", finite=finite, none=none)
        if name in _BUDGETS:
            return checks.nonneg_int(name, value, "slots rewritten", none="no limit")
        raise ValueError(f"{name!r} is not a field of Migration; one of {', '.join(_TOLERANCES + _BUDGETS)}")
