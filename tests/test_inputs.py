"""Bad input gets a ValueError saying what is wrong and what is allowed."""

import numpy as np
import pytest

import eplb


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=1, num_experts=8, num_slots=7, num_gpus=1), r"num_slots \(7\) must be >= num_experts \(8\)"),
        (dict(num_layers=1, num_experts=8, num_slots=9, num_gpus=2), r"num_slots \(9\) must be a multiple of num_gpus \(2\)"),
        (dict(num_layers=1, num_experts=8, num_slots=8, num_gpus=4, num_nodes=3), r"num_gpus \(4\) must be a multiple of num_nodes \(3\)"),
        (dict(num_layers=1, num_experts=8, num_slots=8, num_gpus=4, num_groups=3), r"num_experts \(8\) must be a multiple of num_groups \(3\)"),
        (dict(num_layers=1.5, num_experts=8, num_slots=8, num_gpus=4), r"num_layers must be a positive integer, got 1.5"),
        (dict(num_layers=1, num_experts=8, num_slots=8, num_gpus=0), r"num_gpus must be a positive integer, got 0"),
        (dict(num_layers=True, num_experts=8, num_slots=8, num_gpus=4), r"num_layers must be a positive integer"),
        (dict(num_layers=1, num_experts="8", num_slots=8, num_gpus=4), r"num_experts must be a positive integer"),
    ],
)
def test_topology_names_the_field_and_the_rule(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        eplb.Topology(**kwargs)


TOPO = eplb.Topology(2, 4, 8, 4)


@pytest.mark.parametrize(
    "loads, match",
    [
        (np.array([[1.0, np.nan, 1, 1], [1, 1, 1, 1]]), r"finite; loads\[0, 1\] is nan"),
        (np.array([[1.0, 1, 1, 1], [1, np.inf, 1, 1]]), r"finite; loads\[1, 1\] is inf"),
        (np.array([[1, 1, -2, 1], [1, 1, 1, 1]]), r">= 0; loads\[0, 2\] is -2"),
        (np.ones((2, 5)), r"shape \[2, 5\]; expected \[num_layers, num_experts\] = \[2, 4\]"),
        (np.ones(4), r"shape \[4\]"),
        (np.array([["a"] * 4] * 2), r"integers or floats"),
        (np.ones((2, 4), dtype=bool), r"integers or floats"),
        ([[1, 2], [3]], r"numeric"),
    ],
)
@pytest.mark.parametrize("policy", ["global", "deepseek"])
def test_bad_loads_are_rejected(loads, match: str, policy: str) -> None:
    with pytest.raises(ValueError, match=match):
        eplb.rebalance(loads, TOPO, policy)


def test_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'best'.*global"):
        eplb.rebalance(np.ones((2, 4)), TOPO, "best")


def test_hierarchical_needs_groups_that_fit_nodes() -> None:
    with pytest.raises(ValueError, match=r"num_groups \(3\) to be a multiple of num_nodes \(2\)"):
        eplb.rebalance(np.ones((1, 6)), eplb.Topology(1, 6, 8, 4, 2, 3), "hierarchical")


def test_placement_rejects_missing_experts_and_bad_ids() -> None:
    topo = eplb.Topology(1, 4, 4, 2)
    with pytest.raises(ValueError, match="expert 3 of layer 0 without a replica"):
        eplb.Placement(np.array([[0, 1, 2, 2]]), topo)
    with pytest.raises(ValueError, match=r"allowed range is \[0, 3\]"):
        eplb.Placement(np.array([[0, 1, 2, 4]]), topo)
    with pytest.raises(ValueError, match=r"expected \[num_layers, num_slots\] = \[1, 4\]"):
        eplb.Placement(np.array([[0, 1, 2]]), topo)


def test_previous_placement_must_match_topology() -> None:
    prev = eplb.Placement.contiguous(eplb.Topology(1, 4, 8, 4))
    with pytest.raises(ValueError, match="previous placement is for"):
        eplb.rebalance(np.ones((2, 4)), TOPO, "global", previous=prev)
