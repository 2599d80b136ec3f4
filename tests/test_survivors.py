"""Placements with gpus down: empty slots in every library function, and survivor plans."""

from __future__ import annotations

import numpy as np
import pytest

import eplb
from eplb import formats, simulate, transfer
from eplb.layout import bin_loads, replica_counts
from eplb.survivors import live_topology, restore, survivors
from eplb.workloads import SCALES, make_loads

# 2 layers, 8 experts, 4 gpus of 4 slots on 2 nodes, 4 groups.
TOPO = eplb.Topology(2, 8, 16, 4, 2, 4)


def _loads(topo: eplb.Topology, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(0, 1, (topo.num_layers, topo.num_experts)) * 100


def _survivor() -> eplb.Placement:
    """Gpu 1 down: its slots -1; every expert once on gpus 0, 2, 3 (plus four replicas)."""
    rows = [[0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7, 0, 1, 2, 4], [4, 5, 6, 7, -1, -1, -1, -1, 0, 1, 2, 3, 4, 5, 6, 0]]
    return eplb.Placement(np.array(rows), TOPO)


def test_placement_accepts_empty_slots_and_maps_skip_them():
    p = _survivor()
    assert p.down_gpus == (1,)
    assert not p.full
    assert p.logcnt[0].tolist() == [2, 2, 2, 1, 2, 1, 1, 1]
    l2p = p.log2phy[0]
    assert (p.phy2log[0][l2p[l2p >= 0]] >= 0).all()  # log2phy never points at an empty slot
    assert l2p[0, :2].tolist() == [0, 12]
    assert (p.replica_rank[0, 4:8] == -1).all()
    assert p.replica_rank[0, 12] == 1


def test_placement_rejects_ids_below_minus_one_and_lost_experts():
    row = np.array([[0, 1, 2, 3, -2, -1, -1, -1, 4, 5, 6, 7, 0, 1, 2, 4]] * 2)
    with pytest.raises(ValueError, match="-1 for an empty slot"):
        eplb.Placement(row, TOPO)
    row = np.array([[0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 0, 0, 1, 2, 4]] * 2)  # expert 7 lost
    with pytest.raises(ValueError, match="expert 7 of layer 0 without a replica"):
        eplb.Placement(row, TOPO)


def test_replica_counts_and_bin_loads_skip_empty_slots():
    phy = np.array([[[0, -1], [1, 1]], [[-1, -1], [2, 0]]])
    assert replica_counts(phy, 3).tolist() == [[1, 2, 0], [1, 0, 1]]
    loads = np.array([[4.0, 2.0, 8.0], [4.0, 2.0, 8.0]])
    # Row 1's empty bin reads the zero column, not row 0's last expert.
    assert bin_loads(loads, phy).tolist() == [[4.0, 2.0], [0.0, 12.0]]


def test_metrics_treat_down_gpus_as_absent():
    p = _survivor()
    loads = np.ones((2, 8))
    load = eplb.gpu_loads(loads, p)
    assert np.isnan(load[:, 1]).all()
    live = load[:, [0, 2, 3]]
    assert np.allclose(np.nansum(load, axis=1), 8.0)
    assert np.allclose(eplb.imbalance(load), live.max(axis=1) / live.mean(axis=1))
    assert np.allclose(eplb.balancedness(load), live.mean(axis=1) / live.max(axis=1))
    # The bound over 3 live gpus of 4 slots: 8 experts of load 1 over 12 slots, mean 8 / 3.
    assert np.allclose(eplb.lower_bound(loads, TOPO, down_gpus=[1]), 8 / 3)
    assert np.allclose(eplb.imbalance_lb(loads, TOPO, down_gpus=[1]), 1.0)
    full = eplb.Placement.contiguous(TOPO)
    # A slot that empties copies nothing; the others count as before.
    assert eplb.moves(full, p).tolist() == [int(((full.phy2log[0] != p.phy2log[0]) & (p.phy2log[0] >= 0)).sum())] + [
        int(((full.phy2log[1] != p.phy2log[1]) & (p.phy2log[1] >= 0)).sum())
    ]
    assert eplb.moves(p, full).tolist() == list((p.phy2log != full.phy2log).sum(axis=1))


def test_survivors_checks_down_gpus_before_any_work():
    with pytest.raises(ValueError, match=r"only 8 live slots \(2 live gpus x 4 slots\) for 8 experts|gpus"):
        survivors(eplb.Topology(1, 9, 16, 4), [0, 1])
    with pytest.raises(ValueError, match="only 4 live slots .* for 8 experts with gpus \\[0, 1, 2\\] down"):
        eplb.rebalance(_loads(TOPO), TOPO, down_gpus=[2, 0, 1])
    with pytest.raises(ValueError, match="more than once"):
        eplb.rebalance(_loads(TOPO), TOPO, down_gpus=[1, 1])
    with pytest.raises(ValueError, match=r"integers in \[0, 3\]"):
        eplb.rebalance(_loads(TOPO), TOPO, down_gpus=[4])


@pytest.mark.parametrize("policy", ["auto", "global", "hierarchical", "deepseek"])
def test_rebalance_with_a_down_gpu_keeps_every_expert_live(policy):
    loads = _loads(TOPO)
    plan = eplb.rebalance(loads, TOPO, policy, down_gpus=[1])
    phy = plan.phy2log
    assert (phy[:, 4:8] == -1).all()
    assert (phy[:, np.r_[0:4, 8:16]] >= 0).all()
    assert (plan.logcnt >= 1).all()
    assert plan.down_gpus == (1,)
    assert np.isnan(plan.gpu_load[:, 1]).all()
    assert plan.notes[0].startswith("gpus [1] down")
    # The live gpus' own problem, planned alone, gives the same balance.
    red = survivors(TOPO, [1]).reduced
    name = "global" if policy == "hierarchical" else policy
    alone = eplb.rebalance(loads, red, name)
    assert np.allclose(plan.imbalance, alone.imbalance)


def test_hierarchical_keeps_groups_on_live_nodes_when_nodes_stay_equal():
    topo = eplb.Topology(2, 16, 32, 8, 2, 4)
    loads = _loads(topo)
    plan = eplb.rebalance(loads, topo, "hierarchical", down_gpus=[0, 4])  # one per node
    assert plan.policy_used == "hierarchical"
    assert any("kept whole on the 2 live nodes" in n for n in plan.notes)
    node = np.arange(32) // 16
    for layer in range(2):
        for g in range(4):
            held = np.isin(plan.phy2log[layer], np.arange(4 * g, 4 * g + 4))
            assert np.unique(node[held]).size == 1
    one = eplb.rebalance(loads, topo, "hierarchical", down_gpus=[0])  # unequal nodes
    assert one.policy_used == "global"
    assert any("planned with global" in n for n in one.notes)


def test_survivor_plan_from_previous_restores_lost_experts_and_stays_balanced():
    topo = SCALES["v3-prefill"].with_layers(8)
    loads = make_loads("lognormal-1.0", topo)
    prev = eplb.rebalance(loads, topo).placement
    down = [5]
    plan = eplb.rebalance(loads, topo, previous=prev, down_gpus=down)
    fresh = eplb.rebalance(loads, topo, down_gpus=down)
    assert (plan.logcnt >= 1).all()
    assert plan.mean_imbalance <= fresh.mean_imbalance * 1.01 * (1 + 1e-9)
    lost = (replica_counts(np.delete(prev.phy2log.reshape(8, 32, 9), 5, axis=1), 256) == 0).sum(axis=1)
    assert (plan.moves >= lost).all()
    # Far fewer slots rewritten than the fresh survivor plan's.
    assert plan.total_moves < eplb.moves(prev, fresh.placement).sum() / 2


def test_survivor_plan_is_deterministic_for_any_workers():
    topo = SCALES["v3-prefill"].with_layers(20)
    loads = make_loads("zipf-1.0", topo)
    prev = eplb.rebalance(loads, topo).placement
    a = eplb.rebalance(loads, topo, previous=prev, down_gpus=[3, 17])
    b = eplb.rebalance(loads, topo, previous=prev, down_gpus=[17, 3])
    c = eplb.rebalance(loads, topo, previous=prev, down_gpus=[3, 17], workers=2)
    assert a.placement == b.placement == c.placement


def test_gpus_coming_back_are_used_again_migration_aware():
    loads = _loads(TOPO)
    down = eplb.rebalance(loads, TOPO, down_gpus=[1])
    back = eplb.rebalance(loads, TOPO, previous=down.placement)
    assert back.placement.full
    assert (back.moves >= 4).all()  # the returning gpu's four slots are loaded
    assert (back.moves < 16).all()
    assert any("4 empty slots filled" in n or "empty slots filled" in n for n in back.notes)
    # fewer down than before: only gpu 2 of [1, 2] stays down
    both = eplb.rebalance(loads, eplb.Topology(2, 8, 24, 6), down_gpus=[1, 2])
    one = eplb.rebalance(loads, both.placement.topology, previous=both.placement, down_gpus=[2])
    assert one.down_gpus == (2,)
    assert (one.phy2log[:, 4:8] >= 0).all()


def test_restore_fills_lost_experts_and_empty_slots():
    t = eplb.Topology(1, 4, 6, 3)
    phy = np.array([[0, 0, 1, 2, -1, -1]])  # expert 3 lost, gpu 2 empty
    out = restore(np.array([[1.0, 1.0, 1.0, 5.0]]), phy, t, False)
    assert sorted(set(out[0].tolist())) == [0, 1, 2, 3]
    assert (out >= 0).all()
    assert out[0, :4].tolist() == [0, 0, 1, 2]  # lost expert and fills go to the empty slots


def test_policy_that_leaves_slots_empty_is_a_policy_error():
    @eplb.register_policy("test-empty-slots")
    def _bad(loads, topology, options):
        phy = np.tile(np.arange(topology.num_slots) % topology.num_experts, (topology.num_layers, 1))
        phy[:, -1] = -1
        return eplb.PolicyResult(phy, "test-empty-slots")

    try:
        with pytest.raises(eplb.PolicyError, match="left 2 slots empty"):
            eplb.rebalance(_loads(TOPO), TOPO, "test-empty-slots")
    finally:
        eplb.unregister_policy("test-empty-slots")


def test_single_homed_and_single_node():
    p = _survivor()
    plan = eplb.rebalance(np.ones((2, 8)), TOPO, "global", previous=p, max_moves=0, down_gpus=[1])
    assert plan.single_homed.tolist() == [int((plan.logcnt[layer] == 1).sum()) for layer in range(2)]
    # slots 0-7 are node 0; expert 3 (once, slot 3) is on node 0 only, expert 0 on both.
    assert plan.single_node[0] == sum(np.unique(np.flatnonzero(plan.phy2log[0] == e) // 8).size == 1 for e in range(8))
    assert eplb.rebalance(np.ones((2, 8)), eplb.Topology(2, 8, 16, 4)).single_node is None


def test_transfer_plan_restores_experts_no_live_gpu_holds():
    old = eplb.Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7]] * 2), TOPO)
    new = _survivor()
    tp = transfer.transfer_plan(old, new, TOPO)
    assert not np.isin(tp.src_gpu, [1]).any()  # the down gpu sends nothing
    assert not np.isin(tp.dst_gpu, [1]).any()
    restores = tp.kind == transfer.RESTORE
    # Layer 0: experts 4..7 lived only on gpu 1 (slots 4-7) and gpu 3 (12-15); gpu 3 still
    # holds 4, 5, 6, 7 in old, so nothing needs a restore there.
    assert (tp.src_slot[restores] == -1).all()
    assert tp.kind_counts()["restore"] == int(restores.sum())
    lost = eplb.Placement(np.array([[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]] * 2), TOPO)
    tp2 = transfer.transfer_plan(lost, new, TOPO)
    assert tp2.kind_counts()["restore"] > 0  # experts 4..7 were on gpu 1 alone
    assert tp2.restored_bytes.sum() == tp2.kind_counts()["restore"]
    sched = transfer.transfer_schedule(lost, new, TOPO)
    assert sched.restore_layer.size > 0
    assert not np.isin(sched.recv_src_gpu, [1]).any()
    changed = int(((lost.phy2log != new.phy2log) & (new.phy2log >= 0)).sum())
    assert sched.recv_layer.size + sched.local_layer.size + sched.fill_layer.size + sched.restore_layer.size == changed


def test_formats_round_trip_empty_slots():
    p = _survivor()
    assert formats.from_native(formats.to_native(p)) == p
    assert formats.from_sglang(formats.to_sglang(p), num_gpus=4, num_nodes=2, num_groups=4) == p
    assert formats.from_vllm(formats.to_vllm(p), num_gpus=4, num_nodes=2, num_groups=4) == p
    text = formats.to_listing(p, np.ones((2, 8)))
    assert "layer 0 gpu 1 node 0: -1 -1 -1 -1 | down" in text
    assert formats.from_listing(text) == p


def test_simulate_routes_no_token_to_a_down_gpu():
    p = _survivor()
    pop = np.arange(1, 9, dtype=float)
    got = simulate.sample_gpu_loads(pop, p, tokens_per_gpu=64, topk=2, steps=20)
    assert (got[:, 1] == 0).all()
    assert (got.sum(axis=1) == 3 * 64 * 2).all()  # three live gpus of 64 tokens, two visits each
    exp = simulate.expected_gpu_load(pop, p, 64, 2)
    assert np.isnan(exp[1]) and np.isclose(np.nansum(exp), 3 * 64 * 2)
    stats = simulate.simulate_steps(pop, p, 64, 2, 20)
    assert np.isfinite(stats.expected_ratio) and stats.expected_ratio >= 1.0


def test_fast_survivor_plan_repairs_the_carried_placement_toward_the_fast_plan():
    topo = SCALES["qwen3-64"].with_layers(6)
    loads = make_loads("lognormal-1.0", topo)
    prev = eplb.rebalance(loads, topo).placement
    fast = eplb.rebalance(loads, topo, previous=prev, down_gpus=[8, 9], effort="fast")
    assert (fast.logcnt >= 1).all()
    assert (fast.phy2log[:, 24:30] == -1).all()
    fresh = eplb.rebalance(loads, topo, down_gpus=[8, 9], effort="fast")
    assert fast.mean_imbalance <= fresh.mean_imbalance * 1.01 * (1 + 1e-9)
    # The carried placement alone (restore, no repair) is what the repair starts from: it is
    # no better balanced than the fast plan.
    live = survivors(topo, [8, 9])
    carried = eplb.Placement(live.expand(restore(loads, live.restrict(prev.phy2log), live.reduced, False)), topo)
    assert fast.mean_imbalance <= eplb.imbalance(eplb.gpu_loads(loads, carried)).mean()
    again = eplb.rebalance(loads, topo, previous=prev, down_gpus=[9, 8], effort="fast")
    assert again.placement == fast.placement


def test_live_topology_is_the_reduced_topology_of_survivors_without_its_arrays():
    # rebalance checks a plan's memory on it before anything of the topology's size exists.
    for down in ([], [1], [0, 1], [0, 2], [2, 3]):
        assert live_topology(TOPO, down) == survivors(TOPO, down).reduced
    assert live_topology(TOPO, [0, 2]).num_nodes == 2 and live_topology(TOPO, [0, 1]).num_nodes == 1
    with pytest.raises(ValueError, match=r"only 8 live slots \(2 live gpus x 4 slots\) for 16 experts"):
        live_topology(eplb.Topology(1, 16, 16, 4), [0, 1])
