"""Packing and count moves: pure logic, checked on generated inputs."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from eplb.place.packing import descending_order, pack, packed_loads


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
def test_pack_puts_every_item_in_exactly_one_bin_of_equal_size(inst) -> None:
    weights, keys, bins = inst
    assign = pack(weights, bins, keys)
    rows, n = weights.shape
    assert assign.shape == (rows, bins, n // bins)
    assert (np.sort(assign.reshape(rows, -1), axis=1) == np.arange(n)).all()


@given(inst=items())
def test_pack_never_puts_equal_keys_in_one_bin(inst) -> None:
    weights, keys, bins = inst
    assign = pack(weights, bins, keys)
    k = np.sort(keys[np.arange(len(keys))[:, None, None], assign], axis=2)
    assert not (k[:, :, 1:] == k[:, :, :-1]).any()


@given(inst=items())
def test_swaps_never_make_the_heaviest_bin_heavier_and_pack_is_deterministic(inst) -> None:
    weights, keys, bins = inst
    dealt = pack(weights, bins, keys, max_rounds=0)
    improved = pack(weights, bins, keys)
    assert (packed_loads(weights, improved).max(axis=1) <= packed_loads(weights, dealt).max(axis=1) + 1e-9).all()
    assert np.array_equal(improved, pack(weights.copy(), bins, keys.copy()))


def test_pack_known_answer_differencing_beats_greedy_rounds() -> None:
    # 6 items into 2 bins of 3: the perfect split 8 + 1 + 1 | 4 + 3 + 3 = 10 | 10.
    w = np.array([[8.0, 4.0, 3.0, 3.0, 1.0, 1.0]])
    assign = pack(w, 2)
    assert sorted(packed_loads(w, assign)[0].tolist()) == [10.0, 10.0]


@given(
    st.integers(1, 4).flatmap(
        lambda rows: st.lists(
            st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.5, 2.5, 7.0]), min_size=12, max_size=12),
            min_size=rows,
            max_size=rows,
        )
    )
)
def test_descending_order_is_a_stable_descending_sort_with_ties(values) -> None:
    w = np.array(values)
    assert np.array_equal(descending_order(w), np.argsort(-w, axis=1, kind="stable"))


def test_descending_order_keeps_tied_items_in_input_order() -> None:
    w = np.array([[1.0, 3.0, 1.0, 3.0, 2.0]])
    assert descending_order(w).tolist() == [[1, 3, 4, 0, 2]]
