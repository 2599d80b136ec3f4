"""Spreading hot experts' replicas over nodes (``rebalance(spread_nodes=True)``)."""

from __future__ import annotations

import numpy as np

import eplb
from eplb.planner.spread import spread_nodes
from eplb.workloads import SCALES, make_loads


def test_spread_puts_each_hot_expert_on_two_nodes_where_slots_allow():
    # 4 gpus of 3 slots on 2 nodes; expert 0 (hot) twice on node 0, expert 1 twice on node 1.
    topo = eplb.Topology(1, 10, 12, 4, 2)
    phy = np.array([[0, 2, 3, 0, 4, 5, 1, 6, 7, 1, 8, 9]])
    loads = np.array([[20.0, 10.0, 1, 1, 1, 1, 1, 1, 1, 1]])
    out, swaps = spread_nodes(loads, phy, topo)
    assert swaps == 1  # one swap of a replica of 0 with one of 1 spreads both
    node = np.arange(12) // 6
    for e in (0, 1):
        assert np.unique(node[out[0] == e]).size == 2
    assert sorted(out[0].tolist()) == sorted(phy[0].tolist())  # swaps only: same counts
    for g in range(4):
        on = out[0, 3 * g : 3 * g + 3]
        assert np.unique(on).size == 3  # no gpu holds an expert twice


def test_rebalance_spread_nodes_lowers_experts_on_one_node_and_says_the_cost():
    topo = SCALES["qwen3-64"].with_layers(4)
    loads = make_loads("lognormal-1.0", topo)
    base = eplb.rebalance(loads, topo)
    wide = eplb.rebalance(loads, topo, spread_nodes=True)
    assert (wide.single_node <= base.single_node).all()
    assert wide.single_node.sum() < base.single_node.sum()
    # Every expert with two or more replicas is now on two nodes.
    assert (wide.single_node == wide.single_homed).all()
    assert (wide.logcnt == base.logcnt).all()
    assert "spread_nodes:" in wide.notes[-1] and "mean imbalance" in wide.notes[-1]


def test_spread_nodes_keeps_down_gpus_empty():
    topo = SCALES["qwen3-64"].with_layers(2)
    loads = make_loads("zipf-1.0", topo)
    plan = eplb.rebalance(loads, topo, down_gpus=[9], spread_nodes=True)
    assert (plan.phy2log[:, 27:30] == -1).all()
    assert (plan.logcnt >= 1).all()
