"""Invariants every registered policy keeps, over generated inputs."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eplb
from eplb.bounds import group_bound
from eplb.workloads import SCALES, make_loads

POLICIES = [p for p in eplb.policies() if p != "ilp"]


@st.composite
def instances(draw: st.DrawFn) -> tuple[np.ndarray, eplb.Topology]:
    nodes = draw(st.sampled_from([1, 2, 4]))
    gpus = nodes * draw(st.integers(1, 4))
    groups = nodes * draw(st.sampled_from([1, 2]))
    experts = groups * draw(st.integers(1, 6))
    experts = max(experts, groups)
    slots_per_gpu = draw(st.integers(max(1, -(-experts // gpus)), max(1, -(-experts // gpus)) + 3))
    layers = draw(st.integers(1, 3))
    topo = eplb.Topology(layers, experts, slots_per_gpu * gpus, gpus, nodes, groups)
    kind = draw(st.sampled_from(["int", "float", "zero", "skew"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if kind == "int":
        loads = rng.integers(0, 50, (layers, experts))
    elif kind == "float":
        loads = rng.lognormal(0, 1.5, (layers, experts))
    elif kind == "zero":
        loads = np.zeros((layers, experts))
    else:
        loads = rng.zipf(1.3, (layers, experts)).astype(np.float64)
    return loads, topo


def _feasible(policy: str, topo: eplb.Topology) -> bool:
    return policy != "hierarchical" or topo.hierarchical_ok


@pytest.mark.parametrize("policy", POLICIES)
@given(inst=instances())
def test_plan_is_a_valid_placement(policy: str, inst) -> None:
    loads, topo = inst
    if not _feasible(policy, topo):
        return
    plan = eplb.rebalance(loads, topo, policy)
    p = plan.placement
    assert p.phy2log.shape == (topo.num_layers, topo.num_slots)
    assert (p.logcnt.sum(axis=1) == topo.num_slots).all()
    assert (p.logcnt >= 1).all()
    # log2phy and phy2log agree both ways.
    for layer in range(topo.num_layers):
        for e in range(topo.num_experts):
            slots = p.log2phy[layer, e]
            slots = slots[slots >= 0]
            assert len(slots) == p.logcnt[layer, e]
            assert (p.phy2log[layer, slots] == e).all()
    assert (plan.imbalance >= plan.imbalance_lb - 1e-9).all()
    assert np.allclose(plan.gpu_load.sum(axis=1), loads.sum(axis=1))


def _groups_whole_on_nodes(plan: eplb.Plan, topo: eplb.Topology) -> bool:
    """Every node holds num_groups / num_nodes whole groups (every expert of each)."""
    per_node = plan.phy2log.reshape(topo.num_layers, topo.num_nodes, -1)
    for layer in range(topo.num_layers):
        for node in range(topo.num_nodes):
            experts = set(per_node[layer, node].tolist())
            groups = {e // topo.experts_per_group for e in experts}
            if len(groups) != topo.num_groups // topo.num_nodes:
                return False
            if any(
                e not in experts
                for g in groups
                for e in range(g * topo.experts_per_group, (g + 1) * topo.experts_per_group)
            ):
                return False
    return True


def _distinct_per_gpu(plan: eplb.Plan, topo: eplb.Topology) -> bool:
    srt = np.sort(plan.phy2log.reshape(topo.num_layers, topo.num_gpus, -1), axis=2)
    return bool((srt[:, :, 1:] != srt[:, :, :-1]).all())


@pytest.mark.parametrize("policy", POLICIES)
@given(inst=instances(), seed=st.integers(0, 2**31 - 1), start=st.sampled_from(["contiguous", "shuffled", "own"]))
def test_a_replan_from_any_previous_keeps_the_constraints_of_a_fresh_plan(
    policy: str, inst, seed: int, start: str
) -> None:
    loads, topo = inst
    if not _feasible(policy, topo):
        return
    rng = np.random.default_rng(seed)
    if start == "contiguous":
        prev = eplb.Placement.contiguous(topo)
    elif start == "shuffled":
        prev = eplb.Placement(rng.permuted(eplb.Placement.contiguous(topo).phy2log, axis=1), topo)
    else:
        prev = eplb.rebalance(rng.permuted(loads, axis=1), topo, policy).placement
    fresh = eplb.rebalance(loads, topo, policy)
    plan = eplb.rebalance(loads, topo, policy, previous=prev)
    assert plan.policy_used == fresh.policy_used
    assert (plan.logcnt >= 1).all() and (plan.logcnt.sum(axis=1) == topo.num_slots).all()
    assert (plan.moves == (plan.phy2log != prev.phy2log).sum(axis=1)).all()
    if fresh.policy_used == "hierarchical":
        assert _groups_whole_on_nodes(fresh, topo)
        assert _groups_whole_on_nodes(plan, topo)
    # A previous placement with two replicas of an expert on a gpu may be kept as it is.
    prev_distinct = bool(
        (np.diff(np.sort(prev.phy2log.reshape(topo.num_layers, topo.num_gpus, -1), axis=2), axis=2) != 0).all()
    )
    if policy != "deepseek" and prev_distinct and _distinct_per_gpu(fresh, topo):
        assert _distinct_per_gpu(plan, topo)


@pytest.mark.parametrize("policy", ["global", "hierarchical", "auto"])
@given(inst=instances())
def test_ours_never_put_two_replicas_of_an_expert_on_one_gpu(policy: str, inst) -> None:
    loads, topo = inst
    if not _feasible(policy, topo):
        return
    plan = eplb.rebalance(loads, topo, policy)
    per_gpu = plan.placement.experts_on_gpu()
    bins = topo.num_gpus
    if policy != "global" and plan.policy_used == "hierarchical":
        bins = topo.gpus_per_node
        avoidable = (topo.num_experts // topo.num_nodes) * bins >= topo.slots_per_node
    else:
        avoidable = topo.num_experts * bins >= topo.num_slots
    if avoidable:
        srt = np.sort(per_gpu, axis=2)
        assert not (srt[:, :, 1:] == srt[:, :, :-1]).any()
    # Replica counts are capped at the number of gpus that can hold them.
    if avoidable:
        assert plan.logcnt.max() <= bins


@given(inst=instances())
def test_hierarchical_keeps_each_node_on_whole_groups(inst) -> None:
    loads, topo = inst
    if not topo.hierarchical_ok:
        return
    plan = eplb.rebalance(loads, topo, "hierarchical")
    per_node = plan.phy2log.reshape(topo.num_layers, topo.num_nodes, topo.slots_per_node)
    groups = per_node // topo.experts_per_group
    for layer in range(topo.num_layers):
        owner = {}
        for n in range(topo.num_nodes):
            node_groups = set(groups[layer, n].tolist())
            assert len(node_groups) == topo.num_groups // topo.num_nodes
            for g in node_groups:
                assert owner.setdefault(g, n) == n  # a group lives on exactly one node


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_are_deterministic(policy: str) -> None:
    topo = SCALES["v3-prefill"]
    loads = make_loads("lognormal-1.0", topo, seed=3)
    a = eplb.rebalance(loads, topo, policy)
    b = eplb.rebalance(loads.copy(), topo, policy)
    assert np.array_equal(a.phy2log, b.phy2log)


def test_auto_picks_hierarchical_when_groups_fit_nodes_and_balance_allows_and_says_why() -> None:
    loads = np.arange(12 * 2, dtype=float).reshape(2, 12)
    fits = eplb.rebalance(loads, eplb.Topology(2, 12, 16, 8, 2, 4), "auto")
    assert fits.policy_used == "hierarchical"
    assert fits.notes[0].startswith("auto: groups fit nodes") and "within 2%" in fits.notes[0]
    falls = eplb.rebalance(loads, eplb.Topology(2, 12, 16, 8, 2, 3), "auto")
    assert falls.policy_used == "global"
    assert "num_groups (3)" in falls.notes[0] and "global" in falls.notes[0]
    one_group = eplb.rebalance(loads, eplb.Topology(2, 12, 16, 8, 2, 1), "auto")
    assert one_group.policy_used == "global" and "not group-limited" in one_group.notes[0]
    assert eplb.rebalance(loads, eplb.Topology(2, 12, 16, 8), "auto").notes == ()


def test_auto_takes_global_when_hierarchical_is_clearly_worse() -> None:
    # v3-64 has one group per node: hierarchical cannot spread a hot group (README's example).
    topo = SCALES["v3-64"].with_layers(4)
    loads = make_loads("zipf-1.5", SCALES["v3-64"])[:4]
    plan = eplb.rebalance(loads, topo, "auto", effort="fast")
    hier = eplb.rebalance(loads, topo, "hierarchical", effort="fast")
    glob = eplb.rebalance(loads, topo, "global", effort="fast")
    assert hier.mean_imbalance > glob.mean_imbalance * 1.02
    assert plan.policy_used == "global" and np.array_equal(plan.phy2log, glob.phy2log)
    assert "more than 2% above global's" in plan.notes[0]


@pytest.mark.parametrize(
    "topo",
    [
        eplb.Topology(1, 4, 4, 1),  # single gpu, P == E
        eplb.Topology(1, 8, 8, 4),  # P == E
        eplb.Topology(2, 6, 8, 8),  # one slot per gpu
        eplb.Topology(1, 4, 12, 1),  # single gpu, several replicas per expert unavoidable
    ],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_edge_topologies_give_valid_plans(topo: eplb.Topology, policy: str) -> None:
    rng = np.random.default_rng(0)
    for loads in (
        np.zeros((topo.num_layers, topo.num_experts)),
        rng.integers(0, 9, (topo.num_layers, topo.num_experts)),
    ):
        plan = eplb.rebalance(loads, topo, policy)
        assert (plan.logcnt.sum(axis=1) == topo.num_slots).all()
        assert (plan.logcnt >= 1).all()


def test_all_zero_layer_is_perfectly_balanced_and_spreads_replicas() -> None:
    topo = eplb.Topology(1, 8, 16, 4)
    plan = eplb.rebalance(np.zeros((1, 8)), topo, "global")
    assert plan.imbalance.tolist() == [1.0]
    assert plan.logcnt.tolist() == [[2] * 8]


def test_huge_integer_loads_up_to_2_pow_53_plan_correctly() -> None:
    topo = eplb.Topology(1, 4, 8, 4)
    loads = np.array([[2**53, 2**52, 3, 0]], dtype=np.int64)
    plan = eplb.rebalance(loads, topo, "global")
    # Integers up to 2**53 convert to float64 exactly; splitting them costs at most rounding.
    assert plan.gpu_load.sum() == pytest.approx(2**53 + 2**52 + 3, rel=1e-15)
    assert plan.logcnt[0, 0] >= plan.logcnt[0, 1] >= plan.logcnt[0, 2]
    # Best possible: four 2**51 replicas of expert 0, each gpu pairing one with a 2**51 one.
    assert plan.imbalance[0] == pytest.approx(4 / 3)


def test_global_known_answer_counts_chosen_for_the_busiest_gpu() -> None:
    # Water-filling gives [4, 2, 1, 1] (replicas 7.5, 9, 6, 6); without two copies of expert 0
    # on one gpu the best packing of those is 16.5. Counts [3, 3, 1, 1] (10, 6, 6, 6) pack as
    # 10 + 6 three times and 6 + 6: 16, the optimum (enumerating the count vectors shows it).
    topo = eplb.Topology(1, 4, 8, 4)
    loads = np.array([[30, 18, 6, 6]])
    water = eplb.rebalance(loads, topo, "global", refine=0, effort="fast")
    assert water.logcnt.tolist() == [[4, 2, 1, 1]]
    assert sorted(water.gpu_load[0].tolist()) == [13.5, 13.5, 16.5, 16.5]
    plan = eplb.rebalance(loads, topo, "global", effort="fast")
    assert plan.logcnt.tolist() == [[3, 3, 1, 1]]
    assert sorted(plan.gpu_load[0].tolist()) == [12.0, 16.0, 16.0, 16.0]


def test_unknown_or_bad_options_are_rejected() -> None:
    topo = eplb.Topology(1, 4, 8, 4)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['rounds'\]"):
        eplb.rebalance(np.ones((1, 4)), topo, "global", rounds=3)
    with pytest.raises(ValueError, match="refine must be an integer >= 0"):
        eplb.rebalance(np.ones((1, 4)), topo, "global", refine=-1)
    with pytest.raises(ValueError, match="donors must be an integer >= 1 or None, got 2.5"):
        eplb.rebalance(np.ones((1, 4)), topo, "global", donors=2.5)
    with pytest.raises(ValueError, match="effort must be one of 'fast', 'default', 'high'"):
        eplb.rebalance(np.ones((1, 4)), topo, "global", effort="max")
    for bad in (0, -1.0, "1s", True):
        with pytest.raises(ValueError, match="time_limit must be a positive number of seconds or None"):
            eplb.rebalance(np.ones((1, 4)), topo, "global", effort="high", time_limit=bad)
    for bad in (-1, "many", True):
        with pytest.raises(
            ValueError, match="work_budget must be a finite number of work units >= 0 per layer or None"
        ):
            eplb.rebalance(np.ones((1, 4)), topo, "global", work_budget=bad)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="workers must be an integer >= 1"):
            eplb.rebalance(np.ones((1, 4)), topo, "global", workers=bad)
    with pytest.raises(ValueError, match="gap must be a number >= 0"):
        eplb.rebalance(np.ones((1, 4)), topo, "global", gap=-0.1)


def test_high_effort_reaches_the_proven_optimum_of_the_known_answer() -> None:
    # From the issue: the CP-SAT optimum is 196.67 (mean 181.25); eplb.py gives 232.
    topo = eplb.Topology(1, 8, 16, 8)
    loads = np.array([[600, 560, 120, 120, 20, 10, 10, 10]])
    assert eplb.rebalance(loads, topo, "deepseek").gpu_load.max() == 232.0
    plan = eplb.rebalance(loads, topo, "global", effort="high")
    assert plan.gpu_load.max() == pytest.approx(590 / 3)
    assert plan.gpu_load.max() <= eplb.rebalance(loads, topo, "global").gpu_load.max()


def test_high_effort_without_time_limit_is_deterministic_and_a_short_limit_still_plans() -> None:
    topo = SCALES["v3-512"].with_layers(4)
    loads = make_loads("zipf-1.0", SCALES["v3-512"])[:4]
    a = eplb.rebalance(loads, topo, "global", effort="high", time_limit=None)
    b = eplb.rebalance(loads, topo, "global", effort="high", time_limit=None)
    assert np.array_equal(a.phy2log, b.phy2log)
    # Two slots per gpu: the exhaustive re-pack (pairing) beats the fast plan.
    fast = eplb.rebalance(loads, topo, "global", effort="fast")
    assert a.mean_imbalance < fast.mean_imbalance
    short = eplb.rebalance(loads, topo, "global", effort="high", time_limit=0.01)
    assert short.placement.topology == topo
    assert short.imbalance.max() <= fast.imbalance.max() + 1e-12


def test_default_effort_searches_after_the_first_plan_within_its_work_budget() -> None:
    topo = SCALES["v3-512"].with_layers(4)
    loads = make_loads("zipf-1.0", SCALES["v3-512"])[:4]
    fast = eplb.rebalance(loads, topo, "global", effort="fast")
    plan = eplb.rebalance(loads, topo, "global")
    assert plan.search.layers_searched == 4 and not plan.search.timed_out
    assert 0 < plan.search.work <= 4 * 100_000 * 1.5  # stops within a step of the budget
    assert (plan.imbalance <= fast.imbalance + 1e-12).all()
    assert plan.mean_imbalance < fast.mean_imbalance - 0.02
    none = eplb.rebalance(loads, topo, "global", work_budget=0)
    assert np.array_equal(none.phy2log, fast.phy2log) and none.search.work == 0
    assert fast.search.work == 0 and fast.search.layers_searched == 0


def test_a_plan_does_not_depend_on_the_number_of_workers() -> None:
    topo = SCALES["qwen3-64"].with_layers(40)
    loads = make_loads("zipf-1.5", SCALES["qwen3-64"])[:40]
    one = eplb.rebalance(loads, topo, "global", work_budget=20_000)
    two = eplb.rebalance(loads, topo, "global", work_budget=20_000, workers=2)
    assert np.array_equal(one.phy2log, two.phy2log)
    assert one.search == two.search


@pytest.mark.parametrize("policy", ["global", "hierarchical"])
def test_high_effort_with_a_single_expert(policy: str) -> None:
    # Every count vector of one expert is just [P]: the enumeration must not choke on it.
    topo = eplb.Topology(2, 1, 2, 2)
    plan = eplb.rebalance(np.array([[3.0], [0.0]]), topo, policy, effort="high")
    assert plan.phy2log.tolist() == [[0, 0], [0, 0]]


def test_hierarchical_keeps_hot_experts_off_shared_gpus() -> None:
    from math import lcm

    from eplb.enumeration import improve_or_prove

    # Node 0 holds experts 40, 12 and 10 with 4 spare slots on 4 gpus. Water-filling gives
    # 40 four replicas and 12 two, so two gpus hold both (18.33); fewer shared replicas win.
    node0 = [40, 12, 10, 1, 1, 1, 1, 1]
    loads = np.array([node0 + [2] * 8], dtype=float)
    topo = eplb.Topology(1, 16, 24, 8, 2, 2)
    plan = eplb.rebalance(loads, topo, "hierarchical")
    # The proven optimum of node 0 alone (exact enumeration, integer units).
    scale = lcm(1, 2, 3, 4)
    w = np.array(node0)[:, None] * scale // np.arange(1, 5)[None, :]
    done, best, _ = improve_or_prove(w, 4, 3, int(w.sum()) * 3)
    assert done
    assert plan.gpu_load.max() == pytest.approx(best / scale)
    assert plan.gpu_load.max() == pytest.approx(53 / 3)


@pytest.mark.parametrize("effort", ["fast", "default"])
def test_auto_skips_hierarchical_when_the_grouping_bound_rules_it_out(effort: str) -> None:
    # v3-prefill lognormal 1.0: no split of groups onto nodes comes within 2 % of global's first
    # plan, so auto takes global without planning hierarchical, and says which bound decided.
    topo = SCALES["v3-prefill"].with_layers(4)
    loads = make_loads("lognormal-1.0", SCALES["v3-prefill"])[:4]
    plan = eplb.rebalance(loads, topo, "auto", effort=effort)
    glob = eplb.rebalance(loads, topo, "global", effort=effort)
    hier = eplb.rebalance(loads, topo, "hierarchical", effort="fast")
    assert plan.policy_used == "global" and np.array_equal(plan.phy2log, glob.phy2log)
    assert "grouping bound" in plan.notes[0] and "more than 2% above global's" in plan.notes[0]
    bound = float((group_bound(loads, topo) / (loads.sum(axis=1) / topo.num_gpus)).mean())
    assert glob.mean_imbalance * 1.02 < bound <= hier.mean_imbalance


def test_auto_counts_its_comparison_of_first_plans_against_the_time_limit(monkeypatch) -> None:
    # The comparison outlasts the limit: the old auto then planned the chosen policy in full
    # with a limit of its own, searching past the caller's. Now the chosen first plan returns.
    import importlib
    import time

    policies = importlib.import_module("eplb.policies")  # eplb.policies the name is a function
    real = policies.gpu_loads

    def slow(loads: np.ndarray, placement: eplb.Placement) -> np.ndarray:
        time.sleep(0.25)  # one comparison (global alone, where the grouping bound rules out hierarchical) outlasts it
        return real(loads, placement)

    monkeypatch.setattr(policies, "gpu_loads", slow)
    topo = SCALES["v3-prefill"].with_layers(4)
    loads = make_loads("zipf-1.5", SCALES["v3-prefill"])[:4]
    plan = eplb.rebalance(loads, topo, "auto", time_limit=0.2)
    assert plan.search.work == 0 and plan.search.timed_out and plan.search.first_plan_over
    assert plan.notes[0].startswith("auto: ") and any("ran out during the first plan" in n for n in plan.notes)
    assert np.array_equal(plan.phy2log, eplb.rebalance(loads, topo, "auto", effort="fast").phy2log)
    searched = eplb.rebalance(loads, topo, "auto")
    assert searched.policy_used == plan.policy_used and searched.search.work > 0
