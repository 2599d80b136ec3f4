"""Migration-aware re-planning: keep experts where they are unless moving them pays.

Per layer, the first of these that lands within ``(1 + tolerance)`` of a fresh plan's busiest
gpu, all vectorised across layers:
- keep: the current placement as it is (zero moves);
- repair: the current placement changed only on gpus above the target, by swaps (two slots)
  and count moves (one slot, see ``eplb.refine``);
- replace: the fresh plan relabelled onto the current one. Gpus of a plan are interchangeable
  (within a node for the hierarchical policy, and nodes among themselves), as are slots within
  a gpu, so each fresh gpu takes the place of the current gpu holding most of the same experts
  and each surviving expert keeps its slot. Balance is the fresh plan's; only the slots whose
  expert really changes move.
"""

from __future__ import annotations

import numpy as np

from .metrics import gpu_loads
from .placement import Placement
from .refine import refine_counts, swap_improve
from .replicate import replica_cap
from .topology import Topology

__all__ = ["align_to_previous", "repair_previous", "choose"]


def _presence(groups: np.ndarray, num_experts: int) -> np.ndarray:
    """``groups``: ``[L, B, k]`` expert ids → ``[L, B, E]`` float32 counts of each expert per bin."""
    L, B, _ = groups.shape
    out = np.zeros((L, B, num_experts), dtype=np.float32)
    np.add.at(out, (np.arange(L)[:, None, None], np.arange(B)[None, :, None], groups), 1.0)
    return out


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
    overlap = np.einsum("xbe,xce->xbc", _presence(new, num_experts), _presence(old, num_experts))
    target = _match(overlap)
    out = np.empty_like(new)
    np.put_along_axis(out, target[:, :, None], new, axis=1)
    return out


def _align_slots(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``new``, ``old``: ``[X, S]`` experts of matched gpus → ``new`` reordered so experts that
    stay keep their slot and the incoming ones fill the freed slots in order."""
    S = new.shape[1]
    stays = (old[:, :, None] == new[:, None, :]).any(axis=2)  # old slot keeps its expert
    incoming = ~(new[:, :, None] == old[:, None, :]).any(axis=2)  # new expert not there yet
    out = np.where(stays, old, -1)
    # Free slots, in order, get the incoming experts, in order.
    free_rank = np.cumsum(~stays, axis=1) - 1
    inc_sorted = np.take_along_axis(new, np.argsort(~incoming, axis=1, kind="stable"), axis=1)
    fill = np.take_along_axis(inc_sorted, np.clip(free_rank, 0, S - 1), axis=1)
    return np.where(stays, out, fill)


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
    slots = _align_slots(gpus.reshape(-1, S), gpus_old.reshape(-1, S))
    return slots.reshape(L, t.num_slots).astype(np.int32)


def repair_previous(loads: np.ndarray, previous: Placement, topology: Topology, target: np.ndarray, by_node: bool) -> np.ndarray:
    """``loads`` ``[L, E]``, ``target`` ``[L]`` busiest-gpu load to reach → ``phy2log`` ``[L, P]``.

    Starts from ``previous`` and changes it only until each layer's busiest gpu is at most its
    target: swaps of two slots between gpus (within a node when ``by_node``), then count moves
    (one slot rewritten with another expert, see ``eplb.refine``) with swaps after them.
    Layers that cannot reach the target come back improved as far as they got; the caller
    checks.
    """
    t = topology
    L, S = t.num_layers, t.slots_per_gpu
    prev = previous.phy2log
    node_exp = _node_experts(prev, t) if by_node and t.num_nodes > 1 else None
    if node_exp is not None:
        rows, bins = L * t.num_nodes, t.gpus_per_node
        tgt = np.repeat(target, t.num_nodes)
        row_loads = np.take_along_axis(np.repeat(loads, t.num_nodes, axis=0), node_exp, axis=1)
        phy = _to_local(prev.reshape(rows, bins, S), node_exp, t.num_experts)
    else:
        rows, bins = L, t.num_gpus
        tgt, row_loads, phy = target, loads, prev.reshape(L, bins, S).astype(np.int64)
    everything = np.arange(rows)
    swap_improve(row_loads, phy, everything, 64, tgt)
    cap = replica_cap(row_loads.shape[1], bins * S, bins)
    if cap is not None and _distinct_per_bin(phy):
        phy = refine_counts(row_loads, phy, cap, iterations=32, target=tgt)
        swap_improve(row_loads, phy, everything, 64, tgt)
    if node_exp is not None:
        phy = np.take_along_axis(node_exp, phy.reshape(rows, -1), axis=1)
    return phy.reshape(L, t.num_slots)


def _distinct_per_bin(phy: np.ndarray) -> bool:
    srt = np.sort(phy, axis=2)
    return not (srt[:, :, 1:] == srt[:, :, :-1]).any()


def _node_experts(prev: np.ndarray, t: Topology) -> np.ndarray | None:
    """``[L, P]`` → ``[L * N, E/N]``: each node's experts ascending, or ``None`` when some node
    does not hold exactly ``num_groups / num_nodes`` whole groups (not a hierarchical plan)."""
    L, N, K = prev.shape[0], t.num_nodes, t.num_groups // t.num_nodes
    g = np.sort(prev.reshape(L * N, t.slots_per_node) // t.experts_per_group, axis=1)
    first = np.ones_like(g, dtype=bool)
    first[:, 1:] = g[:, 1:] != g[:, :-1]
    if not (first.sum(axis=1) == K).all():
        return None
    groups = g[first].reshape(L * N, K)
    return (groups[:, :, None] * t.experts_per_group + np.arange(t.experts_per_group)).reshape(L * N, -1)


def _to_local(phy: np.ndarray, node_exp: np.ndarray, num_experts: int) -> np.ndarray:
    """Global expert ids ``[R, B, S]`` → positions in each row's ``node_exp`` ``[R, E/N]``."""
    R = phy.shape[0]
    inv = np.zeros((R, num_experts), dtype=np.int64)
    inv[np.arange(R)[:, None], node_exp] = np.arange(node_exp.shape[1])
    return inv[np.arange(R)[:, None, None], phy]

def choose(
    loads: np.ndarray, previous: Placement, fresh: np.ndarray, topology: Topology, tolerance: float, by_node: bool
) -> tuple[np.ndarray, dict]:
    """Per layer, the first of: keep ``previous``; repair it; the fresh plan ``[L, P]`` aligned
    onto it, accepting anything within ``(1 + tolerance)`` of fresh's busiest gpu. Returns
    ``phy2log`` ``[L, P]`` and how many layers took each way."""

    def busiest(phy2log: np.ndarray) -> np.ndarray:
        return gpu_loads(loads, Placement(phy2log, topology)).max(axis=1)

    fresh_max = busiest(fresh)
    target = (1.0 + tolerance) * fresh_max
    keep = gpu_loads(loads, previous).max(axis=1) <= target
    out = previous.phy2log.copy()
    repaired = np.zeros_like(keep)
    todo = ~keep
    if todo.any():
        fixed = repair_previous(loads, previous, topology, target, by_node)
        repaired = todo & (busiest(fixed) <= target)
        out[repaired] = fixed[repaired]
        replaced = todo & ~repaired
        out[replaced] = align_to_previous(fresh, previous, topology, by_node)[replaced]
    return out, {
        "layers_kept": int(keep.sum()),
        "layers_repaired": int(repaired.sum()),
        "layers_replanned": int((~keep & ~repaired).sum()),
    }
