"""eplb.place.replicate: water-filling replica counts."""

import numpy as np

from eplb.place.replicate import waterfill


def test_waterfill_known_answer_and_cap() -> None:
    assert waterfill(np.array([[30.0, 18.0, 6.0, 6.0]]), 8).tolist() == [[4, 2, 1, 1]]
    assert waterfill(np.array([[100.0, 1.0]]), 6, cap=3).tolist() == [[3, 3]]
    # An all-zero row spreads its spare replicas round-robin.
    assert waterfill(np.zeros((1, 3)), 7).tolist() == [[3, 2, 2]]
