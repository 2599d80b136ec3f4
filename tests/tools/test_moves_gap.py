"""The fewest-moves reference of bench/moves_gap against brute force, and one instance end to end."""

from itertools import combinations, product

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eplb_bench.moves_gap import fewest_moves, instance


def _brute(w: np.ndarray, prev: np.ndarray, limit: float) -> int | None:
    G, S = prev.shape
    E = w.size
    best = None
    for gpus in product(combinations(range(E), S), repeat=G):
        cnt = np.bincount(np.concatenate(gpus), minlength=E)
        if (cnt == 0).any():
            continue
        if max(sum(w[e] / cnt[e] for e in g) for g in gpus) > limit:
            continue
        moves = sum(S - len(set(g) & set(p.tolist())) for g, p in zip(gpus, prev))
        best = moves if best is None else min(best, moves)
    return best


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), experts=st.integers(3, 5), slack=st.floats(1.0, 1.3))
def test_fewest_moves_matches_brute_force(seed: int, experts: int, slack: float) -> None:
    rng = np.random.default_rng(seed)
    G, S = 2, 3
    w = rng.lognormal(0, 1, experts)
    prev = np.array([rng.permutation(experts)[:S] for _ in range(G)])
    if len(set(prev.ravel().tolist())) < experts:
        prev[1, : experts - S] = [e for e in range(experts) if e not in prev[0]][: experts - S]
    # The busiest gpu of some placement, loosened: a limit that is sometimes met without moves.
    limit = slack * w.sum() / G
    expect = _brute(w, prev, limit)
    got = fewest_moves(w, prev, G, limit, 10.0, prev)
    if expect is None:
        assert "moves" not in got
    else:
        assert got["status"] == "OPTIMAL" and got["moves"] == expect


def test_an_instance_reports_ours_against_the_proved_fewest() -> None:
    row = instance(16, 4, 5, 0.05, 0, 0.01, 20.0)
    assert row["ours_ok"] and row["ilp_status"] == "OPTIMAL"
    assert row["ilp_bound"] == row["ilp_moves"] <= row["ours"]
