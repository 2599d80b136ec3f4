"""eplb.budget: the work units and the wall clock a search spends, on a clock the test moves."""

import types

import pytest

from eplb import budget
from eplb.budget import AHEAD, Budget, Clock


@pytest.fixture
def now(monkeypatch):
    """The time ``eplb.budget`` reads, set by the test: ``now[0]`` seconds."""
    t = [0.0]
    monkeypatch.setattr(budget, "time", types.SimpleNamespace(perf_counter=lambda: t[0]))
    return t


def test_a_clock_stops_before_a_step_like_the_last_would_pass_the_deadline(now):
    clock = Clock(1.0)
    now[0] = 0.2
    assert not clock.out()  # a 0.2 s step from 0.2 ends well before 1.0
    now[0] = 0.45
    assert not clock.out()  # 0.45 + AHEAD * 0.25 = 0.95
    now[0] = 0.75
    assert clock.out()  # 0.75 + AHEAD * 0.3 > 1.0
    assert clock.expired


def test_a_clock_once_out_stays_out_though_the_next_gap_is_short(now):
    # The old Budget measured each check's gap afresh: right after a stop the gap is tiny, so
    # the next stage's first step started anyway and ran past the deadline.
    clock = Clock(1.0)
    now[0] = 0.45
    assert clock.out()
    now[0] = 0.4501
    assert clock.out()


def test_budgets_shared_from_one_another_share_the_clock(now):
    parent = Budget(1000.0, Clock(1.0))
    stage = parent.share(0.5)
    assert stage.units == 500.0 and stage.clock is parent.clock
    now[0] = 0.9
    assert stage.out()
    assert parent.timed_out  # no charging back needed: the stop is the plan's
    assert parent.late() and parent.share(1.0).out()


def test_a_batch_is_cut_to_what_the_time_left_pays_for(now):
    clock = Clock(10.0)
    b = Budget(None, clock)
    assert b.fit(500, 1.0) == 500  # no rate yet: the first step is the one nothing predicts
    b.spend(100.0)
    now[0] = 1.0
    assert not b.out()  # learns 0.01 s per unit
    # 9 s left, AHEAD times over, at 0.01 s per unit of cost 10: 9 / (AHEAD * 0.1) items.
    assert b.fit(500, 10.0) == int(9.0 / (AHEAD * 0.1))
    assert not clock.expired
    now[0] = 9.99
    assert b.fit(500, 10.0) == 0
    assert clock.expired  # not one item fits: the search is over


def test_without_a_clock_only_the_units_count(now):
    b = Budget(100.0)
    now[0] = 1e9
    assert not b.late() and not b.out() and not b.timed_out
    assert b.fit(50, 3.0) == 33
    b.spend(100.0)
    assert b.out() and not b.timed_out
    assert Budget().fit(7, 1e9) == 7
