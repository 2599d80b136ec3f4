"""eplb.place.anytime: the planner's options and what its search reports."""

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
