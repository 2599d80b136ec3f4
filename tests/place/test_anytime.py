"""eplb.place.anytime: the planner's options and what its search reports."""

import warnings

import numpy as np
import pytest

import eplb
from eplb.workloads import SCALES, make_loads


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"donors": 0}, "donors must be an integer >= 1"),
        ({"work_budget": float("inf")}, "work_budget must be a finite number"),
        ({"effort": "max"}, "effort must be one of"),
        ({"gap": -0.1}, "gap must be a number >= 0"),
        ({"workers": 0}, "workers must be an integer >= 1"),
    ],
)
def test_bad_planning_options_name_the_option(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        eplb.PlanOptions(**options)
    with pytest.raises(ValueError, match=match):
        eplb.rebalance(np.ones((1, 8)), eplb.Topology(1, 8, 12, 4), "global", **options)


def test_no_work_budget_reports_only_the_layers_really_at_their_bound() -> None:
    topo = SCALES["v3-64"].with_layers(4)
    loads = make_loads("zipf-1.5", topo)
    plan = eplb.rebalance(loads, topo, "global", work_budget=0)
    assert plan.search is not None and plan.search.work == 0
    at = (plan.imbalance <= plan.imbalance_lb * (1 + 0.001) + 1e-12).sum()
    assert plan.search.layers_at_bound == at < topo.num_layers


def test_layers_of_one_profile_end_no_worse_than_the_best_of_them_alone() -> None:
    # Under a zipf law every layer is the same problem in another expert order. Searched one at a
    # time the layers end at different local optima; searched as a chunk they borrow the best
    # counts, so the mean is no worse than the best single layer's plan and every layer no
    # worse than its first plan.
    topo = SCALES["qwen3-64"].with_layers(8)
    loads = make_loads("zipf-1.5", topo)
    alone = [eplb.rebalance(loads[i : i + 1], topo.with_layers(1), "global").imbalance[0] for i in range(8)]
    chunk = eplb.rebalance(loads, topo, "global")
    fast = eplb.rebalance(loads, topo, "global", effort="fast")
    assert (chunk.imbalance <= fast.imbalance * (1 + 1e-12)).all()
    assert chunk.mean_imbalance < np.mean(alone)
    assert chunk.imbalance.max() <= min(alone) * (1 + 1e-3)


@pytest.mark.parametrize("effort", ["fast", "default", "high"])
def test_odd_layers_plan_without_warnings_and_integer_counts_plan_as_floats(effort: str) -> None:
    # Counts as a trace gives them: integers, an all-zero layer, one expert with all the load,
    # three live experts with ties among 125 dead ones.
    topo = eplb.Topology(4, 128, 256, 128)
    counts = np.random.default_rng(0).integers(0, 50, (4, 128))
    counts[1] = 0
    counts[2] = 0
    counts[2, 5] = 1000
    counts[3] = 0
    counts[3, :3] = 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = eplb.rebalance(counts, topo, "global", effort=effort)
    floats = eplb.rebalance(counts.astype(np.float64), topo, "global", effort=effort)
    assert np.array_equal(plan.phy2log, floats.phy2log)
    assert plan.imbalance[1] == 1.0 and np.isclose(plan.imbalance[2], 1.0)
    if effort != "fast":
        # 128 live replicas (43, 43, 42) each on its own gpu: 7/42 over 21/128 is the best.
        assert np.isclose(plan.imbalance[3], (7 / 42) / (21 / 128))
