"""eplb.replan.candidates: repairs, recounts and regrouping of the previous placement."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import eplb
from eplb.workloads import SCALES, drift, make_loads


@given(
    data=st.data(),
    bins=st.integers(2, 6),
    per_bin=st.integers(1, 4),
)
def test_recount_sets_the_counts_and_touches_only_changed_experts(data: st.DataObject, bins: int, per_bin: int) -> None:
    from eplb.layout import replica_counts
    from eplb.planner.replicate import waterfill
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


def test_a_layer_with_an_expert_twice_on_a_gpu_leaves_the_other_layers_repairs_alone() -> None:
    from eplb.replan.candidates import repair_previous

    topo = eplb.Topology(4, 48, 64, 8)
    seq = drift(make_loads("lognormal-1.0", topo, seed=3), 0.3, 2, seed=3)
    prev = eplb.rebalance(seq[0], topo, "global").placement
    fresh = eplb.rebalance(seq[1], topo, "global")
    target = 1.005 * fresh.gpu_load.max(axis=1)
    clean = repair_previous(seq[1], prev, topo, target, False, fresh.phy2log)
    # Layer 0: a gpu holds one expert twice (written over a replica of an expert that keeps one).
    odd = prev.phy2log.copy()
    cnt = np.bincount(odd[0], minlength=topo.num_experts)
    spare = [p for p in range(topo.num_slots) if cnt[odd[0, p]] >= 2]
    p, q = next((p, q) for p in spare for q in spare if p != q and p // 8 == q // 8)
    odd[0, q] = odd[0, p]
    dirty = repair_previous(seq[1], eplb.Placement(odd, topo), topo, target, False, fresh.phy2log)
    for name in clean:
        assert (clean[name][1:] != prev.phy2log[1:]).any()  # the other layers did repair
        assert (dirty[name][1:] == clean[name][1:]).all()


@pytest.mark.parametrize("topo", [eplb.Topology(6, 96, 112, 16), eplb.Topology(4, 128, 160, 32)])
def test_giving_up_hopeless_repairs_from_the_contiguous_start_costs_no_moves(topo: eplb.Topology) -> None:
    from eplb.replan.candidates import candidates
    from eplb.replan.pick import pick_within

    loads = make_loads("lognormal-1.0", topo, seed=5)
    old = eplb.Placement.contiguous(topo).phy2log
    fresh = eplb.rebalance(loads, topo, "global")
    targets = [(1 + k * 0.01) * fresh.gpu_load.max(axis=1) for k in (0.5, 1.0, 3.0)]
    budget = 1.01 * fresh.imbalance.sum() * (1 + 1e-12)
    cap = 1.05 * fresh.imbalance * (1 + 1e-12)
    picks = {}
    for give_up in (None, 2.5):
        names, cands, imb, moves, _ = candidates(loads, old, fresh.phy2log, topo, targets, False, True, 1, give_up)
        pick = pick_within(moves, imb, cap, budget, None)
        cols = np.arange(topo.num_layers)
        picks[give_up] = (moves[pick, cols].sum(), imb[pick, cols], moves[names.index("repaired")])
    full, short = picks[None], picks[2.5]
    assert (short[2] == 0).any() and (full[2] > 0).all()  # some layers were given up, unrepaired
    assert short[0] <= full[0]
    assert short[1].sum() <= budget and (short[1] <= cap).all()


def test_a_replan_from_the_contiguous_start_stays_within_the_tolerances() -> None:
    topo = eplb.Topology(6, 96, 112, 16)
    loads = make_loads("lognormal-1.0", topo, seed=6)
    fresh = eplb.rebalance(loads, topo, "global")
    plan = eplb.rebalance(loads, topo, "global", previous=eplb.Placement.contiguous(topo))
    assert plan.mean_imbalance <= 1.01 * fresh.mean_imbalance + 1e-9
    assert (plan.imbalance <= 1.05 * fresh.imbalance + 1e-9).all()
    assert plan.replan.layers_kept == 0 and plan.total_moves > 0


def test_a_repair_whose_rows_all_reach_the_target_before_the_swaps_leaves_them_be() -> None:
    from eplb.replan.candidates import repair_previous

    # Expert 0 (30) has three replicas on gpus 0-2, each 1.2 above the target of 10: one count
    # move (a fourth replica over one of expert 1's) fixes all three, so the swaps after it in
    # that order get no rows at all.
    topo = eplb.Topology(1, 7, 10, 5)
    loads = np.array([[30.0, 4.0, 1.2, 1.2, 1.2, 2.0, 2.0]])
    prev = eplb.Placement(np.array([[0, 2, 0, 3, 0, 4, 1, 5, 1, 6]]), topo)
    out = repair_previous(loads, prev, topo, np.array([10.0]), False)
    assert (eplb.gpu_loads(loads, eplb.Placement(out["repaired"], topo)) <= 10.0).all()
    assert (out["repaired"] != prev.phy2log).sum() == 1


def _repair_case(scale: str, by_node: bool) -> tuple:
    """Six layers of ``scale``: loads, the previous plan's rows (local to nodes when
    ``by_node``), recount counts (``True``: water-filling per node), node experts, targets."""
    from eplb.layout import replica_counts
    from eplb.replan import candidates as C

    t = SCALES[scale].with_layers(6)
    policy = "hierarchical" if by_node else "global"
    prev = eplb.rebalance(make_loads("lognormal-1.0", t, seed=3), t, policy).phy2log
    loads = make_loads("lognormal-1.0", t, seed=4)
    fresh = eplb.rebalance(loads, t, policy).phy2log
    target = 1.005 * eplb.gpu_loads(loads, eplb.Placement(fresh, t)).max(axis=1)
    node_exp = C._node_experts(prev, t) if by_node else None
    assert (node_exp is not None) == by_node
    if node_exp is None:
        phy = prev.reshape(t.num_layers, t.num_gpus, -1).astype(np.int64)
        counts = replica_counts(fresh.reshape(t.num_layers, t.num_gpus, -1).astype(np.int64), t.num_experts)
    else:
        phy = C._to_local(prev.reshape(-1, t.gpus_per_node, t.slots_per_gpu), node_exp, t.num_experts)
        counts = True
    return t, loads, phy, counts, node_exp, target


CASES = [("v3-decode-144", False), ("qwen3-64", False), ("v3-prefill", True)]


@pytest.mark.parametrize(("scale", "by_node"), CASES)
def test_repaired_and_recounted_in_one_pass_equal_two_passes(scale: str, by_node: bool) -> None:
    # _repair_pair runs the rows of both repairs through _best_order together: each row must
    # come out as it does from its own _repair_rows call (rows are independent there).
    from eplb.replan import candidates as C

    t, loads, phy, counts, node_exp, target = _repair_case(scale, by_node)
    one = C._repair_rows(loads, phy, target, None, node_exp, t)
    two = C._repair_rows(loads, phy, target, counts, node_exp, t, like=one)
    a, b = C._repair_pair(loads, phy, target, counts, node_exp, t)
    for x, y in zip(one + two, a + b):
        assert np.array_equal(x, y)
    assert (one[0] != phy).any() and (two[0] != phy).any()  # both repairs did something


def _best_order_one_at_a_time(loads, phy, cand, tgt, cap) -> np.ndarray:
    """The orders of ``_best_order`` each run on its own (as before they were stacked)."""
    from eplb.layout import REL_TOL, bin_loads, distinct_rows
    from eplb.replan import candidates as C
    from eplb.replan.moves import count_repair

    c = cand.copy()
    dist = np.flatnonzero(distinct_rows(cand))
    sub = c[dist]
    count_repair(loads[dist], sub, tgt[dist], cap)
    c[dist] = sub
    outs = [C._finish(loads, c, tgt, cap, chains=True), C._finish(loads, cand.copy(), tgt, cap, chains=False)]
    if phy.shape[2] <= C._CHAINS_FIRST_SLOTS:
        outs.append(C._finish(loads, cand.copy(), tgt, cap, chains=True))
    busiest = np.stack([bin_loads(loads, x).max(axis=1) for x in outs])
    moved = np.stack([(x != phy).sum(axis=(1, 2)) for x in outs])
    best = np.lexsort((busiest, moved, busiest > tgt * (1 + REL_TOL)), axis=0)[0]
    return np.stack(outs)[best, np.arange(len(tgt))]


@pytest.mark.parametrize(("scale", "by_node"), CASES)
def test_stacked_orders_equal_the_orders_one_at_a_time(scale: str, by_node: bool) -> None:
    from eplb.planner.replicate import replica_cap
    from eplb.replan import candidates as C

    t, loads, phy, counts, node_exp, target = _repair_case(scale, by_node)
    rep, rows, cap = C._repair_start(loads, phy, target, counts, node_exp, t, None, 1)
    start, row_loads, tgt = rep.start, rep.loads, rep.target
    assert rows.size and cap == replica_cap(row_loads.shape[1], phy.shape[1] * phy.shape[2], phy.shape[1])
    got = C._best_order(row_loads[rows], phy[rows], start[rows], tgt[rows], cap)
    want = _best_order_one_at_a_time(row_loads[rows], phy[rows], start[rows], tgt[rows], cap)
    assert np.array_equal(got, want)
    assert (got != start[rows]).any()
