"""Replica counts borrowed across the rows of a search chunk, by load rank."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb.budget import Budget
from eplb.layout import bin_loads, replica_counts
from eplb.planner.borrow import borrow_counts
from eplb.planner.packing import pack_counts
from eplb.planner.replicate import waterfill


def _rows(loads: np.ndarray, counts: np.ndarray, bins: int) -> np.ndarray:
    return pack_counts(loads, counts, bins)


def test_a_row_takes_the_better_counts_of_a_permuted_row_and_is_settled() -> None:
    # Row 1 is row 0 with the experts in reverse order. Row 0 holds good counts (the two heavy
    # experts split), row 1 water-filling's poor ones for two slots on four bins.
    base = np.array([6.0, 6.0, 1.0, 1.0, 1.0, 1.0])
    loads = np.stack([base, base[::-1]])
    good = np.array([2, 2, 1, 1, 1, 1])
    poor = np.array([1, 1, 2, 2, 1, 1])
    phy = _rows(loads, np.stack([good, poor]), 4)
    before = bin_loads(loads, phy).max(axis=1)
    out, settled = borrow_counts(loads, phy, Budget())
    after = bin_loads(loads, out).max(axis=1)
    assert before[1] > before[0]
    assert np.isclose(after[1], after[0]) and after[0] == before[0]
    assert replica_counts(out, 6)[1].tolist() == good[::-1].tolist()
    assert settled.tolist() == [False, True]


def test_a_row_of_another_profile_may_borrow_but_is_not_settled() -> None:
    a = np.array([6.0, 6.0, 1.0, 1.0, 1.0, 1.0])
    b = np.array([1.0, 1.2, 1.0, 0.9, 5.5, 6.5])
    loads = np.stack([a, b])
    phy = _rows(loads, np.stack([[2, 2, 1, 1, 1, 1], [1, 1, 2, 2, 1, 1]]), 4)
    out, settled = borrow_counts(loads, phy, Budget())
    assert bin_loads(loads, out).max(axis=1)[1] < bin_loads(loads, phy).max(axis=1)[1]
    assert not settled.any()


def test_no_budget_left_changes_nothing() -> None:
    base = np.array([6.0, 6.0, 1.0, 1.0, 1.0, 1.0])
    loads = np.stack([base, base[::-1]])
    phy = _rows(loads, np.stack([[2, 2, 1, 1, 1, 1], [1, 1, 2, 2, 1, 1]]), 4)
    budget = Budget(10.0)
    budget.spend(10.0)
    out, settled = borrow_counts(loads, phy, budget)
    assert (out == phy).all() and not settled.any()


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 6), bins=st.integers(2, 6), spb=st.integers(2, 3))
def test_borrowing_is_never_worse_per_row_and_keeps_the_slots(seed: int, rows: int, bins: int, spb: int) -> None:
    rng = np.random.default_rng(seed)
    E = bins * spb - int(rng.integers(0, bins))
    loads = rng.lognormal(0.0, 1.5, (rows, E))
    loads[rng.random((rows, E)) < 0.2] = 0.0
    phy = _rows(loads, waterfill(loads, bins * spb, bins), bins)
    budget = Budget(1e6)
    out, _ = borrow_counts(loads, phy, budget)
    assert out.shape == phy.shape
    assert (bin_loads(loads, out).max(axis=1) <= bin_loads(loads, phy).max(axis=1)).all()
    counts = replica_counts(out, E)
    assert (counts >= 1).all() and (counts <= bins).all()
    assert budget.spent <= 1e6
