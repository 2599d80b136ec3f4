"""Metrics against hand-computed values."""

import numpy as np

import eplb


def test_gpu_load_imbalance_and_balancedness_by_hand() -> None:
    topo = eplb.Topology(1, 3, 4, 2)
    # gpu 0: experts 0, 1; gpu 1: experts 0, 2. Expert 0 has two replicas splitting 10.
    p = eplb.Placement(np.array([[0, 1, 0, 2]]), topo)
    loads = np.array([[10.0, 4.0, 2.0]])
    g = eplb.gpu_loads(loads, p)
    assert g.tolist() == [[9.0, 7.0]]
    assert eplb.imbalance(g).tolist() == [9.0 / 8.0]
    assert eplb.balancedness(g).tolist() == [8.0 / 9.0]


def test_lower_bound_is_the_larger_of_mean_and_best_replica_split() -> None:
    topo = eplb.Topology(1, 3, 4, 2)
    # One spare slot: best split gives expert 0 two replicas → max replica load 5; mean 8.
    assert eplb.lower_bound(np.array([[10.0, 4.0, 2.0]]), topo).tolist() == [8.0]
    # A dominant expert: its two replicas carry 50 each, below the mean 52.
    assert eplb.lower_bound(np.array([[100.0, 2.0, 2.0]]), topo).tolist() == [52.0]
    # Three slots per expert pair: the hot expert's best split is 300 / 3 = 100 > mean 80.
    assert eplb.lower_bound(np.array([[300.0, 20.0]]), eplb.Topology(1, 2, 4, 4)).tolist() == [100.0]
    assert eplb.imbalance_lb(np.array([[300.0, 20.0]]), eplb.Topology(1, 2, 4, 4)).tolist() == [1.25]


def test_moves_count_changed_slots() -> None:
    topo = eplb.Topology(2, 2, 4, 2)
    a = eplb.Placement(np.array([[0, 1, 0, 1], [0, 1, 1, 0]]), topo)
    b = eplb.Placement(np.array([[0, 1, 1, 0], [0, 1, 1, 0]]), topo)
    assert eplb.moves(a, b).tolist() == [2, 0]


def test_log2phy_has_fixed_width_and_lists_slots_in_order() -> None:
    topo = eplb.Topology(1, 3, 6, 3)
    p = eplb.Placement(np.array([[2, 0, 0, 1, 0, 2]]), topo)
    assert p.log2phy.shape == (1, 3, 4)
    assert p.log2phy[0].tolist() == [[1, 2, 4, -1], [3, -1, -1, -1], [0, 5, -1, -1]]
    assert p.replica_rank.tolist() == [[0, 0, 1, 0, 2, 1]]
