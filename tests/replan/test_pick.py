"""eplb.replan.pick: one candidate per layer within the imbalance allowed."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st


@given(data=st.data())
def test_pick_meets_the_budget_and_respects_what_is_allowed(data: st.DataObject) -> None:
    from itertools import product

    from eplb.replan.pick import pick

    C = data.draw(st.integers(2, 4), label="candidates")
    L = data.draw(st.integers(1, 4), label="layers")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    imb = 1.0 + rng.random((C, L)) * 0.1
    imb[-1] = 1.0  # the last candidate (fresh aligned) is always allowed and best balanced
    cost = np.floor(rng.random((C, L)) * 20)
    cost[0] = 0.0
    cost[rng.random((C, L)) < 0.2] = np.inf
    cost[-1] = 30.0
    budget = imb[-1].sum() * (1 + data.draw(st.floats(0, 0.1), label="slack"))
    pick = pick(cost, imb, budget)
    cols = np.arange(L)
    assert np.isfinite(cost[pick, cols]).all()
    assert imb[pick, cols].sum() <= budget + 1e-12
    # Never far from the best choice found by trying every combination.
    best = min(
        cost[list(c), cols].sum()
        for c in product(range(C), repeat=L)
        if np.isfinite(cost[list(c), cols]).all() and imb[list(c), cols].sum() <= budget + 1e-12
    )
    assert cost[pick, cols].sum() <= best + 30.0
