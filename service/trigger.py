"""When to re-plan on our own, and which plans are worth publishing."""

from __future__ import annotations

from dataclasses import dataclass

from .store import PlanMarks

__all__ = ["TriggerSpec", "due", "gate"]


@dataclass(frozen=True)
class TriggerSpec:
    """``interval_s`` and/or ``report_count`` start a plan (0 disables either); ``min_gain_percent``
    and ``max_moves`` (0: no budget) decide whether it is published."""

    interval_s: float = 0.0
    report_count: int = 0
    min_gain_percent: float = 0.0
    max_moves: int = 0

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 or self.report_count > 0


def due(spec: TriggerSpec, marks: PlanMarks, now: float) -> str | None:
    """Why a plan is due now (for logs), or None."""
    if spec.interval_s > 0 and now - marks.planned_at >= spec.interval_s:
        return f"interval {spec.interval_s:g}s elapsed"
    if spec.report_count > 0 and marks.reports - marks.planned_reports >= spec.report_count:
        return f"{marks.reports - marks.planned_reports} reports since the last plan"
    return None


def gate(spec: TriggerSpec, gain_percent: float, moves: int) -> str | None:
    """Why a plan must not be published, or None when it may."""
    if gain_percent < spec.min_gain_percent:
        return f"predicted gain {gain_percent:.2f}% is below min_gain_percent {spec.min_gain_percent:g}%"
    if spec.max_moves and moves > spec.max_moves:
        return f"plan moves {moves} slots, over the move budget max_moves {spec.max_moves}"
    return None
