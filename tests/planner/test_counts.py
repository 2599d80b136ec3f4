"""eplb.planner.counts: count moves."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from eplb.planner.counts import refine_counts
from eplb.planner.packing import pack


@st.composite
def items(draw: st.DrawFn):
    rows = draw(st.integers(1, 4))
    bins = draw(st.integers(1, 8))
    per_bin = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    n = bins * per_bin
    experts = draw(st.integers(max(1, -(-n // bins)), n))  # enough experts to avoid duplicates
    # Replicas: every expert at least once, the rest to random experts, at most `bins` each.
    counts = np.ones((rows, experts), dtype=np.int64)
    for r in range(rows):
        for _ in range(n - experts):
            free = np.flatnonzero(counts[r] < bins)
            counts[r, rng.choice(free)] += 1
    keys = np.stack([np.repeat(np.arange(experts), counts[r]) for r in range(rows)])
    loads = rng.lognormal(0, 1.5, (rows, experts)) * (rng.random((rows, experts)) > 0.2)
    weights = loads[np.arange(rows)[:, None], keys] / counts[np.arange(rows)[:, None], keys]
    return weights, keys, bins


@given(inst=items())
def test_count_moves_keep_every_expert_and_never_worsen_the_busiest_bin(inst) -> None:
    weights, keys, bins = inst
    rows, n = weights.shape
    experts = keys.max() + 1
    loads = np.zeros((rows, experts))
    np.add.at(loads, (np.repeat(np.arange(rows), n), keys.ravel()), weights.ravel())
    assign = pack(weights, bins, keys)
    phy = keys[np.arange(rows)[:, None, None], assign]
    out = refine_counts(loads, phy, bins, iterations=8)
    counts = np.zeros((rows, experts), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(rows), n), out.reshape(rows, -1).ravel()), 1)
    assert (counts >= 1).all() and (counts <= bins).all()
    assert (counts.sum(axis=1) == n).all()
    srt = np.sort(out, axis=2)
    assert not (srt[:, :, 1:] == srt[:, :, :-1]).any()

    def busiest(p: np.ndarray) -> np.ndarray:
        c = np.zeros((rows, experts))
        np.add.at(c, (np.repeat(np.arange(rows), n), p.reshape(rows, -1).ravel()), 1)
        per = np.divide(loads, c, out=np.zeros_like(loads), where=c > 0)
        return per[np.arange(rows)[:, None, None], p].sum(axis=2).max(axis=1)

    assert (busiest(out) <= busiest(phy) * (1 + 1e-9) + 1e-12).all()
