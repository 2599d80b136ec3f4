"""eplb.replan.candidates' node-group helpers equal their former dense forms.

``groups_whole``, ``_to_local`` and ``_swap_groups`` once built ``[L * N, E]`` and
``[L, N*K, N*K, N]`` arrays (GiBs at the service's limits, see test_align_memory.py); the
references below are those forms, compared on small random node layouts, ties included.
"""

import numpy as np

import eplb
from eplb.replan import candidates as cand


def _groups_whole_dense(phy2log: np.ndarray, t: eplb.Topology) -> np.ndarray:
    L, N, K, gs = phy2log.shape[0], t.num_nodes, t.num_groups // t.num_nodes, t.experts_per_group
    nodes = phy2log.reshape(L * N, t.slots_per_node)
    present = np.zeros((L * N, t.num_experts), dtype=bool)
    present[np.arange(L * N)[:, None], nodes] = True
    per_group = present.reshape(L * N, t.num_groups, gs)
    ok = (per_group.any(axis=2) == per_group.all(axis=2)).all(axis=1) & (per_group.all(axis=2).sum(axis=1) == K)
    return ok.reshape(L, N).all(axis=1)


def _to_local_dense(phy: np.ndarray, node_exp: np.ndarray, num_experts: int) -> np.ndarray:
    R = phy.shape[0]
    inv = np.zeros((R, num_experts), dtype=np.int64)
    inv[np.arange(R)[:, None], node_exp] = np.arange(node_exp.shape[1])
    return inv[np.arange(R)[:, None, None], phy]


def _best_swap_dense(loads: np.ndarray, node_exp: np.ndarray, t: eplb.Topology, target: np.ndarray) -> tuple:
    """→ (layers that swap ``[L]``, their best flat pair index ``[L]``) over every pair."""
    L, N, gs = t.num_layers, t.num_nodes, t.experts_per_group
    K = t.num_groups // N
    groups = node_exp.reshape(L, N * K, gs)[:, :, 0] // gs
    pos_load = np.take_along_axis(loads.reshape(L, t.num_groups, gs).sum(axis=2), groups, axis=1)
    node_of = np.repeat(np.arange(N), K)
    node_load = pos_load.reshape(L, N, K).sum(axis=2)
    delta = pos_load[:, None, :] - pos_load[:, :, None]
    new = np.broadcast_to(node_load[:, None, None, :], (L, N * K, N * K, N)).copy()
    ii, jj = np.meshgrid(np.arange(N * K), np.arange(N * K), indexing="ij")
    new[:, ii, jj, node_of[ii]] += delta
    new[:, ii, jj, node_of[jj]] -= delta
    worst = new.max(axis=3).reshape(L, -1)
    worst[:, (node_of[ii] == node_of[jj]).ravel()] = np.inf
    best = worst.argmin(axis=1)
    now = node_load.max(axis=1)
    return (now / t.gpus_per_node > target) & (worst[np.arange(L), best] < now), best


def _case(rng: np.random.Generator) -> tuple:
    N, K, gs, L = (
        int(rng.choice([2, 3, 4, 8])),
        int(rng.integers(1, 4)),
        int(rng.integers(1, 4)),
        int(rng.integers(1, 5)),
    )
    G, E = N * int(rng.integers(1, 3)), N * K * gs
    P = G * -(-E // G) + G * int(rng.integers(0, 2))
    t = eplb.Topology(L, E, P, G, num_nodes=N, num_groups=N * K)
    # Small integer loads in half the cases: many equal node loads and equal swaps.
    loads = rng.integers(0, 5, (L, E)).astype(float) * rng.choice([1.0, 0.37])
    groups = np.sort(np.stack([rng.permutation(N * K).reshape(N, K) for _ in range(L)]), axis=2)
    node_exp = (groups[..., None] * gs + np.arange(gs)).reshape(L * N, -1)
    spn = P // N
    rows = [rng.permutation(np.concatenate([r, rng.choice(r, spn - r.size)])) for r in node_exp]
    phy2log = np.array(rows).reshape(L, P)
    if rng.random() < 0.3:  # a stray expert: some node no longer holds whole groups
        phy2log[rng.integers(0, L), rng.integers(0, P)] = rng.integers(0, E)
    return t, loads, node_exp, phy2log


def test_group_helpers_equal_their_dense_forms() -> None:
    rng = np.random.default_rng(0)
    swaps = 0
    for _ in range(300):
        t, loads, node_exp, phy2log = _case(rng)
        assert (cand.groups_whole(phy2log, t) == _groups_whole_dense(phy2log, t)).all()
        nx = cand._node_experts(phy2log, t)
        if nx is not None:
            phy = phy2log.reshape(t.num_layers * t.num_nodes, t.gpus_per_node, -1)
            assert (cand._to_local(phy, nx, t.num_experts) == _to_local_dense(phy, nx, t.num_experts)).all()
        target = loads.sum(axis=1) / t.num_gpus * rng.choice([0.5, 1.0, 2.0])
        act, best = _best_swap_dense(loads, node_exp, t, target)
        got = cand._swap_groups(loads, node_exp, t, target)
        assert (got is None) == (not act.any())
        if got is not None:
            swaps += 1
            out, acted = got
            assert (acted == act).all()
            NK = t.num_groups
            blocks = node_exp.reshape(t.num_layers, NK, -1)
            for layer in np.flatnonzero(act):
                i, j = divmod(int(best[layer]), NK)
                # The groups at positions i and j traded places (by load rank), nothing else moved.
                moved = np.flatnonzero((out.reshape(blocks.shape)[layer] != blocks[layer]).any(axis=1))
                assert set(moved) <= {i, j}
                assert set(out.reshape(blocks.shape)[layer, i] // t.experts_per_group) == {
                    blocks[layer, j, 0] // t.experts_per_group
                }
    assert swaps > 50  # the cases do swap
