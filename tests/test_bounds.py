"""eplb.bounds: lower bounds on the busiest gpu."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.bounds import pairing_bound, profile_bound, row_bound, simple_bound
from eplb.place.pairing import paired_max
from eplb.workloads import zipf


def _best_over_counts(loads: np.ndarray, bins: int) -> float:
    """Brute force: the least paired busiest bin over every count vector (one row)."""
    from eplb.place.replicate import count_vectors

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
