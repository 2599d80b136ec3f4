"""An exact proof for small layers where CP-SAT finds the optimum but cannot prove it.

With float loads the optimum often sits a hair above the mean gpu load, and CP-SAT's bound
stays at the mean: proving that no placement does better is a partition problem with large
numbers. Here every replica-count vector is tried in turn (with ``C`` counts per expert there
are at most ``comb(P - 1, E - 1)``). For one vector the replicas are fixed, and a placement
beating ``U`` needs every gpu's ``S`` replicas to sum within ``[total - (G - 1) (U - 1), U - 1]``:
a window a few units wide when ``U`` is near the mean, which very few ``S``-subsets of the
replicas hit. The subsets are enumerated with numpy, vectors whose subsets cannot cover every
replica are dropped at once, and an exact-cover search runs on what is left. Integer unit
weights, so the answer is exact for the model CP-SAT solves.
"""

from __future__ import annotations

import time
from itertools import combinations
from math import comb

import numpy as np

from .planner.replicate import count_vectors

__all__ = ["improve_or_prove"]

# Beyond these the enumeration costs more than it is worth.
_MAX_VECTORS = 200_000
_MAX_SUBSETS = 20_000
# [vectors x subsets x S] elements per numpy step.
_CHUNK = 1 << 22


def improve_or_prove(
    w: np.ndarray, num_gpus: int, slots_per_gpu: int, incumbent: int, deadline: float | None = None
) -> tuple[bool, int, np.ndarray | None]:
    """``w``: ``[E, C]`` int64 weight of one replica of expert ``e`` when it has ``c + 1``
    replicas; ``incumbent``: the busiest gpu of a known placement, in the same units.

    Returns ``(done, value, row)``: ``done`` when every count vector was examined, so
    ``value`` (the incumbent, or better) is optimal; ``row`` the ``[P]`` placement reaching
    ``value`` when it beats ``incumbent`` (gpu-major, experts ascending per gpu), else ``None``.
    """
    E, C = w.shape
    G, S = num_gpus, slots_per_gpu
    P = G * S
    if comb(P - 1, E - 1) > _MAX_VECTORS or comb(P, S) > _MAX_SUBSETS:
        return False, incumbent, None
    vectors = count_vectors(E, P, C)
    combos = np.array(list(combinations(range(P), S)), dtype=np.int64)  # [M, S] lexicographic
    best, row = incumbent, None
    # Lower bound per vector: the mean gpu (rounded up) and the largest replica.
    rep = w[np.arange(E)[None, :], vectors - 1]  # [V, E]
    total = (rep * vectors).sum(axis=1)
    bound = np.maximum(-(-total // G), rep.max(axis=1))
    order = np.argsort(bound, kind="stable")
    order = order[bound[order] < best]  # sorted: no later vector can beat the incumbent
    step = max(1, _CHUNK // (len(combos) * S))
    for lo in range(0, len(order), step):
        if deadline is not None and time.perf_counter() > deadline:
            return False, best, row
        chunk = order[lo : lo + step]
        chunk = chunk[bound[chunk] < best]
        if chunk.size == 0:
            break
        # Replicas of each vector grouped by expert: [n, P] ids and weights.
        ids = np.stack([np.repeat(np.arange(E), vectors[v]) for v in chunk])
        weight = np.take_along_axis(rep[chunk], ids, axis=1)
        # Drop vectors where some replica is in no subset that fits the window.
        fits = _fitting(ids, weight, combos, G, total[chunk], best - 1)  # [n, M]
        covered = np.zeros((len(chunk), P), dtype=bool)
        r, k = np.nonzero(fits)
        covered[r[:, None], combos[k]] = True
        for i in np.flatnonzero(covered.all(axis=1)):
            v = chunk[i]
            while bound[v] < best:
                try:
                    found = _partition(ids[i], weight[i], combos, G, int(total[v]), best - 1, deadline)
                except TimeoutError:
                    return False, best, row
                if found is None:
                    break
                best = int(weight[i][found].sum(axis=1).max())
                row = np.sort(ids[i][found], axis=1).reshape(-1).astype(np.int32)
    return True, best, row


def _fitting(
    ids: np.ndarray, weight: np.ndarray, combos: np.ndarray, G: int, total: np.ndarray, cap: int
) -> np.ndarray:
    """``[n, P]`` replicas of ``n`` vectors → ``[n, M]``: which ``S``-subsets (``combos``) hold
    distinct experts and sum within what a placement with every gpu at most ``cap`` allows."""
    low = (total - (G - 1) * cap)[:, None]
    sums = weight[:, combos].sum(axis=2)
    distinct = (ids[:, combos[:, 1:]] != ids[:, combos[:, :-1]]).all(axis=2)  # ids ascending
    return distinct & (sums >= low) & (sums <= cap)


def _partition(
    ids: np.ndarray,
    weight: np.ndarray,
    combos: np.ndarray,
    G: int,
    total: int,
    cap: int,
    deadline: float | None = None,
) -> np.ndarray | None:
    """Replicas ``ids``/``weight`` ``[P]`` into ``G`` gpus of ``S`` with distinct experts and
    every gpu at most ``cap`` → ``[G, S]`` replica indices, or ``None`` when impossible.
    Raises ``TimeoutError`` past ``deadline`` (checked every few thousand search nodes)."""
    if total - (G - 1) * cap > cap:  # the other G - 1 gpus carry at most cap each
        return None
    subsets = combos[_fitting(ids[None], weight[None], combos, G, np.array([total]), cap)[0]]
    if len(subsets) < G:
        return None
    P = len(ids)
    covered = np.zeros(P, dtype=bool)
    covered[subsets.ravel()] = True
    if not covered.all():
        return None
    masks = (np.int64(1) << subsets).sum(axis=1)  # distinct indices: the sum is the OR
    first = subsets[:, 0]
    full = (1 << P) - 1
    chosen: list[int] = []
    nodes = [0]

    def search(used: int) -> bool:
        if used == full:
            return True
        nodes[0] += 1
        if deadline is not None and nodes[0] % 4096 == 0 and time.perf_counter() > deadline:
            raise TimeoutError
        # The lowest free replica must be in the next subset; subsets are sorted, so it is
        # that subset's first element.
        i = (~used & (used + 1)).bit_length() - 1
        for k in np.flatnonzero(first == i):
            if not (int(masks[k]) & used):
                chosen.append(int(k))
                if search(used | int(masks[k])):
                    return True
                chosen.pop()
        return False

    if not search(0):
        return None
    return subsets[chosen]
