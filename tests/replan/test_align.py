"""eplb.replan.align: the fresh plan relabelled onto the previous one."""

import numpy as np

import eplb
from eplb.workloads import SCALES, make_loads


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
