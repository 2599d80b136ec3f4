"""The CP-SAT reference policy ``ilp``: known optima, proofs and its bounds."""

import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eplb
from eplb.workloads import make_loads

pytest.importorskip("ortools")


def test_known_answer_is_proved_optimal() -> None:
    # eplb.py gives the two hot experts 5 replicas each (232); splitting them 3 + 3 and
    # pairing replicas with the cold experts reaches 590 / 3 = 196.67.
    loads = np.array([[600, 560, 120, 120, 20, 10, 10, 10]])
    topo = eplb.Topology(1, 8, 16, 8)
    plan = eplb.rebalance(loads, topo, "ilp", time_limit=60)
    assert plan.solver_status == ("OPTIMAL",)
    assert plan.gpu_load.max() == pytest.approx(590 / 3)
    assert plan.solver_bound[0] == pytest.approx(590 / 3)
    assert plan.gpu_load.mean() == pytest.approx(181.25)
    assert eplb.rebalance(loads, topo, "deepseek").gpu_load.max() == pytest.approx(232)


def test_16_experts_4_gpus_20_slots_is_proved_optimal() -> None:
    loads = np.round(np.random.default_rng(0).lognormal(0, 1, (1, 16)) * 10)
    topo = eplb.Topology(1, 16, 20, 4)
    plan = eplb.rebalance(loads, topo, "ilp", time_limit=60)
    assert plan.solver_status == ("OPTIMAL",)
    assert plan.gpu_load.max() == pytest.approx(plan.solver_bound[0])


def test_8_experts_8_gpus_16_slots_is_proved_optimal() -> None:
    topo = eplb.Topology(1, 8, 16, 8)
    loads = make_loads("lognormal-1.0", topo, 0)
    plan = eplb.rebalance(loads, topo, "ilp", time_limit=60)
    assert plan.solver_status == ("OPTIMAL",)
    # Rounded units: optimal to within slots_per_gpu / 2**24 of the largest load.
    assert plan.gpu_load.max() <= plan.solver_bound[0] + 2 * loads.max() / 2**24
    assert plan.gpu_load.max() < eplb.rebalance(loads, topo, "global", effort="fast").gpu_load.max()
    # The default's search after the first plan reaches the proven optimum here.
    assert eplb.rebalance(loads, topo, "global").gpu_load.max() <= plan.solver_bound[0] + 2 * loads.max() / 2**24


def test_value_lies_between_bounds_and_greedy_on_every_layer() -> None:
    topo = eplb.Topology(3, 8, 12, 4)
    loads = make_loads("zipf-1.0", topo, 3)
    plan = eplb.rebalance(loads, topo, "ilp", time_limit=2, workers=2)
    best = plan.gpu_load.max(axis=1)
    greedy = eplb.rebalance(loads, topo, "global").gpu_load.max(axis=1)
    assert len(plan.solver_status) == 3
    assert set(plan.solver_status) <= {"OPTIMAL", "FEASIBLE"}
    assert plan.solver_bound.shape == (3,)
    assert (best <= greedy * (1 + 1e-9)).all()
    assert (best >= plan.solver_bound * (1 - 1e-9)).all()
    assert (plan.solver_bound >= eplb.lower_bound(loads, topo) * (1 - 1e-12)).all()
    assert np.allclose(plan.solver.objective, best, rtol=1e-6)
    # At most one replica of an expert per gpu.
    srt = np.sort(plan.placement.experts_on_gpu(), axis=2)
    assert not (srt[:, :, 1:] == srt[:, :, :-1]).any()


def test_all_zero_layer_is_optimal_and_valid() -> None:
    topo = eplb.Topology(1, 4, 8, 4)
    plan = eplb.rebalance(np.zeros((1, 4)), topo, "ilp", time_limit=5)
    assert plan.solver_status == ("OPTIMAL",)
    assert (plan.logcnt >= 1).all()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"time_limit": 0}, "time_limit"),
        ({"workers": 0}, "workers"),
        ({"seed": 1}, "unknown option"),
    ],
)
def test_bad_options_are_rejected(options: dict, match: str) -> None:
    topo = eplb.Topology(1, 4, 8, 4)
    with pytest.raises(ValueError, match=match):
        eplb.rebalance(np.ones((1, 4)), topo, "ilp", **options)


def test_more_slots_than_one_replica_per_gpu_allows_is_rejected() -> None:
    topo = eplb.Topology(1, 2, 8, 2)
    with pytest.raises(ValueError, match="num_experts x num_gpus"):
        eplb.rebalance(np.ones((1, 2)), topo, "ilp")


def test_missing_ortools_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    topo = eplb.Topology(1, 4, 8, 4)
    with pytest.raises(ImportError, match=r"pip install 'eplb\[ilp\]'"):
        eplb.rebalance(np.ones((1, 4)), topo, "ilp")


def test_float_loads_near_the_mean_are_proved_by_enumeration() -> None:
    # CP-SAT alone finds this optimum (1.000632 x mean) but its bound stays at the mean.
    topo = eplb.Topology(1, 16, 20, 4)
    loads = make_loads("zipf-1.0", topo, 0)
    plan = eplb.rebalance(loads, topo, "ilp", time_limit=60)
    assert plan.solver_status == ("OPTIMAL",)
    assert plan.solver.method == ("enumeration",)
    assert plan.imbalance[0] == pytest.approx(1.000632, abs=1e-6)
    assert plan.gpu_load.max() <= plan.solver_bound[0] + 5 * loads.max() / 2**24


def test_layers_too_big_to_enumerate_go_to_cp_sat() -> None:
    topo = eplb.Topology(1, 16, 24, 8)  # comb(23, 15) count vectors: too many to enumerate
    loads = make_loads("lognormal-1.0", topo, 1)
    plan = eplb.rebalance(loads, topo, "ilp", time_limit=2, workers=2)
    assert plan.solver.method == ("cp-sat",)
    assert plan.solver_status[0] in ("OPTIMAL", "FEASIBLE")
    assert plan.gpu_load.max() <= eplb.rebalance(loads, topo, "global").gpu_load.max() * (1 + 1e-9)


@given(data=st.data())
def test_enumeration_matches_brute_force_on_tiny_layers(data: st.DataObject) -> None:
    from itertools import combinations, product

    from eplb.enumeration import improve_or_prove

    G = data.draw(st.integers(2, 3), label="gpus")
    S = data.draw(st.integers(1, 3), label="slots per gpu")
    E = data.draw(st.integers(max(1, -(-G * S // G)), min(G * S, 5)), label="experts")
    C = min(G, G * S - E + 1)
    w_one = np.array(data.draw(st.lists(st.integers(0, 60), min_size=E, max_size=E), label="loads"))
    w = w_one[:, None] * 60 // np.arange(1, C + 1)[None, :]  # integer units, as the ILP uses
    best = None
    for gpus in product(combinations(range(E), S), repeat=G):
        counts = np.bincount(np.concatenate(gpus), minlength=E)
        if counts.min() < 1 or counts.max() > C:
            continue
        value = max(int(sum(w[e, counts[e] - 1] for e in g)) for g in gpus)
        best = value if best is None else min(best, value)
    if best is None:
        return  # no valid placement for this shape
    done, value, row = improve_or_prove(w, G, S, int(w.sum()) * S + 1)
    assert done and value == best
    per_gpu = row.reshape(G, S)
    counts = np.bincount(row, minlength=E)
    assert counts.min() >= 1 and all(len(set(g)) == S for g in per_gpu.tolist())
    assert max(int(w[g, counts[g] - 1].sum()) for g in per_gpu) == best
