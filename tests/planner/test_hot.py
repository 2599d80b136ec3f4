"""eplb.planner.hot: hot experts kept apart."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.layout import bin_loads, distinct_per_bin, replica_counts
from eplb.planner.hot import separate_hot
from eplb.planner.packing import pack_counts
from eplb.planner.replicate import waterfill


@st.composite
def hot_rows(draw: st.DrawFn):
    rows = draw(st.integers(1, 6))
    bins = draw(st.integers(2, 8))
    per_bin = draw(st.integers(2, 6))
    # Enough experts that the cap leaves no bin two copies, and at least one spare slot.
    experts = draw(st.integers(per_bin, bins * per_bin - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    # A few experts far above the rest: what makes water-filling stack them on shared bins.
    loads = rng.lognormal(0, 0.5, (rows, experts))
    loads[:, : draw(st.integers(1, 3))] *= draw(st.floats(3.0, 40.0))
    return loads, bins, per_bin


@settings(max_examples=60, deadline=None)
@given(inst=hot_rows())
def test_separate_hot_keeps_valid_counts_and_never_worsens_a_row(inst) -> None:
    loads, bins, per_bin = inst
    rows, experts = loads.shape
    slots = bins * per_bin
    cap = bins
    counts = waterfill(loads, slots, cap)
    phy = pack_counts(loads, counts, bins)
    before = bin_loads(loads, phy).max(axis=1)
    out = separate_hot(loads, phy, cap)
    assert out.shape == phy.shape
    c = replica_counts(out, experts)
    assert (c >= 1).all() and (c <= cap).all() and (c.sum(axis=1) == slots).all()
    if distinct_per_bin(phy):
        assert distinct_per_bin(out)
    after = bin_loads(loads, out).max(axis=1)
    assert (after <= before * (1 + 1e-12)).all()
    # Rows it changes get strictly lighter: a re-pack is kept only when it pays.
    changed = (out != phy).any(axis=(1, 2))
    assert (after[changed] < before[changed]).all()


def test_separate_hot_leaves_rows_at_their_target_alone() -> None:
    rng = np.random.default_rng(3)
    loads = rng.lognormal(0, 0.5, (4, 12))
    loads[:, :2] *= 20
    phy = pack_counts(loads, waterfill(loads, 16, 4), 4)
    out = separate_hot(loads, phy, 4, target=np.full(4, np.inf))
    assert np.array_equal(out, phy)


def test_rows_within_the_guided_margin_of_their_mean_keep_their_packing() -> None:
    # A busiest gpu within 1 % of the row's mean gpu can gain at most that much, which is not
    # worth a re-pack from guided counts: such rows come back as they were.
    rng = np.random.default_rng(7)
    loads = rng.lognormal(0, 0.3, (400, 12))
    phy = pack_counts(loads, waterfill(loads, 16, 4), 4)
    ratio = bin_loads(loads, phy).max(axis=1) / (loads.sum(axis=1) / 4)
    near = np.flatnonzero((ratio > 1.001) & (ratio <= 1.01))
    assert near.size >= 10
    out = separate_hot(loads[near], phy[near], 4, ks=())
    assert np.array_equal(out, phy[near])
