"""``rebalance(..., progress=callback)``: called as chunks of layers finish, with layers done
rising to every layer in each phase, and the plan the same as without it."""

import dataclasses

import numpy as np
import pytest

import eplb
from eplb.planner import anytime
from eplb.workloads import SCALES, make_loads


def _phases(seen: list) -> dict[str, list]:
    """Each run of one phase: its (done, total) in order (a phase may run more than once)."""
    runs: list = []
    for p in seen:
        assert isinstance(p, eplb.Progress)
        if not runs or runs[-1][0] != p.phase or p.done_rows < runs[-1][1][-1][0]:
            runs.append((p.phase, []))
        runs[-1][1].append((p.done_rows, p.total_rows))
    return runs


def _check(seen: list) -> None:
    assert seen, "progress was never called"
    elapsed = [p.elapsed_s for p in seen]
    assert elapsed == sorted(elapsed) and elapsed[0] >= 0
    for phase, steps in _phases(seen):
        done = [d for d, _ in steps]
        assert done == sorted(done), phase
        assert {t for _, t in steps} == {steps[0][1]}, phase
        assert done[-1] == steps[0][1], f"{phase} stopped at {done[-1]} of {steps[0][1]}"


@pytest.mark.parametrize("policy", ["auto", "global", "hierarchical"])
def test_progress_rises_to_every_layer_and_the_plan_is_the_same(policy):
    topo = dataclasses.replace(SCALES["small"], num_layers=70)
    loads = make_loads("zipf-1.0", topo, 3)
    seen: list = []
    plan = eplb.rebalance(loads, topo, policy, progress=seen.append)
    assert np.array_equal(plan.phy2log, eplb.rebalance(loads, topo, policy).phy2log)
    _check(seen)
    search = [p for p in seen if p.phase == "search"]
    # One call per chunk of 16 layers: 16, 32, 48, 64, 70.
    assert [p.done_rows for p in search] == [16, 32, 48, 64, 70]


def test_first_plans_of_many_layers_report_per_block_and_plan_as_one_pass(monkeypatch):
    topo = dataclasses.replace(SCALES["small"], num_layers=100)
    loads = make_loads("lognormal-1.0", topo, 1)
    whole = eplb.rebalance(loads, topo, "hierarchical", effort="fast").phy2log
    monkeypatch.setattr(anytime, "FIRST_BLOCK", 32)
    seen: list = []
    plan = eplb.rebalance(loads, topo, "hierarchical", effort="fast", progress=seen.append)
    assert np.array_equal(plan.phy2log, whole)
    assert [(p.phase, p.done_rows) for p in seen] == [("first plan", n) for n in (32, 64, 96, 100)]


def test_re_plan_reports_and_plans_the_same():
    topo = dataclasses.replace(SCALES["small"], num_layers=20)
    loads = make_loads("zipf-1.2", topo, 0)
    previous = eplb.Placement.contiguous(topo)
    seen: list = []
    plan = eplb.rebalance(loads, topo, "auto", previous=previous, max_moves=50, progress=seen.append)
    assert np.array_equal(plan.phy2log, eplb.rebalance(loads, topo, "auto", previous=previous, max_moves=50).phy2log)
    _check(seen)
    assert [(p.done_rows, p.total_rows) for p in seen if p.phase == "re-plan"] == [(0, 20), (20, 20)]


def test_with_gpus_down_and_workers_progress_still_rises_and_changes_nothing():
    topo = eplb.Topology(40, 32, 64, 8, 2, 4)
    loads = make_loads("zipf-1.0", topo, 2)
    seen: list = []
    plan = eplb.rebalance(loads, topo, "global", down_gpus=[1], progress=seen.append)
    assert np.array_equal(plan.phy2log, eplb.rebalance(loads, topo, "global", down_gpus=[1]).phy2log)
    _check(seen)
    seen.clear()
    plan = eplb.rebalance(loads, topo, "global", workers=2, progress=seen.append)
    assert np.array_equal(plan.phy2log, eplb.rebalance(loads, topo, "global").phy2log)
    # The workers' jobs report as they come back, 16 layers each.
    assert [p.done_rows for p in seen if p.phase == "plan"] == [0, 16, 32, 40]


@pytest.mark.parametrize("bad", [3, "print", [print]])
def test_a_progress_that_cannot_be_called_is_refused_before_any_work(bad):
    topo = eplb.Topology(1, 4, 4, 2)
    with pytest.raises(ValueError, match=r"^progress must be a callable taking an eplb.Progress, or None; got "):
        eplb.rebalance(np.ones((1, 4)), topo, "global", progress=bad)


def test_without_a_plan_running_report_calls_nothing_and_an_error_in_the_callback_reaches_the_caller():
    from eplb.progress import report

    report("search", 1, 2)  # no plan: nothing to call, no error

    def boom(p: eplb.Progress) -> None:
        raise KeyboardInterrupt  # what a CLI's Ctrl-C check raises

    topo = dataclasses.replace(SCALES["small"], num_layers=4)
    with pytest.raises(KeyboardInterrupt):
        eplb.rebalance(make_loads("zipf-1.0", topo, 0), topo, "global", progress=boom)
    # The plan's callback is gone after it: a plan without one reports to nobody.
    eplb.rebalance(make_loads("zipf-1.0", topo, 0), topo, "global")


@dataclasses.dataclass(frozen=True)
class _TakesProgress:
    progress: object = None


def test_a_policy_option_named_like_rebalances_progress_is_refused_at_registration():
    # rebalance takes progress= itself: such an option would never reach the policy.
    with pytest.raises(ValueError, match=r"may not reuse rebalance's own argument names \['progress'\]"):
        eplb.register_policy("test-progress-option", options=_TakesProgress)
    assert "test-progress-option" not in eplb.policies()
