"""Bit-exact numpy reproduction of DeepSeek's open-source ``eplb.py`` (deepseek-ai/EPLB).

Same float32 arithmetic, same accumulation order, same tie-breaking (stable descending sort,
first minimum / first maximum), vectorised across layers: the loops run over items and
replicas only, never over layers. Use it to match an engine that runs eplb.py; the
``global`` and ``hierarchical`` policies plan better.
"""

from __future__ import annotations

import numpy as np

from ._stdsort import argsort_desc_like_torch

__all__ = ["deepseek_rebalance", "deepseek_log2phy", "FLOAT32_LAYER_SUM"]

# Largest sum of one layer's loads eplb.py's float32 arithmetic can take: every sum it forms
# (group, node, gpu loads) is at most the layer's, and 2**127 leaves a factor of two below
# float32's largest value (about 2**128) for rounding in any summation order.
FLOAT32_LAYER_SUM = 2.0**127


def _balanced_packing(
    weight: np.ndarray, num_packs: int, keys: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``weight``: float32 ``[X, n]`` → ``pack_index``, ``rank_in_pack``: int64 ``[X, n]``.

    Each item in descending weight goes to the lightest pack that is not full (first such pack
    on ties), pack weights summed in float32 in that order. ``keys`` (``[X, n]``): see
    ``argsort_desc_like_torch``; which of two equal same-key items goes where then may differ
    from eplb.py, what each pack holds does not.
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return np.broadcast_to(np.arange(n), (rows, n)).copy(), np.zeros((rows, n), dtype=np.int64)
    order = argsort_desc_like_torch(weight, keys)
    r = np.arange(rows)
    pack_weight = np.zeros((rows, num_packs), dtype=np.float32)
    pack_items = np.zeros((rows, num_packs), dtype=np.int64)
    full = np.zeros((rows, num_packs), dtype=bool)
    pack_index = np.empty((rows, n), dtype=np.int64)
    rank_in_pack = np.empty((rows, n), dtype=np.int64)
    inf = np.float32(np.inf)
    for i in range(n):
        item = order[:, i]
        pack = np.where(full, inf, pack_weight).argmin(axis=1)
        pack_index[r, item] = pack
        rank_in_pack[r, item] = pack_items[r, pack]
        pack_weight[r, pack] += weight[r, item]
        pack_items[r, pack] += 1
        full[r, pack] = pack_items[r, pack] == per_pack
    return pack_index, rank_in_pack


def _replicate(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``weight``: float32 ``[X, n]`` → ``phy2log``, ``rank`` int64 ``[X, num_phy]``, ``logcnt`` ``[X, n]``.

    Each redundant slot goes to the expert with the largest float32 ``weight / logcnt``
    (first one on ties).
    """
    rows, n = weight.shape
    phy2log = np.broadcast_to(np.arange(num_phy), (rows, num_phy)).copy()
    rank = np.zeros((rows, num_phy), dtype=np.int64)
    logcnt = np.ones((rows, n), dtype=np.int64)
    ratio = weight.copy()
    r = np.arange(rows)
    for i in range(n, num_phy):
        pick = ratio.argmax(axis=1)
        phy2log[:, i] = pick
        rank[:, i] = logcnt[r, pick]
        logcnt[r, pick] += 1
        ratio[r, pick] = weight[r, pick] / logcnt[r, pick].astype(np.float32)
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def _group_sums(weight: np.ndarray, num_groups: int) -> np.ndarray:
    # Exact sum rounded once to float32. torch's vectorised float32 sum agrees whenever the
    # partial sums are exact (integer counts below 2**24); for fractional loads it may differ
    # in the last bit, which only matters on an exact tie between two groups.
    rows, n = weight.shape
    return weight.astype(np.float64).reshape(rows, num_groups, n // num_groups).sum(axis=2).astype(np.float32)


def _hierarchical(
    weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int, exact_ranks: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus
    # Step 1: groups → nodes; "mlog" numbers experts node-major.
    group_pack, group_rank = _balanced_packing(_group_sums(weight, num_groups), num_nodes)
    log2mlog = (((group_pack * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size)).reshape(
        layers, num_log
    )
    mlog2log = _inverse(log2mlog)
    # Step 2: replicate within each node; rows are (layer, node).
    tokens_per_mlog = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, num_log // num_nodes)
    phy2mlog, phyrank, mlogcnt = _replicate(tokens_per_mlog, num_phy // num_nodes)
    # Step 3: replicas → gpus within each node.
    tokens_per_phy = np.take_along_axis(tokens_per_mlog / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    pack_index, rank_in_pack = _balanced_packing(
        tokens_per_phy, num_gpus // num_nodes, None if exact_ranks else phy2mlog
    )
    pphy2phy = _inverse(pack_index * phy_per_gpu + rank_in_pack)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)
    offsets = np.arange(0, num_log, num_log // num_nodes)[None, :, None]
    pphy2mlog = (pphy2mlog.reshape(layers, num_nodes, -1) + offsets).reshape(layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def deepseek_rebalance(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int, *, exact_ranks: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """``weight``: ``[L, E]`` → ``phy2log`` ``[L, P]``, ``phyrank`` ``[L, P]``, ``logcnt`` ``[L, E]``
    (int64) and whether the hierarchical path ran.

    Hierarchical when ``num_groups % num_nodes == 0``, else one group on one node, as eplb.py.
    ``phyrank`` is each slot's replica index in creation order, which fixes ``log2phy``'s order.
    ``exact_ranks=False`` skips replaying torch's sort where only ``phyrank`` would change
    (``phy2log`` and ``logcnt`` stay exact): much faster, for callers that derive ``log2phy``
    themselves.
    """
    w = np.asarray(weight).astype(np.float32)
    if num_groups % num_nodes == 0:
        return (*_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus, exact_ranks), True)
    return (*_hierarchical(w, num_replicas, 1, 1, num_gpus, exact_ranks), False)


def deepseek_log2phy(
    phy2log: np.ndarray, phyrank: np.ndarray, logcnt: np.ndarray, width: int | None = None
) -> np.ndarray:
    """int64 ``[L, E, width]`` (default width: the largest count, as eplb.py), -1 padded."""
    layers, num_log = logcnt.shape
    width = int(logcnt.max()) if width is None else width
    log2phy = np.full((layers, num_log * width), -1, dtype=np.int64)
    rows = np.arange(layers)[:, None]
    log2phy[rows, phy2log * width + phyrank] = np.arange(phy2log.shape[1])
    return log2phy.reshape(layers, num_log, width)
