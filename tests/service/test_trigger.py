"""``trigger.decide``: the one place for the publication rules (pure logic)."""

from __future__ import annotations

from eplb_service.store import PlanMarks
from eplb_service.trigger import TriggerSpec, decide, due, next_check

SPEC = TriggerSpec(interval_s=60.0, report_count=10, min_gain_percent=5.0, max_moves=8)


def test_decide_applies_the_rules_in_order_and_force_skips_them():
    assert decide(SPEC, 0.0, 50.0, 1, force=False) == "the load window is empty"
    assert "below min_gain_percent 5%" in decide(SPEC, 100.0, 4.99, 1, force=False)
    assert "over the move budget max_moves 8" in decide(SPEC, 100.0, 6.0, 9, force=False)
    assert decide(SPEC, 100.0, 5.0, 8, force=False) is None
    assert decide(SPEC, 0.0, 0.0, 100, force=True) is None
    assert decide(TriggerSpec(), 1.0, 0.01, 10**6, force=False) is None  # no gate, no budget


def test_a_plan_that_moves_nothing_or_gains_nothing_is_not_published():
    # With the default gate (min_gain_percent 0) every interval used to publish a new version
    # equal to the one in service.
    assert "moves no slot" in decide(TriggerSpec(), 100.0, 0.0, 0, force=False)
    assert "moves no slot" in decide(SPEC, 100.0, 50.0, 0, force=False)
    assert "not above 0%" in decide(TriggerSpec(), 100.0, 0.0, 12, force=False)
    assert "not above 0%" in decide(TriggerSpec(), 100.0, -0.5, 12, force=False)
    assert decide(TriggerSpec(), 100.0, 0.0, 0, force=True) is None


def test_due_by_interval_or_report_count():
    assert due(SPEC, PlanMarks(reports=9, planned_reports=0, planned_at=100.0), now=159.0) is None
    assert (
        due(SPEC, PlanMarks(reports=10, planned_reports=0, planned_at=100.0), now=120.0)
        == "10 reports since the last plan"
    )
    assert due(SPEC, PlanMarks(reports=3, planned_reports=2, planned_at=100.0), now=160.0) == "interval 60s elapsed"


def test_the_interval_waits_for_a_report_since_the_last_plan():
    # An idle deployment re-planned its unchanged (or empty) window every interval.
    assert due(SPEC, PlanMarks(reports=0, planned_reports=0, planned_at=100.0), now=160.0) is None
    assert due(SPEC, PlanMarks(reports=7, planned_reports=7, planned_at=100.0), now=1e6) is None


def test_next_check_never_skips_a_moment_a_plan_could_be_due():
    interval = TriggerSpec(interval_s=60.0)
    marks = PlanMarks(reports=5, planned_reports=5, planned_at=100.0)
    # Not before the interval since the last plan (planned_at only grows)...
    assert next_check(interval, marks, now=110.0) == 160.0
    # ...and past it (waiting for a report anywhere) every interval / 10, at most 5 s.
    assert next_check(interval, marks, now=170.0) == 175.0
    assert next_check(TriggerSpec(interval_s=20.0), marks, now=170.0) == 172.0
    # Every moment before the time it gives, due says no, whatever reports came meanwhile.
    for now in (110.0, 130.0, 159.9):
        later = PlanMarks(reports=10**6, planned_reports=5, planned_at=100.0)
        assert now < next_check(interval, marks, now=110.0) and due(interval, later, now) is None
    # A report count can be met at any time: every tick; no trigger: never.
    assert next_check(TriggerSpec(report_count=10), marks, now=110.0) == 110.0
    assert next_check(SPEC, marks, now=110.0) == 110.0
    assert next_check(TriggerSpec(), marks, now=110.0) == float("inf")


def test_the_move_budget_is_read_from_migration_max_moves_only():
    from eplb_service.codec import trigger_spec
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    both = pb.Deployment(trigger=pb.Trigger(max_moves=3), migration=pb.Migration(max_moves=5))
    assert trigger_spec(both).max_moves == 5
    # The deprecated wire field alone (folded into Migration.max_moves on create, so only a
    # deployment stored before that fold has it so) is no budget.
    assert trigger_spec(pb.Deployment(trigger=pb.Trigger(max_moves=7))).max_moves is None


def test_an_explicit_zero_budget_gates_every_move_and_unset_gates_none():
    """Migration.max_moves = 0 is a budget of no moves (the wire says "unset: no limit"); the
    gate read 0 as no budget, so deepseek and ilp deployments, which do not plan within the
    budget, published plans that moved slots."""
    from eplb_service.codec import trigger_spec
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    zero = trigger_spec(pb.Deployment(migration=pb.Migration(max_moves=0)))
    assert zero.max_moves == 0
    assert "over the move budget max_moves 0" in decide(zero, 100.0, 6.0, 1, force=False)
    assert decide(zero, 100.0, 6.0, 1, force=True) is None
    unset = trigger_spec(pb.Deployment())
    assert unset.max_moves is None and decide(unset, 100.0, 6.0, 10**6, force=False) is None
