"""eplb.planner.replicate: water-filling replica counts."""

import numpy as np

from eplb.planner.replicate import waterfill


def test_waterfill_known_answer_and_cap() -> None:
    assert waterfill(np.array([[30.0, 18.0, 6.0, 6.0]]), 8).tolist() == [[4, 2, 1, 1]]
    assert waterfill(np.array([[100.0, 1.0]]), 6, cap=3).tolist() == [[3, 3]]
    # An all-zero row spreads its spare replicas round-robin.
    assert waterfill(np.zeros((1, 3)), 7).tolist() == [[3, 2, 2]]


def test_waterfill_same_counts_for_a_transposed_view() -> None:
    # Loads taken through a transpose are not C-contiguous (nor is what is computed from them).
    loads = np.array([[42.0, 25.0], [31.0, 13.0], [7.0, 9.0]]).T
    assert not loads.flags.c_contiguous
    assert waterfill(loads, 5).tolist() == waterfill(np.ascontiguousarray(loads), 5).tolist() == [[2, 2, 1], [2, 2, 1]]
