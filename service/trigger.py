"""When to re-plan on our own (``due``), and whether a plan is published (``decide``).

``decide`` is the one place for the publication rules: an empty window, a plan that moves
nothing or gains nothing, the gain gate (``Trigger.min_gain_percent``) and the move budget (``Migration.max_moves``). The migration-aware policies also plan within the
move budget (:mod:`.planner`), so for them the budget rule only refuses what the budget could
not hold back; a forced Rebalance skips every rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from .store import PlanMarks

__all__ = ["TriggerSpec", "decide", "due", "next_check"]


@dataclass(frozen=True)
class TriggerSpec:
    """``interval_s`` (once a report arrived since the last plan) and/or ``report_count`` start a
    plan (0 disables either); ``min_gain_percent``
    and ``max_moves`` (the deployment's one move budget; None: none, 0: no slot may move) decide
    whether it is published."""

    interval_s: float = 0.0
    report_count: int = 0
    min_gain_percent: float = 0.0
    max_moves: int | None = None
    # Trigger.max_payback_steps (None: no time gate).
    max_payback_steps: int | None = None

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 or self.report_count > 0


def due(spec: TriggerSpec, marks: PlanMarks, now: float) -> str | None:
    """Why a plan is due now (for logs), or None. The interval starts a plan only once a report
    arrived since the last plan: without one the window can only have aged, and planning it
    again every interval costs a plan each time and publishes nothing new."""
    if spec.interval_s > 0 and now - marks.planned_at >= spec.interval_s and marks.reports > marks.planned_reports:
        return f"interval {spec.interval_s:g}s elapsed"
    if spec.report_count > 0 and marks.reports - marks.planned_reports >= spec.report_count:
        return f"{marks.reports - marks.planned_reports} reports since the last plan"
    return None


def next_check(spec: TriggerSpec, marks: PlanMarks, now: float) -> float:
    """When a plan that ``due`` did not find due now could first be: the time before which an
    instance need not read the deployment's marks again (a store call per deployment and tick
    otherwise, on every instance process: the most of what a fleet of quiet deployments cost).

    ``planned_at`` only grows (whoever plans next moves it on), so without a report-count
    trigger no plan is due before ``planned_at + interval_s``; past it, one waits only for a
    report anywhere, looked for every ``min(interval_s / 10, 5 s)``: a plan starts at most that
    late. A report-count trigger can be met by any instance's reports at any time: every tick."""
    if spec.report_count > 0:
        return now
    if spec.interval_s <= 0:
        return float("inf")
    return max(marks.planned_at + spec.interval_s, now + min(spec.interval_s / 10, _IDLE_CHECK_S))


_IDLE_CHECK_S = 5.0


def decide(
    spec: TriggerSpec,
    window_tokens: float,
    gain_percent: float,
    moves: int,
    force: bool,
    saved_ms: float | None = None,
    stall_s: float = 0.0,
) -> str | None:
    """Why a plan must not be published, or None when it may. ``gain_percent``: the imbalance's
    gain, or for a plan for time the predicted MoE time's; ``saved_ms``: MoE milliseconds per
    step the plan saves (None: not planned for time); ``stall_s``: the move's predicted stall."""
    if force:
        return None
    if window_tokens <= 0:
        return "the load window is empty"
    # A plan equal to the one in service (no slot moves) would be a new version that changes
    # nothing: every watcher woken, a rollout run, a real version pushed out of the kept 16.
    if moves == 0:
        return "the plan moves no slot: the placement in service stays"
    what = "predicted gain" if saved_ms is None else "predicted MoE time gain"
    if gain_percent <= 0 and spec.min_gain_percent <= 0:
        return f"{what} {gain_percent:.2f}% is not above 0%"
    if gain_percent < spec.min_gain_percent:
        return f"{what} {gain_percent:.2f}% is below min_gain_percent {spec.min_gain_percent:g}%"
    # An explicit 0 is a budget (no slot moves), as Migration.max_moves says: only unset is none.
    if spec.max_moves is not None and moves > spec.max_moves:
        return f"plan moves {moves} slots, over the move budget max_moves {spec.max_moves}"
    if spec.max_payback_steps is not None and saved_ms is not None:
        if saved_ms <= 0:
            return f"the plan saves no MoE time ({saved_ms:.4f} ms per step predicted)"
        steps = stall_s * 1000.0 / saved_ms
        if steps > spec.max_payback_steps:
            return (
                f"the move's predicted stall {stall_s * 1000:.1f} ms takes {steps:.0f} steps of the {saved_ms:.4f} ms "
                f"saved per step to repay, over max_payback_steps {spec.max_payback_steps}"
            )
    return None
