"""The fresh plan relabelled onto the previous one, so that only real changes move.

Gpus of a plan are interchangeable (within a node for the hierarchical policy, and nodes
among themselves), as are slots within a gpu: each fresh gpu takes the place of the current
gpu holding most of the same experts, and each surviving expert keeps its slot.
"""

from __future__ import annotations

import numpy as np

from ..placement import Placement
from ..topology import Topology

__all__ = ["align_to_previous", "align_slots"]


def _presence(groups: np.ndarray, num_experts: int) -> np.ndarray:
    """``groups``: ``[L, B, k]`` expert ids → ``[L, E, B]`` float32 counts of each expert per bin."""
    L, B, _ = groups.shape
    # One bincount over (layer, expert, bin) keys: np.add.at is several times slower.
    keys = (np.arange(L)[:, None, None] * num_experts + groups) * B + np.arange(B)[None, :, None]
    return np.bincount(keys.ravel(), minlength=L * num_experts * B).reshape(L, num_experts, B).astype(np.float32)


def _match(overlap: np.ndarray) -> np.ndarray:
    """``overlap``: ``[X, B, B]`` (new bin × old bin) → ``[X, B]``: the old bin for each new bin.

    Greedy: new bins in order of their best overlap, each takes its best free old bin.
    One vectorised step per bin.
    """
    X, B, _ = overlap.shape
    order = np.argsort(-overlap.max(axis=2), axis=1, kind="stable")
    taken = np.zeros((X, B), dtype=bool)
    out = np.empty((X, B), dtype=np.int64)
    rows = np.arange(X)
    for step in range(B):
        nb = order[:, step]
        score = np.where(taken, -1.0, overlap[rows, nb])
        ob = score.argmax(axis=1)
        out[rows, nb] = ob
        taken[rows, ob] = True
    return out


def _align_bins(new: np.ndarray, old: np.ndarray, num_experts: int) -> np.ndarray:
    """``new``, ``old``: ``[X, B, k]`` → ``new``'s bins reordered to sit where ``old`` has most in common."""
    # Each new bin's overlap with every old bin: the old bins' counts of its k experts, summed
    # (exact small integers). A gather of [X, B, k, B] rather than a product over all experts,
    # and no BLAS call, whose threads stall on a busy machine.
    held = _presence(old, num_experts)  # [X, E, B]
    overlap = held[np.arange(new.shape[0])[:, None, None], new].sum(axis=2)
    target = _match(overlap)
    out = np.empty_like(new)
    np.put_along_axis(out, target[:, :, None], new, axis=1)
    return out


def align_slots(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``new``, ``old``: ``[X, S]`` experts of matched gpus → ``new`` reordered so experts that
    stay keep their slot and the incoming ones fill the freed slots in order."""
    S = new.shape[1]
    dtype = np.result_type(old, new)
    old, new = old.astype(dtype, copy=False), new.astype(dtype, copy=False)
    # As multisets, so a gpu holding an expert twice keeps as many copies as the new one has:
    # the r-th copy of an expert stays if the other side has more than r of it. Counted slot
    # by slot of the other side (S whole-array steps on [X, S]): an [X, S, S] comparison
    # summed over its short last axis runs a reduction per gpu, several times slower.
    in_new = np.zeros(old.shape, dtype=np.int32)  # copies of each old slot's expert in new
    in_old = np.zeros(old.shape, dtype=np.int32)  # copies of each new slot's expert in old
    old_before = np.zeros(old.shape, dtype=np.int32)  # earlier copies in old
    new_before = np.zeros(old.shape, dtype=np.int32)
    for j in range(S):
        in_new += new[:, j : j + 1] == old
        in_old += old[:, j : j + 1] == new
        old_before[:, j + 1 :] += old[:, j : j + 1] == old[:, j + 1 :]
        new_before[:, j + 1 :] += new[:, j : j + 1] == new[:, j + 1 :]
    stays = old_before < in_new  # old slot keeps its expert
    incoming = new_before >= in_old  # new copy not there yet
    # Free slots, in order, get the incoming experts, in order (a gpu has as many of each).
    out = old.copy()
    out[~stays] = new[incoming]
    return out


def align_to_previous(phy2log: np.ndarray, previous: Placement, topology: Topology, by_node: bool) -> np.ndarray:
    """``phy2log``: ``[L, P]`` fresh plan → the same plan relabelled to move fewest slots from ``previous``.

    ``by_node``: keep the fresh plan's node contents together (hierarchical plans), matching
    nodes first and gpus within each node; otherwise any gpu may take any gpu's place.
    Replicas of one expert on one gpu are not expected (our policies avoid them).
    """
    t = topology
    L, S = t.num_layers, t.slots_per_gpu
    old = previous.phy2log
    if by_node and t.num_nodes > 1:
        new_nodes = phy2log.reshape(L, t.num_nodes, t.slots_per_node)
        aligned = _align_bins(new_nodes, old.reshape(L, t.num_nodes, t.slots_per_node), t.num_experts)
        gpus_new = aligned.reshape(L * t.num_nodes, t.gpus_per_node, S)
        gpus_old = old.reshape(L * t.num_nodes, t.gpus_per_node, S)
    else:
        gpus_new = phy2log.reshape(L, t.num_gpus, S)
        gpus_old = old.reshape(L, t.num_gpus, S)
    gpus = _align_bins(gpus_new, gpus_old, t.num_experts)
    slots = align_slots(gpus.reshape(-1, S), gpus_old.reshape(-1, S))
    return slots.reshape(L, t.num_slots).astype(np.int32)
