"""The large-neighbourhood search of bench/replan_lns: valid re-plans, never more moves than its
start, never fewer than the proved fewest, and nearly always those."""

import numpy as np

import eplb
from eplb.replan.align import align_to_previous
from eplb_bench.moves_gap import fewest_moves
from eplb_bench.replan_lns import search


def _loads(w: np.ndarray, phy: np.ndarray) -> np.ndarray:
    return (w / np.bincount(phy.ravel(), minlength=w.size))[phy].sum(axis=1)


def test_search_from_a_fresh_plan_reaches_the_fewest_moves_at_its_balance() -> None:
    topo = eplb.Topology(1, 12, 16, 4)
    gaps = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        before = rng.lognormal(0, 1, (1, 12))
        after = before * rng.lognormal(0, 0.3, (1, 12))
        prev = eplb.rebalance(before, topo, "global", effort="fast").placement
        # The fresh plan relabelled onto prev: valid, balanced, and usually far from fewest moves.
        start = align_to_previous(
            eplb.rebalance(after, topo, "global", effort="fast").phy2log, prev, topo, by_node=False
        )
        p, s = prev.phy2log[0].reshape(4, 4), start[0].reshape(4, 4)
        limit = float(_loads(after[0], s).max())
        found = search(after[0], p, s, limit, rounds=4, size=4, time_limit=5.0, seed=seed)
        srt = np.sort(found, axis=1)
        assert (srt[:, 1:] != srt[:, :-1]).all()  # no expert twice on a gpu
        assert (np.bincount(found.ravel(), minlength=12) >= 1).all()
        assert _loads(after[0], found).max() <= limit * (1 + 1e-6)
        moves = int((found != p).sum())
        assert moves <= int((s != p).sum())
        best = fewest_moves(after[0], p, 4, limit * (1 + 1e-9), 20.0, s)
        assert best["status"] == "OPTIMAL" and best["moves"] <= moves
        gaps.append(moves - best["moves"])
    # With every gpu free each round, only an optimum whose replica counts are more than one
    # away from the start's is out of reach.
    assert max(gaps) <= 1 and sum(g == 0 for g in gaps) >= 8
