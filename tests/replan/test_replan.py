"""Migration-aware re-planning: experts stay where they are unless moving pays."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eplb
from eplb.workloads import SCALES, drift, make_loads


@pytest.mark.parametrize("policy", ["global", "hierarchical", "auto"])
def test_unchanged_loads_and_own_previous_give_zero_moves(policy: str) -> None:
    topo = SCALES["v3-prefill"]
    loads = make_loads("lognormal-1.0", topo, seed=1)
    first = eplb.rebalance(loads, topo, policy)
    again = eplb.rebalance(loads, topo, policy, previous=first.placement)
    assert again.moves.tolist() == [0] * topo.num_layers
    assert np.array_equal(again.phy2log, first.phy2log)


@pytest.mark.parametrize("policy", ["global", "hierarchical"])
def test_drift_replan_moves_few_slots_and_stays_within_tolerance(policy: str) -> None:
    topo = SCALES["v3-prefill"]
    seq = drift(make_loads("lognormal-1.0", topo, seed=2), 0.05, 3, seed=2)
    prev = eplb.rebalance(seq[0], topo, policy).placement
    for loads in seq[1:]:
        fresh = eplb.rebalance(loads, topo, policy)
        plan = eplb.rebalance(loads, topo, policy, previous=prev, tolerance=0.01)
        # The mean over layers within 1 % of fresh, each layer within the default 5 %.
        assert plan.mean_imbalance <= 1.01 * fresh.mean_imbalance + 1e-9
        assert (plan.imbalance <= 1.05 * fresh.imbalance + 1e-9).all()
        tight = eplb.rebalance(loads, topo, policy, previous=prev, tolerance=0.01, layer_tolerance=0.01)
        assert (tight.imbalance <= 1.01 * fresh.imbalance + 1e-9).all()
        assert plan.total_moves <= tight.total_moves
        # The same balance from scratch rewrites almost everything.
        assert plan.total_moves < 0.5 * eplb.moves(prev, fresh.placement).sum()
        assert plan.moves.tolist() == eplb.moves(prev, plan.placement).tolist()
        prev = plan.placement


def test_experts_that_stay_on_a_gpu_keep_their_slot() -> None:
    topo = SCALES["v3-prefill"]
    base = make_loads("zipf-1.0", topo, seed=3)
    prev = eplb.rebalance(base, topo, "global").placement
    # A domain switch forces a real re-plan on every layer.
    shuffled = base[:, np.random.default_rng(3).permutation(topo.num_experts)]
    plan = eplb.rebalance(shuffled, topo, "global", previous=prev, tolerance=0.0)
    old = prev.experts_on_gpu()
    new = plan.placement.experts_on_gpu()
    for layer in range(topo.num_layers):
        for g in range(topo.num_gpus):
            for s in range(topo.slots_per_gpu):
                if old[layer, g, s] in new[layer, g]:
                    assert new[layer, g, s] == old[layer, g, s]


def test_hierarchical_replan_keeps_groups_whole_on_nodes() -> None:
    topo = SCALES["v3-prefill"]
    base = make_loads("lognormal-1.0", topo, seed=4)
    prev = eplb.rebalance(base, topo, "hierarchical").placement
    shifted = base[:, ::-1].copy()
    plan = eplb.rebalance(shifted, topo, "hierarchical", previous=prev)
    per_node = plan.phy2log.reshape(topo.num_layers, topo.num_nodes, -1) // topo.experts_per_group
    for layer in range(topo.num_layers):
        owners = [set(per_node[layer, n].tolist()) for n in range(topo.num_nodes)]
        assert sum(len(o) for o in owners) == topo.num_groups  # each group on exactly one node


def test_bad_tolerance_is_rejected() -> None:
    topo = eplb.Topology(1, 4, 8, 4)
    prev = eplb.Placement.contiguous(topo)
    with pytest.raises(ValueError, match=r"tolerance must be a number >= 0 \(a fraction, 0.01 = 1 %\), got -0.5"):
        eplb.rebalance(np.ones((1, 4)), topo, "global", previous=prev, tolerance=-0.5)
    with pytest.raises(ValueError, match="layer_tolerance must be a number >= 0"):
        eplb.rebalance(np.ones((1, 4)), topo, "global", previous=prev, layer_tolerance="5%")


@pytest.mark.parametrize("policy", ["global", "hierarchical", "auto"])
@pytest.mark.parametrize(
    "option, value, match",
    [
        ("tolerance", -1, r"tolerance must be a number >= 0 .*got -1"),
        ("tolerance", float("nan"), r"tolerance must be a number >= 0 .*got nan"),
        ("layer_tolerance", "5%", r"layer_tolerance must be a number >= 0 .*got '5%'"),
        ("max_moves", -3, r"max_moves must be an integer >= 0 .*got -3"),
        ("max_layer_moves", 1.5, r"max_layer_moves must be an integer >= 0 .*got 1.5"),
    ],
)
def test_bad_replan_options_are_rejected_without_previous_too(
    policy: str, option: str, value: object, match: str
) -> None:
    topo = eplb.Topology(2, 8, 16, 4, 2, 2)
    with pytest.raises(ValueError, match=match):
        eplb.rebalance(np.ones((2, 8)), topo, policy, **{option: value})


def test_an_unbounded_tolerance_keeps_the_previous_placement_without_overflow() -> None:
    topo = eplb.Topology(4, 32, 48, 8)
    loads = np.random.default_rng(0).lognormal(0, 1, (4, 32)) * 1e300
    prev = eplb.rebalance(loads, topo, "global").placement
    with np.errstate(all="raise"):  # (1 + k tolerance) x a gpu's load must not overflow
        for tol in (1e300, float("inf")):
            plan = eplb.rebalance(loads[::-1].copy(), topo, "global", previous=prev, tolerance=tol, layer_tolerance=tol)
            assert plan.total_moves == 0
            assert np.array_equal(plan.phy2log, prev.phy2log)


def _random_replan(data: st.DataObject, drifts: list[float]) -> tuple[eplb.Topology, np.ndarray, eplb.Placement]:
    """A small random topology, loads after one drift step of a drawn sigma, and the ``global``
    plan of the loads before it."""
    G = data.draw(st.integers(2, 6), label="gpus")
    S = data.draw(st.integers(1, 4), label="slots per gpu")
    P = G * S
    E = data.draw(st.integers(max(1, -(-P // G)), P), label="experts")
    L = data.draw(st.integers(1, 3), label="layers")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    topo = eplb.Topology(L, E, P, G)
    before = rng.lognormal(0, 1, (L, E))
    after = before * rng.lognormal(0, data.draw(st.sampled_from(drifts), label="drift"), (L, E))
    return topo, after, eplb.rebalance(before, topo, "global").placement


@pytest.mark.parametrize("policy", ["global", "hierarchical"])
def test_a_move_budget_caps_the_moves_and_buys_balance_with_them(policy: str) -> None:
    topo = SCALES["v3-prefill"]
    seq = drift(make_loads("lognormal-1.0", topo, seed=5), 0.2, 2, seed=5)
    prev = eplb.rebalance(seq[0], topo, policy).placement
    free = eplb.rebalance(seq[1], topo, policy, previous=prev)
    kept = eplb.imbalance(eplb.gpu_loads(seq[1], prev))
    assert not free.replan.budget_limited
    # A budget the tolerance does not need changes nothing.
    roomy = eplb.rebalance(seq[1], topo, policy, previous=prev, max_moves=free.total_moves)
    assert np.array_equal(roomy.phy2log, free.phy2log) and not roomy.replan.budget_limited
    half = free.total_moves // 2
    tight = eplb.rebalance(seq[1], topo, policy, previous=prev, max_moves=half)
    assert tight.replan.budget_limited
    assert any(n.startswith(f"move budget (max_moves={half}, max_layer_moves=None) held") for n in tight.notes)
    assert not free.notes
    assert half * 0.8 <= tight.total_moves <= half  # the budget is spent, not exceeded
    assert free.mean_imbalance < tight.mean_imbalance < kept.mean()
    assert (tight.imbalance <= kept + 1e-12).all()  # no layer worse than before
    frozen = eplb.rebalance(seq[1], topo, policy, previous=prev, max_moves=0)
    assert frozen.total_moves == 0 and np.array_equal(frozen.phy2log, prev.phy2log)


@pytest.mark.parametrize("scale,policy", [("kimi-64", "global"), ("v3-prefill", "hierarchical")])
def test_a_layer_move_budget_holds_in_every_layer(scale: str, policy: str) -> None:
    topo = SCALES[scale]
    seq = drift(make_loads("lognormal-1.0", topo, seed=6), 0.2, 2, seed=6)
    prev = eplb.rebalance(seq[0], topo, policy).placement
    free = eplb.rebalance(seq[1], topo, policy, previous=prev)
    limit = int(np.median(free.moves[free.moves > 0]))
    plan = eplb.rebalance(seq[1], topo, policy, previous=prev, max_layer_moves=limit)
    assert plan.moves.max() <= limit < free.moves.max()
    assert plan.replan.budget_limited
    assert plan.mean_imbalance < eplb.imbalance(eplb.gpu_loads(seq[1], prev)).mean()


@given(data=st.data())
def test_move_budgets_hold_on_random_layouts(data: st.DataObject) -> None:
    topo, after, prev = _random_replan(data, [0.5])
    total = data.draw(st.none() | st.integers(0, topo.num_layers * topo.num_slots), label="max moves")
    per_layer = data.draw(st.none() | st.integers(0, topo.num_slots), label="max layer moves")
    plan = eplb.rebalance(after, topo, "global", previous=prev, max_moves=total, max_layer_moves=per_layer)
    kept = eplb.imbalance(eplb.gpu_loads(after, prev))
    assert total is None or plan.total_moves <= total
    assert per_layer is None or plan.moves.max() <= per_layer
    assert (plan.imbalance <= kept * (1 + 1e-9)).all()
    if not plan.replan.budget_limited:
        fresh = eplb.rebalance(after, topo, "global")
        assert plan.mean_imbalance <= 1.01 * fresh.mean_imbalance + 1e-9


def test_bad_move_budget_is_rejected() -> None:
    topo = eplb.Topology(1, 4, 8, 4)
    prev = eplb.Placement.contiguous(topo)
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ValueError, match=r"max_moves must be an integer >= 0 \(slots rewritten\) or None"):
            eplb.rebalance(np.ones((1, 4)), topo, "global", previous=prev, max_moves=bad)
    with pytest.raises(ValueError, match="max_layer_moves must be an integer >= 0"):
        eplb.rebalance(np.ones((1, 4)), topo, "global", previous=prev, max_layer_moves=-3)


def test_align_preserves_balance_exactly() -> None:
    from eplb.replan.align import align_to_previous

    topo = SCALES["kimi-64"]
    a = make_loads("lognormal-1.0", topo, seed=5)
    b = make_loads("lognormal-1.0", topo, seed=6)
    prev = eplb.rebalance(a, topo, "global").placement
    fresh = eplb.rebalance(b, topo, "global")
    aligned = eplb.Placement(align_to_previous(fresh.phy2log, prev, topo, by_node=False), topo)
    assert np.allclose(np.sort(eplb.gpu_loads(b, aligned), axis=1), np.sort(fresh.gpu_load, axis=1))
    assert eplb.moves(prev, aligned).sum() < eplb.moves(prev, fresh.placement).sum()


@given(
    data=st.data(),
    bins=st.integers(2, 6),
    per_bin=st.integers(1, 4),
)
def test_recount_sets_the_counts_and_touches_only_changed_experts(data: st.DataObject, bins: int, per_bin: int) -> None:
    from eplb.layout import replica_counts
    from eplb.place.replicate import waterfill
    from eplb.replan.candidates import recount

    P = bins * per_bin
    E = data.draw(st.integers(max(1, (P + bins - 1) // bins), P), label="experts")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    loads = rng.lognormal(0, 1, (1, E))
    topo = eplb.Topology(1, E, P, bins)
    phy = eplb.rebalance(loads, topo, "global").phy2log.reshape(1, bins, per_bin).astype(np.int64)
    # Target counts: water-filling on other loads, at most one replica per gpu.
    want = waterfill(rng.lognormal(0, 1, (1, E)), P, bins)[0]
    out, ok = recount(loads * rng.lognormal(0, 0.5, (1, E)), phy, want[None])
    if not ok[0]:  # every free slot sat on a gpu that already held the gaining expert
        return
    have = replica_counts(phy, E)[0]
    assert (replica_counts(out, E)[0] == want).all()
    assert all(len(set(g)) == per_bin for g in out[0].tolist())  # no expert twice on a gpu
    changed = out[0] != phy[0]
    # Only slots of experts that lost a replica change, and only to experts that gain one.
    assert (want[phy[0][changed]] < have[phy[0][changed]]).all()
    assert (want[out[0][changed]] > have[out[0][changed]]).all()
    assert changed.sum() == np.maximum(want - have, 0).sum()


def test_two_slots_per_gpu_drift_is_recounted_not_replanned() -> None:
    # 2 slots per gpu: balance hangs on the replica counts of the hottest experts.
    topo = SCALES["v3-decode-144"]
    seq = drift(make_loads("lognormal-1.0", topo, seed=7), 0.2, 3, seed=7)
    prev = eplb.rebalance(seq[0], topo, "global").placement
    for loads in seq[1:]:
        fresh = eplb.rebalance(loads, topo, "global")
        plan = eplb.rebalance(loads, topo, "global", previous=prev, tolerance=0.01, layer_tolerance=0.01)
        assert (plan.gpu_load.max(axis=1) <= 1.01 * fresh.gpu_load.max(axis=1) + 1e-9).all()
        assert plan.replan.layers_recounted > 0
        assert plan.total_moves < 0.2 * topo.num_slots * topo.num_layers
        prev = plan.placement


def test_a_node_above_the_target_is_fixed_by_swapping_groups() -> None:
    topo = eplb.Topology(4, 64, 80, 8, 2, 4)  # 4 groups of 16 on 2 nodes of 4 gpus
    rng = np.random.default_rng(8)
    base = rng.lognormal(0, 0.3, (4, 64))
    prev = eplb.rebalance(base, topo, "hierarchical").placement
    # Both groups on node 0 get 1.5 times the load: that node is far above the other, and
    # only pairing a heavy group with a light one balances the nodes again.
    loads = base.copy()
    for layer in range(4):
        for g in set((prev.phy2log[layer].reshape(2, -1)[0] // 16).tolist()):
            loads[layer, g * 16 : (g + 1) * 16] *= 1.5
    fresh = eplb.rebalance(loads, topo, "hierarchical")
    plan = eplb.rebalance(loads, topo, "hierarchical", previous=prev, tolerance=0.01, layer_tolerance=0.01)
    assert plan.replan.layers_regrouped == 4
    assert (plan.gpu_load.max(axis=1) <= 1.01 * fresh.gpu_load.max(axis=1) + 1e-9).all()
    per_node = plan.phy2log.reshape(4, 2, -1) // 16
    for layer in range(4):
        assert len(set(per_node[layer, 0].tolist()) & set(per_node[layer, 1].tolist())) == 0
    # One group swap moves two groups' slots, not the whole layer.
    assert (plan.moves <= 0.7 * topo.num_slots).all()


@given(data=st.data())
def test_pick_meets_the_budget_and_respects_what_is_allowed(data: st.DataObject) -> None:
    from itertools import product

    from eplb.replan.pick import pick

    C = data.draw(st.integers(2, 4), label="candidates")
    L = data.draw(st.integers(1, 4), label="layers")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    imb = 1.0 + rng.random((C, L)) * 0.1
    imb[-1] = 1.0  # the last candidate (fresh aligned) is always allowed and best balanced
    cost = np.floor(rng.random((C, L)) * 20)
    cost[0] = 0.0
    cost[rng.random((C, L)) < 0.2] = np.inf
    cost[-1] = 30.0
    budget = imb[-1].sum() * (1 + data.draw(st.floats(0, 0.1), label="slack"))
    pick = pick(cost, imb, budget)
    cols = np.arange(L)
    assert np.isfinite(cost[pick, cols]).all()
    assert imb[pick, cols].sum() <= budget + 1e-12
    # Never far from the best choice found by trying every combination.
    best = min(
        cost[list(c), cols].sum()
        for c in product(range(C), repeat=L)
        if np.isfinite(cost[list(c), cols]).all() and imb[list(c), cols].sum() <= budget + 1e-12
    )
    assert cost[pick, cols].sum() <= best + 30.0


@given(data=st.data())
def test_replan_keeps_the_mean_and_layer_bounds_on_random_layouts(data: st.DataObject) -> None:
    topo, after, prev = _random_replan(data, [0.05, 0.5])
    L = topo.num_layers
    tol = data.draw(st.sampled_from([0.0, 0.01, 0.05]), label="tolerance")
    layer_tol = data.draw(st.sampled_from([0.0, 0.02, 0.05, 0.5]), label="layer tolerance")
    fresh = eplb.rebalance(after, topo, "global")
    plan = eplb.rebalance(after, topo, "global", previous=prev, tolerance=tol, layer_tolerance=layer_tol)
    assert plan.mean_imbalance <= (1 + tol) * fresh.mean_imbalance + 1e-9
    assert (plan.imbalance <= (1 + layer_tol) * fresh.imbalance + 1e-9).all()
    assert sum(plan.replan.layers().values()) == L
    # Every expert keeps a replica; the placement validated on construction.
    assert (plan.logcnt >= 1).all()


def test_a_rotation_fixes_two_gpus_with_three_slots() -> None:
    from eplb.layout import bin_loads, replica_counts
    from eplb.place.packing import rotate_improve

    # Gpus 0 and 1 are 1 above the target of 10; gpu 2 has room. Expert weights: 5, 4, 3, 2, 1.
    # A rotation: gpu 0 gives 5 to gpu 2, gpu 2 gives 3 to gpu 1, gpu 1 gives 4 to gpu 0.
    loads = np.array([[5.0, 4.0, 3.0, 6.0, 7.0, 2.0]])
    phy = np.array([[[0, 3], [1, 4], [2, 5]]])  # loads 11, 11, 5
    target = np.array([10.0])
    before = phy.copy()
    rotate_improve(loads, phy, target)
    assert (bin_loads(loads, phy) <= 10.0).all()
    assert (phy != before).sum() == 3
    assert (replica_counts(phy, 6) == replica_counts(before, 6)).all()
    assert all(len(set(g)) == 2 for g in phy[0].tolist())


def _drifted_layout(
    data: st.DataObject, gpus: tuple[int, int], slots: tuple[int, int], spare: int, sigma: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two layers planned by `global`, then drifted: the drifted loads ``[2, E]``, the plan's
    ``[2, B, S]`` experts per gpu and a target ``[2]`` at a drawn quantile of the gpu loads."""
    from eplb.layout import bin_loads

    B = data.draw(st.integers(*gpus), label="gpus")
    S = data.draw(st.integers(*slots), label="slots per gpu")
    E = data.draw(st.integers(S, B * S - spare), label="experts")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    loads = rng.lognormal(0, 1, (2, E))
    topo = eplb.Topology(2, E, B * S, B)
    phy = eplb.rebalance(loads, topo, "global").phy2log.reshape(2, B, S).astype(np.int64)
    drifted = loads * rng.lognormal(0, sigma, loads.shape)
    bins = bin_loads(drifted, phy)
    target = np.quantile(bins, data.draw(st.floats(0.3, 0.95), label="target quantile"), axis=1)
    return drifted, phy, target


def _repair_keeping_counts(repair, drifted: np.ndarray, phy: np.ndarray, target: np.ndarray) -> tuple:
    """Runs ``repair(drifted, phy, target)`` in place and checks what every counts-kept repair
    keeps: replica counts, no expert twice on a gpu, untouched bins' loads. Returns the bin
    loads before and after ``[2, B]`` and which bins it touched."""
    from eplb.layout import bin_loads, replica_counts

    E, S = drifted.shape[1], phy.shape[2]
    before, bins = phy.copy(), bin_loads(drifted, phy)
    repair(drifted, phy, target)
    after = bin_loads(drifted, phy)
    assert (replica_counts(phy, E) == replica_counts(before, E)).all()
    assert all(len(set(g)) == S for g in phy.reshape(-1, S).tolist())
    touched = (phy != before).any(axis=2)
    assert np.allclose(after[~touched], bins[~touched])
    return bins, after, touched


@given(data=st.data())
def test_rotations_never_overload_a_gpu_or_change_counts(data: st.DataObject) -> None:
    from eplb.place.packing import rotate_improve

    drifted, phy, target = _drifted_layout(data, (3, 8), (1, 4), 0, 0.3)
    B = phy.shape[1]
    _, after, touched = _repair_keeping_counts(rotate_improve, drifted, phy, target)
    # Every bin a rotation touched ends at most at the target.
    assert (after[touched] <= np.repeat(target[:, None], B, axis=1)[touched] + 1e-9).all()


def test_an_ejection_chain_fixes_three_gpus_with_four_slots() -> None:
    from eplb.layout import bin_loads, replica_counts
    from eplb.replan.moves import chain_improve

    # Target 20. Gpu 0 (load 10) has room 10; gpus 1, 2, 3 are 1, 2 and 3 above the target.
    # The chain: gpu 0 gives 1 to gpu 1, gpu 1 gives 3 to gpu 2, gpu 2 gives 6 to gpu 3 and
    # gpu 3 gives 9.5 to gpu 0: four slots for three gpus (swaps would take six).
    loads = np.array([[1.0, 9.0, 3.0, 18.0, 6.0, 16.0, 9.5, 13.5]])
    phy = np.array([[[0, 1], [2, 3], [4, 5], [6, 7]]])
    before = phy.copy()
    chain_improve(loads, phy, np.array([20.0]))
    assert (bin_loads(loads, phy) <= 20.0).all()
    assert (phy != before).sum() == 4
    assert phy[0].tolist() == [[6, 1], [0, 3], [2, 5], [4, 7]]
    assert (replica_counts(phy, 8) == replica_counts(before, 8)).all()


@given(data=st.data())
def test_chains_fix_gpus_for_at_most_one_and_a_half_slots_each(data: st.DataObject) -> None:
    from eplb.replan.moves import chain_improve

    drifted, phy, target = _drifted_layout(data, (3, 10), (1, 4), 0, 0.3)
    B = phy.shape[1]
    before = phy.copy()
    bins, after, touched = _repair_keeping_counts(chain_improve, drifted, phy, target)
    tgt = np.repeat(target[:, None], B, axis=1)
    # Touched bins end at most at the target; each chain of k >= 2 bins above the target
    # rewrites k + 1 slots.
    assert (after[touched] <= tgt[touched] * (1 + 1e-9)).all()
    fixed = ((bins > tgt * (1 + 1e-12)) & (after <= tgt * (1 + 1e-9))).sum()
    assert (phy != before).sum() <= 1.5 * fixed


def test_one_count_move_fixes_every_gpu_of_an_expert_that_grew() -> None:
    from eplb.layout import bin_loads, replica_counts
    from eplb.replan.moves import count_repair

    # Expert 0 (30) has three replicas on gpus 0-2, each 1.2 above the target of 10. Writing a
    # fourth over one of expert 1's two replicas brings all three under it with one slot
    # (swaps would rewrite six).
    loads = np.array([[30.0, 4.0, 1.2, 1.2, 1.2, 2.0, 2.0]])
    phy = np.array([[[0, 2], [0, 3], [0, 4], [1, 5], [1, 6]]])
    before = phy.copy()
    count_repair(loads, phy, np.array([10.0]), cap=5)
    assert (bin_loads(loads, phy) <= 10.0).all()
    assert (phy != before).sum() == 1
    assert replica_counts(phy, 7)[0, :2].tolist() == [4, 1]


@given(data=st.data())
def test_count_repairs_fix_at_least_a_gpu_per_slot(data: st.DataObject) -> None:
    from eplb.layout import bin_loads, replica_counts
    from eplb.place.replicate import replica_cap
    from eplb.replan.moves import count_repair

    drifted, phy, target = _drifted_layout(data, (2, 10), (2, 4), 1, 0.5)
    E, (_, B, S) = drifted.shape[1], phy.shape
    before, bins = phy.copy(), bin_loads(drifted, phy)
    count_repair(drifted, phy, target, replica_cap(E, B * S, B))
    after = bin_loads(drifted, phy)
    cnt = replica_counts(phy, E)
    assert (cnt >= 1).all() and (cnt.sum(axis=1) == B * S).all()
    assert all(len(set(g)) == S for g in phy.reshape(-1, S).tolist())
    # Each rewritten slot is a count move that left at least one gpu fewer above the target,
    # and the excess above it only shrank.
    over = lambda x: (x > target[:, None] * (1 + 1e-12)).sum(axis=1)  # noqa: E731
    moved = (phy != before).sum(axis=(1, 2))
    assert (over(after) <= over(bins) - moved).all()
    excess = lambda x: np.maximum(x - target[:, None] * (1 + 1e-12), 0).sum(axis=1)  # noqa: E731
    assert (excess(after) <= excess(bins) + 1e-9).all()


def _same_plan(one: eplb.Plan, two: eplb.Plan) -> None:
    assert np.array_equal(one.phy2log, two.phy2log)
    assert one.replan == two.replan and one.notes == two.notes


def test_replans_in_worker_processes_equal_one_process_where_only_some_chunks_regroup() -> None:
    # 40 layers: three chunks of layers in the pool. Only the first 10 layers (chunk 0) get a
    # node far above the other; chunk 1 swaps groups in no pass (measured), so it pads the
    # "regrouped" candidate with its "recounted" one, which must not change any pick.
    topo = eplb.Topology(40, 64, 80, 8, 2, 4)
    rng = np.random.default_rng(9)
    base = rng.lognormal(0, 0.3, (40, 64))
    prev = eplb.rebalance(base, topo, "hierarchical").placement
    loads = base * rng.lognormal(0, 0.02, base.shape)
    for layer in range(10):
        for g in set((prev.phy2log[layer].reshape(2, -1)[0] // 16).tolist()):
            loads[layer, g * 16 : (g + 1) * 16] *= 1.5
    for budget in ({}, {"max_moves": 200}):
        one = eplb.rebalance(loads, topo, "hierarchical", previous=prev, layer_tolerance=0.01, **budget)
        two = eplb.rebalance(loads, topo, "hierarchical", previous=prev, layer_tolerance=0.01, workers=2, **budget)
        _same_plan(one, two)
        assert one.replan.layers_regrouped > 0
    assert one.replan.budget_limited and one.total_moves <= 200
    # A previous placement that splits groups across nodes: those layers take fresh aligned.
    contiguous = eplb.Placement.contiguous(topo)
    one = eplb.rebalance(loads, topo, "hierarchical", previous=contiguous)
    two = eplb.rebalance(loads, topo, "hierarchical", previous=contiguous, workers=2)
    _same_plan(one, two)
    assert one.replan.layers_replanned == topo.num_layers


@pytest.mark.slow
@pytest.mark.parametrize(("scale", "policy"), [("kimi-64", "auto"), ("v3-prefill", "hierarchical")])
@pytest.mark.parametrize("share", [None, 0.05])
def test_replans_in_worker_processes_equal_one_process_at_full_scale(scale: str, policy: str, share: float) -> None:
    topo = SCALES[scale]
    seq = drift(make_loads("lognormal-1.0", topo), 0.2, 2)
    prev = eplb.rebalance(seq[0], topo, policy).placement
    budget = {} if share is None else {"max_moves": int(share * topo.num_slots * topo.num_layers)}
    one = eplb.rebalance(seq[1], topo, policy, previous=prev, **budget)
    two = eplb.rebalance(seq[1], topo, policy, previous=prev, workers=2, **budget)
    _same_plan(one, two)
    assert one.total_moves > 0
    assert one.replan.budget_limited == (share is not None)
