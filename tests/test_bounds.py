"""eplb.bounds: lower bounds on the busiest gpu."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.bounds import group_bound, pairing_bound, profile_bound, row_bound, simple_bound
from eplb.planner.pairing import paired_max
from eplb.workloads import zipf


def _best_over_counts(loads: np.ndarray, bins: int) -> float:
    """Brute force: the least paired busiest bin over every count vector (one row)."""
    from eplb.planner.replicate import count_vectors

    vectors = count_vectors(loads.size, 2 * bins, bins)
    return float(paired_max(np.broadcast_to(loads, vectors.shape), vectors).min())


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bins=st.integers(2, 5),
    experts=st.integers(2, 6),
    sigma=st.sampled_from([0.5, 1.5, 3.0]),
)
def test_profile_bound_never_exceeds_the_best_counts(seed: int, bins: int, experts: int, sigma: float) -> None:
    experts = min(experts, 2 * bins)
    loads = np.random.default_rng(seed).lognormal(0.0, sigma, (1, experts))
    best = _best_over_counts(loads[0], bins)
    start = simple_bound(loads, bins, 2 * bins, bins)
    bound = profile_bound(loads, bins, bins, start, np.array([best]))
    assert bound[0] <= best * (1 + 1e-9)


def test_profile_bound_is_tighter_than_the_pairing_bound_when_partners_run_out() -> None:
    # 192 gpus, 256 experts, zipf 1.2: the heavy experts' replicas outnumber the light
    # partners that would fit them.
    loads = zipf(2, 256, 1.2, seed=13)
    simple = simple_bound(loads, 192, 384, 192)
    pairing = np.maximum(simple, pairing_bound(loads, 192, 192, simple, 2 * simple))
    profile = profile_bound(loads, 192, 192, pairing, 2 * simple)
    mean = loads.sum(axis=1) / 192
    assert (profile > pairing * 1.02).all()
    assert (profile / mean > 1.05).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bins=st.integers(2, 5), experts=st.integers(2, 6))
def test_row_bound_never_exceeds_the_best_counts_with_dead_experts(seed: int, bins: int, experts: int) -> None:
    # Trace counts: small integers, ties and dead experts; an all-zero row joins every batch.
    experts = min(experts, 2 * bins)
    rng = np.random.default_rng(seed)
    loads = np.vstack([rng.integers(0, 6, (1, experts)) * rng.integers(0, 2, (1, experts)), np.zeros((1, experts))])
    best = np.array([_best_over_counts(row, bins) for row in loads.astype(np.float64)])
    bound = row_bound(loads, bins, 2, bins, best)
    assert (bound <= best * (1 + 1e-9)).all()
    assert bound[1] == 0.0


def _best_grouping(groups: np.ndarray, nodes: int) -> float:
    """Brute force: the least busiest node over every split of ``groups`` (one layer) into
    ``nodes`` nodes of equal group count."""
    from itertools import permutations

    per = groups.size // nodes
    best = np.inf
    for perm in permutations(range(groups.size)):
        best = min(best, max(groups[list(perm[n * per : (n + 1) * per])].sum() for n in range(nodes)))
    return float(best)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(2, 4), (2, 6), (3, 6), (4, 8), (2, 2)]),
    sigma=st.sampled_from([0.3, 1.0, 2.5]),
)
def test_group_bound_never_exceeds_the_best_split_and_is_exact_with_two_groups_per_node(
    seed: int, shape: tuple[int, int], sigma: float
) -> None:
    nodes, groups = shape
    gpn, per_group = 2, 4
    topo = eplb.Topology(1, groups * per_group, groups * per_group + nodes * gpn, nodes * gpn, nodes, groups)
    loads = np.random.default_rng(seed).lognormal(0.0, sigma, (1, topo.num_experts))
    best_node = _best_grouping(loads.reshape(groups, per_group).sum(axis=1), nodes)
    bound = group_bound(loads, topo)[0] * gpn  # back to a node's load
    assert bound <= best_node * (1 + 1e-12)
    if groups == 2 * nodes:
        assert bound == pytest.approx(best_node, rel=1e-12)
    # ... and below every hierarchical plan's busiest gpu.
    plan = eplb.rebalance(loads, topo, "hierarchical", effort="fast")
    assert group_bound(loads, topo)[0] <= plan.gpu_load.max() * (1 + 1e-12)
