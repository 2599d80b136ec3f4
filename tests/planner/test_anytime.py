"""eplb.planner.anytime: the planner's options and what its search reports."""

import time
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


def _slow_packing(monkeypatch: pytest.MonkeyPatch, seconds_per_row: float) -> None:
    """Every candidate row the search packs costs ``seconds_per_row`` more: a big batch is one
    long step, as on a machine whose cores are shared."""
    from eplb.planner import packing, search

    real = packing.pack_counts

    def slow(loads: np.ndarray, counts: np.ndarray, bins: int, max_rounds: int = 16) -> np.ndarray:
        time.sleep(seconds_per_row * loads.shape[0])
        return real(loads, counts, bins, max_rounds)

    monkeypatch.setattr(packing, "pack_counts", slow)
    monkeypatch.setattr(search, "pack_counts", slow)


def test_a_time_limit_holds_when_one_batch_of_the_search_would_outlast_it(monkeypatch) -> None:
    # 5 ms per packed row: the first steepest-descent step packs ~240 candidates (1.2 s), which
    # the old search started at once and ran to the end (2.6 s for a 1 s limit). Now a batch is
    # packed in pieces with the clock checked between them, so the plan ends within a piece.
    _slow_packing(monkeypatch, 0.005)
    topo = SCALES["v3-prefill"].with_layers(16)
    loads = make_loads("zipf-1.5", SCALES["v3-prefill"])[:16]
    start = time.perf_counter()
    plan = eplb.rebalance(loads, topo, "global", time_limit=1.0)
    elapsed = time.perf_counter() - start
    # A piece is ~50 rows (0.25 s) here; the margin is for a loaded machine.
    assert elapsed < 1.0 + 0.75
    assert plan.search.timed_out and not plan.search.first_plan_over
    assert plan.search.layers_searched > 0
    assert "time_limit stopped the search after the first plan early" in plan.notes


def test_a_limit_shorter_than_the_first_plan_returns_it_and_says_so() -> None:
    topo = SCALES["v3-prefill"].with_layers(4)
    loads = make_loads("zipf-1.5", SCALES["v3-prefill"])[:4]
    plan = eplb.rebalance(loads, topo, "global", time_limit=1e-6)
    assert plan.search.first_plan_over and plan.search.timed_out
    assert plan.search.work == 0 and plan.search.layers_searched == 0
    assert any("ran out during the first plan" in n for n in plan.notes)
    # The first plan runs whole: what effort="fast" gives.
    assert np.array_equal(plan.phy2log, eplb.rebalance(loads, topo, "global", effort="fast").phy2log)


def test_a_plan_with_workers_and_a_time_limit_is_the_same_placement_as_its_chunks_alone() -> None:
    # Under a deadline each process takes a run of whole chunks (its first plans before its
    # searches); with a limit no search reaches, the plan is the one without a limit.
    topo = SCALES["v3-64"].with_layers(40)
    loads = make_loads("zipf-1.0", SCALES["v3-64"])[:40]
    free = eplb.rebalance(loads, topo, "global")
    limited = eplb.rebalance(loads, topo, "global", workers=2, time_limit=3600.0)
    assert np.array_equal(limited.phy2log, free.phy2log)
    assert not limited.search.timed_out
