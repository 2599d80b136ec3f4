"""Bad input gets a ValueError saying what is wrong and what is allowed."""

import re

import numpy as np
import pytest

import eplb


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=1, num_experts=8, num_slots=7, num_gpus=1), r"num_slots \(7\) must be >= num_experts \(8\)"),
        (
            dict(num_layers=1, num_experts=8, num_slots=9, num_gpus=2),
            r"num_slots \(9\) must be a multiple of num_gpus \(2\)",
        ),
        (
            dict(num_layers=1, num_experts=8, num_slots=8, num_gpus=4, num_nodes=3),
            r"num_gpus \(4\) must be a multiple of num_nodes \(3\)",
        ),
        (
            dict(num_layers=1, num_experts=8, num_slots=8, num_gpus=4, num_groups=3),
            r"num_experts \(8\) must be a multiple of num_groups \(3\)",
        ),
        (
            dict(num_layers=1.5, num_experts=8, num_slots=8, num_gpus=4),
            r"num_layers must be a positive integer, got 1.5",
        ),
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


FMAX = np.finfo(np.float64).max


@pytest.mark.parametrize("policy", ["global", "hierarchical", "auto", "deepseek"])
@pytest.mark.parametrize(
    "loads",
    [
        np.full((2, 4), 1e308),  # the sum overflows float64
        np.array([[1.0, 1, 1, 1], [FMAX / 4, 0, 0, 0]]),  # a finite sum, but x num_slots overflows
    ],
)
def test_loads_too_large_to_plan_are_rejected_naming_the_limit(loads: np.ndarray, policy: str) -> None:
    topo = eplb.Topology(2, 4, 8, 4, 2, 2)
    assert eplb.loads.max_layer_sum(topo) == FMAX / 8
    match = rf"loads too large: layer \d sums to .*, above the limit of {re.escape(f'{FMAX / 8:.4g}')} per layer"
    with np.errstate(all="raise"), pytest.raises(ValueError, match=match):
        eplb.rebalance(loads, topo, policy)


def test_deepseek_refuses_loads_eplb_py_cannot_sum_in_float32() -> None:
    loads = np.array([[1.0, 1, 1, 1], [1e38, 1e38, 1e38, 1e38]])
    eplb.rebalance(loads, TOPO, "global")  # well within float64
    with pytest.raises(
        ValueError, match=r"loads too large: layer 1 sums to 4e\+38, above the limit of 1.701e\+38 .*float32"
    ):
        eplb.rebalance(loads, TOPO, "deepseek")


def test_loads_just_within_the_limit_plan_without_overflow() -> None:
    topo = eplb.Topology(4, 32, 48, 8, 2, 4)
    base = np.random.default_rng(0).lognormal(0, 2, (4, 32))
    base /= base.sum(axis=1, keepdims=True)
    small = eplb.rebalance(base, topo, "auto")
    with np.errstate(all="raise"):
        for policy in ("global", "hierarchical", "auto"):
            loads = base * eplb.loads.max_layer_sum(topo) * (1 - 1e-9)
            plan = eplb.rebalance(loads, topo, policy)
            again = eplb.rebalance(loads[:, ::-1].copy(), topo, policy, previous=plan.placement)
            assert np.isfinite(plan.imbalance).all() and np.isfinite(again.imbalance).all()
        plan = eplb.rebalance(base * 2.0**127 * (1 - 1e-9), topo, "deepseek")
        assert np.isfinite(plan.imbalance).all()
    # The same placement as the loads at their usual scale: only the ratios matter here.
    assert np.array_equal(
        eplb.rebalance(base * eplb.loads.max_layer_sum(topo) * 0.5, topo, "auto").phy2log, small.phy2log
    )


def test_compat_rejects_weights_eplb_py_cannot_sum_in_float32() -> None:
    from eplb.compat.deepseek import rebalance_experts

    with pytest.raises(ValueError, match=r"weight too large: layer 1 sums to 4e\+38.*eplb.py computes in float32"):
        rebalance_experts(np.array([[1.0, 1, 1, 1], [1e38, 1e38, 1e38, 1e38]]), 8, 2, 2, 4)
    big_int = np.full((1, 4), 2**62, dtype=np.int64)  # fits float32, and an int64 sum would wrap
    phy2log, _, _ = rebalance_experts(big_int, 8, 2, 2, 4)
    assert sorted(np.bincount(phy2log[0])) == [2, 2, 2, 2]


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


def test_gpu_loads_names_a_shape_that_does_not_fit_the_placement() -> None:
    # It used to be numpy's "operands could not be broadcast together".
    topo = eplb.Topology(2, 8, 8, 4)
    placement = eplb.Placement.contiguous(topo)
    with pytest.raises(
        ValueError, match=re.escape("loads has shape [2, 6]; the placement needs [num_layers, num_experts] = [2, 8]")
    ):
        eplb.gpu_loads(np.ones((2, 6)), placement)
    with pytest.raises(ValueError, match="placement must be a Placement, got ndarray"):
        eplb.gpu_loads(np.ones((2, 8)), placement.phy2log)
    assert eplb.gpu_loads(np.ones((2, 8)), placement).tolist() == [[2.0] * 4] * 2


def test_make_loads_with_swapped_arguments_says_so() -> None:
    # It used to be AttributeError: 'Topology' object has no attribute 'partition'.
    from eplb.workloads import make_loads

    topo = eplb.Topology(2, 8, 8, 4)
    with pytest.raises(
        ValueError,
        match=r"workload must be a name such as 'zipf-0.5', got Topology \(the arguments are \(workload, topology\): swapped\?\)",
    ):
        make_loads(topo, "zipf-1.0")
    with pytest.raises(ValueError, match="topology must be a Topology, got tuple"):
        make_loads("zipf-1.0", (2, 8, 8, 4))
    assert make_loads("zipf-1.0", topo).shape == (2, 8)


@pytest.mark.parametrize("options", [dict(tolerance=0.5), dict(max_moves=3, layer_tolerance=0.1)])
def test_rebalance_refuses_replan_bounds_without_previous(options: dict) -> None:
    # tolerance=0.5 without previous= used to be ignored silently (eplb place refuses it).
    topo = eplb.Topology(2, 8, 8, 4)
    loads = np.arange(16.0).reshape(2, 8)
    names = ", ".join(k for k in ("tolerance", "layer_tolerance", "max_moves", "max_layer_moves") if k in options)
    with pytest.raises(ValueError, match=re.escape(f"{names} bound") + ".*give previous=Placement"):
        eplb.rebalance(loads, topo, "global", **options)
    previous = eplb.Placement.contiguous(topo)
    assert eplb.rebalance(loads, topo, "global", previous=previous, **options).replan is not None
