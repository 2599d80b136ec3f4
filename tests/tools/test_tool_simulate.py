"""Per-step routing simulator: exact mean load, exact inclusion probabilities, shrinking spread,
and the published uniform-routing check."""

import numpy as np
import pytest

import eplb
from eplb.simulate import (
    expected_gpu_load,
    inclusion_probabilities,
    sample_gpu_loads,
    simulate_steps,
    systematic_subsets,
)


def _balanced(experts: int, slots: int, gpus: int) -> eplb.Placement:
    topo = eplb.Topology(1, experts, slots, gpus)
    return eplb.rebalance(np.ones((1, experts)), topo, "global").placement


def test_inclusion_probabilities_cap_hot_experts_at_one():
    assert inclusion_probabilities(np.array([10.0, 1, 1, 1, 1]), 2).tolist() == [1.0, 0.25, 0.25, 0.25, 0.25]
    assert inclusion_probabilities(np.array([1.0, 1, 2]), 2).tolist() == [0.5, 0.5, 1.0]
    with pytest.raises(
        ValueError, match=r"topk \(3\) must be between 1 and the number of experts with popularity > 0 \(2\)"
    ):
        inclusion_probabilities(np.array([1.0, 0, 1]), 3)


def test_every_step_has_exactly_the_analytic_mean_load():
    placement = _balanced(16, 20, 4)
    pop = np.random.default_rng(1).lognormal(0, 1, 16)
    loads = sample_gpu_loads(pop, placement, tokens_per_gpu=10, topk=3, steps=50, seed=2)
    assert loads.shape == (50, 4)
    # Every token makes exactly topk visits: each step's mean gpu load is b * topk.
    assert (loads.sum(axis=1) == 4 * 10 * 3).all()
    st = simulate_steps(pop, placement, 10, 3, 50, seed=2)
    assert st.mean_load == 30.0
    assert np.array_equal(st.ratio, loads.max(axis=1) / 30.0)


def test_deterministic_routing_matches_the_expected_load_exactly():
    # One slot per expert and an expert every token must pick: its gpu load is N every step.
    topo = eplb.Topology(1, 5, 5, 5)
    placement = eplb.Placement(np.array([[3, 0, 1, 2, 4]]), topo)
    pop = np.array([10.0, 1, 1, 1, 1])
    loads = sample_gpu_loads(pop, placement, tokens_per_gpu=7, topk=2, steps=20, seed=0)
    assert (loads[:, 1] == 5 * 7).all()
    assert expected_gpu_load(pop, placement, 7, 2)[1] == 35.0
    # topk == E: every token visits every expert, so every gpu's load is exactly expected.
    loads = sample_gpu_loads(np.ones(5), placement, tokens_per_gpu=3, topk=5, steps=4, seed=0)
    assert (loads == 15).all()
    assert expected_gpu_load(np.ones(5), placement, 3, 5).tolist() == [15.0] * 5


def test_systematic_sampling_picks_distinct_experts_at_the_right_rates():
    pi = inclusion_probabilities(np.array([8.0, 4, 2, 1, 1, 1, 1, 1, 1]), 3)
    rng = np.random.default_rng(0)
    picks = systematic_subsets(rng, 40_000, pi, 3)
    assert (np.sort(picks, axis=1)[:, 1:] != np.sort(picks, axis=1)[:, :-1]).all()
    freq = np.bincount(picks.ravel(), minlength=pi.size) / 40_000
    # Binomial standard error <= 0.0025; allow 5 of them.
    assert np.abs(freq - pi).max() < 0.0125


def test_average_over_steps_approaches_the_expected_gpu_load():
    placement = _balanced(16, 20, 4)
    pop = np.random.default_rng(3).lognormal(0, 1, 16)
    loads = sample_gpu_loads(pop, placement, tokens_per_gpu=50, topk=4, steps=200, seed=4)
    expected = expected_gpu_load(pop, placement, 50, 4)
    assert np.allclose(expected.sum(), 4 * 50 * 4)
    assert np.abs(loads.mean(axis=0) / expected - 1).max() < 0.02


def test_spread_shrinks_as_tokens_per_gpu_grow():
    placement = _balanced(64, 72, 8)
    pop = np.ones(64)
    stats = [simulate_steps(pop, placement, b, 4, 300, seed=b) for b in (4, 32, 256)]
    spreads = [s.p99 - 1.0 for s in stats]
    means = [s.mean - 1.0 for s in stats]
    assert spreads[0] > spreads[1] > spreads[2] > 0
    assert means[0] > means[1] > means[2] > 0
    assert [s.expected_ratio for s in stats] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("slots", "gpus", "requests", "published"), [(448, 64, 8, 0.17), (416, 8, 8, 0.10), (448, 64, 60, 0.06)]
)
def test_reproduces_the_published_uniform_routing_check(slots, gpus, requests, published):
    # 4 tokens per request verified per step: b = 4 * requests per gpu.
    st = simulate_steps(np.ones(384), _balanced(384, slots, gpus), 4 * requests, 6, 200, seed=0)
    assert abs((st.mean - 1.0) - published) < 0.015
