"""Spreading hot experts' replicas over nodes, so that one node failing loses fewer experts.

An expert whose every replica is on one node is lost when that node fails. ``spread_nodes``
takes the experts with two or more replicas all on one node, hottest first, and swaps one
replica with a slot on another node, the swap that leaves the two gpus' busier one least
loaded; the partner's expert must not end up on one node itself (unless it has a single
replica, which no swap can help), and neither gpu may end up with two replicas of one
expert. Vectorised across layers: one expert per layer per round.
"""

from __future__ import annotations

import numpy as np

from ..layout import per_replica, replica_counts, slot_sums, take_rows
from ..topology import Topology

__all__ = ["spread_nodes"]


def spread_nodes(loads: np.ndarray, phy2log: np.ndarray, topology: Topology) -> tuple[np.ndarray, int]:
    """``loads`` ``[L, E]``, ``phy2log`` int ``[L, P]`` (-1: empty slot) → the placement with
    hot experts' replicas spread over nodes ``[L, P]``, and how many swaps it made."""
    t = topology
    L, E, P, G, N = t.num_layers, t.num_experts, t.num_slots, t.num_gpus, t.num_nodes
    S = t.slots_per_gpu
    phy = np.asarray(phy2log, dtype=np.int64).copy()
    if N == 1:
        return phy, 0
    rows = np.arange(L)
    slot_gpu = np.arange(P) // S
    slot_node = np.arange(P) // t.slots_per_node
    cnt = replica_counts(phy, E)
    tried = cnt < 2
    swaps = 0
    while True:
        held = phy >= 0
        ids = np.where(held, phy, E)
        # on_node[l, e, n]: replicas of e on node n; on_gpu[l, g, e]: gpu g holds e.
        keys = ((rows[:, None] * (E + 1) + ids) * N + slot_node[None]).ravel()
        on_node = np.bincount(keys, minlength=L * (E + 1) * N).reshape(L, E + 1, N)[:, :E]
        on_gpu = np.zeros((L, G, E + 1), dtype=bool)
        on_gpu[rows[:, None], slot_gpu[None], ids] = True
        on_gpu = on_gpu[:, :, :E]
        one_node = (on_node == cnt[:, :, None]).any(axis=2)
        todo = ~tried & one_node
        if not todo.any():
            break
        x = np.where(todo, loads, -1.0).argmax(axis=1)  # [L]
        active = todo[rows, x]
        tried[rows[active], x[active]] = True
        w = take_rows(per_replica(loads, cnt), phy)  # [L, P], 0 for empty slots
        gpu_load = slot_sums(w.reshape(L, G, S))
        # Slot a: x's replica on its busiest gpu.
        mine = phy == x[:, None]
        a = np.where(mine, gpu_load[:, slot_gpu], -np.inf).argmax(axis=1)
        ga, na = slot_gpu[a], slot_node[a]
        wx = w[rows, a]
        # Partner slots b on other nodes.
        y = np.maximum(phy, 0)
        ny = take_rows(on_node.reshape(L, -1), y * N + na[:, None])  # y's replicas on x's node
        cy = take_rows(cnt, y)
        ok = held & (slot_node[None] != na[:, None]) & (phy != x[:, None])
        ok &= ~take_rows(on_gpu.reshape(L, -1), slot_gpu[None] * E + x[:, None])  # gpu b lacks x
        ok &= ~take_rows(on_gpu.reshape(L, -1), ga[:, None] * E + y)  # gpu a lacks y
        ok &= (cy == 1) | (ny + 1 < cy)
        after = np.maximum(gpu_load[rows, ga][:, None] - wx[:, None] + w, gpu_load[:, slot_gpu] - w + wx[:, None])
        b = np.where(ok, after, np.inf).argmin(axis=1)
        go = active & ok[rows, b]
        lay = rows[go]
        phy[lay, a[go]], phy[lay, b[go]] = phy[lay, b[go]], x[go]
        swaps += int(go.sum())
    return phy, swaps
