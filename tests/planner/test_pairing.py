"""Two replicas per gpu: the pairing value and counts built for a target busiest gpu."""

from itertools import permutations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eplb
from eplb.layout import bin_loads
from eplb.planner.packing import pack_counts
from eplb.planner.pairing import pair_counts, pair_counts_sweep, pair_descent, paired_max
from eplb.planner.replicate import waterfill
from eplb.workloads import lognormal, zipf


def _best_pairing(w: np.ndarray) -> float:
    """Brute force: the least busiest pair over every way to pair the items."""
    best = np.inf
    for perm in permutations(range(len(w))):
        pairs = w[list(perm)].reshape(-1, 2).sum(axis=1)
        best = min(best, pairs.max())
    return float(best)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), experts=st.integers(2, 6))
def test_paired_max_is_the_best_pairing_of_the_replicas(seed: int, experts: int) -> None:
    rng = np.random.default_rng(seed)
    counts = np.ones(experts, dtype=np.int64)
    while counts.sum() < 6:
        counts[rng.integers(experts)] += 1
    loads = rng.lognormal(0.0, 1.0, experts)
    w = np.repeat(loads / counts, counts)
    assert np.isclose(paired_max(loads[None], counts[None])[0], _best_pairing(w))


def test_pair_counts_known_answer_beats_water_filling() -> None:
    # 3 gpus, 6 slots. Water-filling gives the heavy expert 3 replicas (1.33 each), and one of
    # them must sit with the 2.0 replica: 2.67. Two replicas each of the two heavy experts pair
    # 2 + 0.5, 2 + 0.5, 1 + 1: 2.5.
    loads = np.array([[4.0, 2.0, 0.5, 0.5]])
    wf = waterfill(loads, 6, 3)
    assert wf.tolist() == [[3, 1, 1, 1]]
    assert np.isclose(paired_max(loads, wf)[0], 8 / 3)
    counts = pair_counts(loads, 3, 3, loads.sum(axis=1) / 3, paired_max(loads, wf))
    assert counts.tolist() == [[2, 2, 1, 1]]
    assert np.isclose(paired_max(loads, counts)[0], 2.5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bins=st.integers(2, 12), extra=st.integers(0, 12))
def test_pair_counts_are_valid_replica_counts(seed: int, bins: int, extra: int) -> None:
    rng = np.random.default_rng(seed)
    experts = max(2, 2 * bins - extra)
    loads = rng.lognormal(0.0, 1.5, (3, experts))
    cap = bins
    start = paired_max(loads, waterfill(loads, 2 * bins, cap))
    counts = pair_counts(loads, bins, cap, loads.sum(axis=1) / bins, start)
    built = counts.sum(axis=1) > 0
    assert (counts[built].sum(axis=1) == 2 * bins).all()
    assert (counts[built] >= 1).all() and (counts[built] <= cap).all()
    assert (counts[~built] == 0).all()


def test_default_plan_at_two_slots_per_gpu_is_at_least_as_good_as_the_built_counts() -> None:
    # The search starts from the better of the first plan and the counts built for the
    # pairing, and never gets worse.
    t = eplb.Topology(4, 48, 96, 48)
    loads = lognormal(4, 48, 1.5, seed=3)
    fast = eplb.rebalance(loads, t, "global", effort="fast")
    default = eplb.rebalance(loads, t, "global")
    busiest = fast.gpu_load.max(axis=1)
    counts = pair_counts(loads, 48, 48, loads.sum(axis=1) / 48, busiest)
    built = np.where(counts.sum(axis=1) > 0, paired_max(loads, np.maximum(counts, 1)), np.inf)
    assert (built < busiest).any()
    assert (default.gpu_load.max(axis=1) <= np.minimum(built, busiest) * (1 + 1e-9)).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bins=st.integers(2, 12), extra=st.integers(0, 12))
def test_pair_counts_sweep_are_valid_and_reach_their_target(seed: int, bins: int, extra: int) -> None:
    rng = np.random.default_rng(seed)
    experts = max(2, 2 * bins - extra)
    loads = rng.lognormal(0.0, 1.5, (3, experts))
    cap = bins
    start = paired_max(loads, waterfill(loads, 2 * bins, cap))
    counts = pair_counts_sweep(loads, bins, cap, loads.sum(axis=1) / bins, start)
    built = counts.sum(axis=1) > 0
    assert (counts[built].sum(axis=1) == 2 * bins).all()
    assert (counts[built] >= 1).all() and (counts[built] <= cap).all()
    assert (counts[~built] == 0).all()
    # Built for a target below the start: the pairing is no worse than it.
    if built.any():
        assert (paired_max(loads[built], counts[built]) <= start[built] * (1 + 1e-9)).all()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bins=st.integers(2, 12), extra=st.integers(0, 12))
def test_pair_descent_keeps_valid_counts_and_never_gets_worse(seed: int, bins: int, extra: int) -> None:
    rng = np.random.default_rng(seed)
    experts = max(2, 2 * bins - extra)
    loads = rng.lognormal(0.0, 1.5, (3, experts))
    start = waterfill(loads, 2 * bins, bins)
    mean = loads.sum(axis=1) / bins
    counts = pair_descent(loads, start, bins, bins, target=mean)
    assert (counts.sum(axis=1) == 2 * bins).all()
    assert (counts >= 1).all() and (counts <= bins).all()
    assert (paired_max(loads, counts) <= paired_max(loads, start) * (1 + 1e-12)).all()
    # Deterministic, and a spend callback that allows nothing changes nothing.
    assert (pair_descent(loads, start, bins, bins, target=mean) == counts).all()
    assert (pair_descent(loads, start, bins, bins, target=mean, spend=lambda n: 0) == start).all()


def test_pair_descent_reaches_the_optimum_on_a_heavy_tailed_layer() -> None:
    # 256 experts on 192 gpus, zipf 1.0: the least busiest pair over all counts is 1.0445 x
    # the mean (CP-SAT on the pairing conditions proves nothing below 1.04375 is possible);
    # water-filling counts pair to far above it, and the sweep construction followed by the
    # descent reaches it.
    loads = zipf(1, 256, 1.0, seed=12)
    mean = loads.sum(axis=1) / 192
    start = waterfill(loads, 384, 192)
    built = pair_counts_sweep(loads, 192, 192, mean, paired_max(loads, start))
    counts = pair_descent(loads, built, 192, 192, target=mean * 1.001)
    assert paired_max(loads, start)[0] / mean[0] > 1.06
    assert paired_max(loads, counts)[0] / mean[0] < 1.0446


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    experts=st.integers(2, 12),
    extra=st.integers(0, 6),
    integer=st.booleans(),
)
def test_a_two_slot_packing_never_beats_the_sorted_pairing_in_floats(
    seed: int, experts: int, extra: int, integer: bool
) -> None:
    # repack_search packs only the best-paired candidate of a row when its packing reaches its
    # pairing: that relies on this, to the last bit (ties of integer loads included).
    rng = np.random.default_rng(seed)
    bins = max(1, (experts + extra + 1) // 2)
    loads = rng.integers(1, 6, (3, experts)).astype(float) if integer else rng.lognormal(0, 1.5, (3, experts))
    counts = waterfill(loads, 2 * bins, bins)
    packed = pack_counts(loads, counts, bins)
    assert (bin_loads(loads, packed).max(axis=1) >= paired_max(loads, counts)).all()


def _impossible_sorted(loads: np.ndarray, T: np.ndarray, bins: int, cap: int | None) -> np.ndarray:
    """``eplb.bounds._impossible`` as it was: the knapsack over each row's items sorted by ratio."""
    eps = 1e-9
    t = T[:, None]
    h = np.maximum(np.ceil(loads / t - eps), 1.0)
    m = np.maximum(np.ceil(2 * loads / t - eps), 1.0)
    heavy_able = loads / h > t / 2 * (1 + eps)
    limit = np.inf if cap is None else cap
    too_many = (h > limit).any(axis=1)
    forced = heavy_able & (m > limit)
    room = bins - np.where(forced, h, 0.0).sum(axis=1)
    saved_forced = np.where(forced, m - h, 0.0).sum(axis=1)
    free = heavy_able & ~forced
    cost = np.where(free, h, 0.0)
    gain = np.where(free, m - h, 0.0)
    ratio = np.where(free, gain / np.maximum(cost, 1.0), -1.0)
    order = np.argsort(-ratio, axis=1, kind="stable")
    cost_s = np.take_along_axis(cost, order, axis=1)
    gain_s = np.take_along_axis(gain, order, axis=1)
    before = np.cumsum(cost_s, axis=1) - cost_s
    take = np.clip((np.maximum(room, 0.0)[:, None] - before) / np.maximum(cost_s, 1.0), 0.0, 1.0)
    need = m.sum(axis=1) - saved_forced - (take * gain_s).sum(axis=1)
    return too_many | (room < 0) | (need > 2 * bins * (1 + eps))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    experts=st.integers(2, 300),
    spare=st.integers(0, 200),
    rows=st.integers(1, 6),
    law=st.sampled_from(["lognormal", "zipf", "ties"]),
)
def test_pairing_bound_by_ratio_classes_equals_the_sorted_knapsack(
    seed: int, experts: int, spare: int, rows: int, law: str
) -> None:
    # The knapsack summed per ratio (no per-row sort) must give the bisection the same
    # verdicts, so the very same bound, bit for bit.
    from eplb import bounds
    from eplb.planner.replicate import replica_cap

    rng = np.random.default_rng(seed)
    bins = max(1, (experts + spare + 1) // 2)
    if law == "lognormal":
        loads = rng.lognormal(0, 1.5, (rows, experts))
    elif law == "zipf":
        loads = np.stack([rng.permutation(1.0 / np.arange(1, experts + 1) ** 1.2) for _ in range(rows)])
    else:
        loads = rng.integers(1, 4, (rows, experts)).astype(np.float64)  # many equal ratios
    cap = replica_cap(experts, 2 * bins, bins)
    simple = bounds.simple_bound(loads, bins, 2 * bins, cap)
    for T in (simple, simple * 1.01, simple * 1.3, simple * 2):
        assert np.array_equal(bounds._impossible(loads, T, bins, cap), _impossible_sorted(loads, T, bins, cap))
    new = bounds.pairing_bound(loads, bins, cap, simple, 2 * simple)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bounds, "_impossible", _impossible_sorted)
        old = bounds.pairing_bound(loads, bins, cap, simple, 2 * simple)
    assert np.array_equal(new, old)


def test_pairing_bound_unchanged_at_the_two_slot_scales() -> None:
    from eplb import bounds
    from eplb.workloads import SCALES, make_loads

    above = False
    for topo in (SCALES["v3-decode-144"], eplb.Topology(58, 128, 256, 128, 16, 1), eplb.Topology(58, 128, 254, 127)):
        for workload in ("lognormal-1.0", "zipf-1.0"):
            loads = make_loads(workload, topo, seed=0)
            new = eplb.lower_bound(loads, topo)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(bounds, "_impossible", _impossible_sorted)
                old = eplb.lower_bound(loads, topo)
            assert np.array_equal(new, old)
            above |= bool((new > loads.sum(axis=1) / topo.num_gpus * (1 + 1e-6)).any())
    assert above  # somewhere the pairing bound is above the mean: the bisection ran
