"""eplb.layout: the [rows, bins, slots] arrays every step shares."""

import numpy as np
import pytest

from eplb.layout import (
    _SUMS_IN_ORDER,
    bin_loads,
    busiest,
    count_true,
    distinct_per_bin,
    distinct_rows,
    replica_counts,
    slot_sums,
    stable_argsort,
    take_rows,
)


def test_counts_and_bin_loads_split_each_expert_over_its_replicas() -> None:
    loads = np.array([[6.0, 2.0, 4.0]])
    phy = np.array([[[0, 1], [0, 2]]])  # expert 0 on both bins
    assert replica_counts(phy, 3).tolist() == [[2, 1, 1]]
    assert bin_loads(loads, phy).tolist() == [[5.0, 7.0]]
    assert busiest(loads, phy).tolist() == [7.0]
    assert distinct_per_bin(phy) and not distinct_per_bin(np.array([[[0, 0], [1, 2]]]))


def test_distinct_rows_marks_each_row_with_an_expert_twice_on_a_bin() -> None:
    phy = np.array([[[0, 1], [0, 2]], [[0, 0], [1, 2]], [[2, 1], [1, 0]]])
    assert distinct_rows(phy).tolist() == [True, False, True]


def test_bin_loads_sum_to_the_layer_load() -> None:
    rng = np.random.default_rng(0)
    loads = rng.random((5, 8))
    phy = np.stack([rng.permutation(np.r_[np.arange(8), rng.integers(0, 8, 4)]).reshape(4, 3) for _ in range(5)])
    assert np.allclose(bin_loads(loads, phy).sum(axis=1), loads.sum(axis=1))


def test_take_rows_gathers_what_a_broadcast_row_index_gathers() -> None:
    rng = np.random.default_rng(1)
    a = rng.random((6, 10))
    for idx in (rng.integers(0, 10, (6, 4)), rng.integers(0, 10, (6, 3, 5))):
        rows = np.arange(6).reshape((6,) + (1,) * (idx.ndim - 1))
        assert np.array_equal(take_rows(a, idx), a[rows, idx])
        assert np.array_equal(take_rows(np.asfortranarray(a), idx), a[rows, idx])  # not C-ordered
    assert take_rows(np.array([[1, 2], [3, 4]]), np.array([[1, 1], [0, 1]])).tolist() == [[2, 2], [3, 4]]


@pytest.mark.parametrize("slots", range(1, 20))
def test_slot_sums_are_numpys_sums_to_the_bit(slots: int) -> None:
    rng = np.random.default_rng(slots)
    for shape in ((58, 126), (3, 7), (200,)):
        w = rng.random(shape + (slots,)) * rng.choice([1e-3, 1.0, 1e6], size=shape + (slots,))
        assert np.array_equal(slot_sums(w), w.sum(axis=-1))
        t = np.ascontiguousarray(np.moveaxis(w, -1, 0)).T  # the slot axis not contiguous
        assert np.array_equal(slot_sums(t), t.sum(axis=-1))
    if 3 <= slots < 16:
        assert slots in _SUMS_IN_ORDER  # numpy's order as the sliced sums assume (else only slower)


def test_stable_argsort_is_numpys_stable_order_with_ties_zeros_and_infinities() -> None:
    rng = np.random.default_rng(2)
    cases = [
        rng.integers(0, 40, (50, 63)).astype(np.float64),  # many ties
        rng.random((30, 126)) * 1e4,
        np.where(rng.random((20, 64)) < 0.2, 0.0, rng.integers(900, 910, (20, 64)) / 3.0),  # zeros: wide rows
        np.where(rng.random((20, 17)) < 0.3, np.inf, rng.random((20, 17))),
        -rng.integers(0, 5, (10, 9)).astype(np.float64),  # negatives and -0.0
        rng.random((0, 5)),
        rng.random((4, 1)),
        rng.random((6, 300))[:, ::-1],  # not contiguous
    ]
    for a in cases:
        got = stable_argsort(a)
        assert got.dtype == np.argsort(a, axis=1).dtype
        assert np.array_equal(got, np.argsort(a, axis=1, kind="stable"))


def test_count_true_counts_like_a_bool_sum() -> None:
    rng = np.random.default_rng(3)
    for shape in ((116, 8, 126), (5, 255), (4, 256), (3, 300), (7, 1)):
        x = rng.random(shape) < 0.5
        assert np.array_equal(count_true(x), x.sum(axis=-1))
        assert count_true(x).dtype == x.sum(axis=-1).dtype
    assert np.array_equal(count_true(np.ones((2, 255), dtype=bool)), [255, 255])
