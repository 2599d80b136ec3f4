"""`eplb place --policy ilp`: one overall time limit, progress per layer, and a note when the
ILP found nothing better than the global plan it starts from."""

import numpy as np
import pytest

import eplb
from eplb.workloads import make_loads

# 16 gpus x 5 slots: too many count vectors for the exact enumeration, and a CP-SAT model of
# 64 x 16 x 16 booleans per layer that takes far longer to build than 0.05 s / 4 layers.
BIG = eplb.Topology(4, 64, 80, 16)


def test_total_time_limit_keeps_the_global_plan_on_layers_that_run_out_and_says_so():
    loads = make_loads("zipf-1.0", BIG)
    seen = []
    plan = eplb.rebalance(loads, BIG, "ilp", total_time_limit=0.05, workers=1, progress=seen.append)
    # Its hint, the global plan, reports its own phases first.
    assert [(p.done_rows, p.total_rows) for p in seen if p.phase == "ilp"] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert plan.solver.method == ("out of time",) * 4
    assert plan.solver_status == ("UNKNOWN",) * 4
    assert np.array_equal(plan.phy2log, eplb.rebalance(loads, BIG, "global").phy2log)
    assert (
        "ilp: 4 of 4 layers found no solution in their time (layers 0-3); they keep the global policy's placement"
        in plan.notes
    )
    assert "ilp: found nothing better than the global policy's placement on 4 of 4 layers" in plan.notes
    # The bound stays a true lower bound.
    assert (plan.solver_bound <= plan.gpu_load.max(axis=1) + 1e-9).all()


def test_a_proof_that_the_global_plan_is_optimal_is_named_in_the_note():
    topo = eplb.Topology(1, 4, 4, 2)  # one slot per expert: the only freedom is the pairing
    plan = eplb.rebalance(np.array([[4.0, 3.0, 2.0, 1.0]]), topo, "ilp", time_limit=5, workers=1)
    assert plan.solver_status == ("OPTIMAL",)
    assert (
        "ilp: found nothing better than the global policy's placement on 1 of 1 layers (1 of them proved optimal)"
        in plan.notes
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"total_time_limit": 0}, "total_time_limit must be a positive number of seconds or None"),
        ({"total_time_limit": True}, "total_time_limit must be a positive number of seconds or None"),
        ({"progress": 3}, "progress must be a callable taking an eplb.Progress, or None; got 3"),
    ],
)
def test_bad_ilp_options_are_named(options, match):
    with pytest.raises(ValueError, match=match):
        eplb.rebalance(np.ones((1, 4)), eplb.Topology(1, 4, 4, 2), "ilp", **options)


def test_layers_past_the_overall_limit_keep_their_hint_without_a_solve():
    # The global plan the ILP starts from already outlasts this limit: no layer gets a model,
    # an enumeration or a bound of its own (each cost 10-20 ms at v3-prefill, 1 s over a 6 s
    # limit), and the plan still reports a true bound.
    loads = make_loads("zipf-1.0", BIG)
    plan = eplb.rebalance(loads, BIG, "ilp", total_time_limit=1e-9, workers=1)
    assert plan.solver.method == ("out of time",) * 4 and plan.solver.seconds.tolist() == [0.0] * 4
    assert np.array_equal(plan.phy2log, eplb.rebalance(loads, BIG, "global").phy2log)
    assert (plan.solver_bound >= eplb.lower_bound(loads, BIG) - 1e-9).all()
    assert (plan.solver_bound <= plan.gpu_load.max(axis=1) + 1e-9).all()
