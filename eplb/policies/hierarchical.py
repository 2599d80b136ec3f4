"""Our replicate-and-pack policies: ``hierarchical`` (groups → nodes → gpus) and ``global``.

``global`` is ``hierarchical`` with one node and one group: one code path, as in DeepSeek's
eplb.py, but with replica counts capped so no gpu needs two copies of an expert, a balanced
deal instead of a per-item greedy, and a swap step that lowers the busiest gpu.
"""

from __future__ import annotations

import time

import numpy as np

from ..packing import pack
from ..refine import refine_counts, refine_thorough, separate_hot
from ..replicate import replica_cap, waterfill
from ..topology import Topology

__all__ = ["place_hierarchical", "place_global", "OPTIONS"]

# Options both policies take, with their defaults.
OPTIONS: dict[str, object] = {
    "max_rounds": 16,  # swap rounds after the deal
    "refine": 8,  # count moves per layer (0: keep water-filling counts)
    "donors": None,  # donor experts a count move considers (None: 8, or 4 with <= 2 slots per gpu)
    "effort": "fast",  # "high": wide count search alternated with re-packing
    "time_limit": 1.0,  # seconds effort="high" may spend per plan (None: no limit)
}


def _options(options: dict) -> dict:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; allowed: {sorted(OPTIONS)} (and 'tolerance', 'layer_tolerance', 'max_moves', 'max_layer_moves' with previous=)")
    out = {**OPTIONS, **options}
    for name in ("max_rounds", "refine", "donors"):
        v = out[name]
        if name == "donors" and v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            extra = " or None" if name == "donors" else ""
            raise ValueError(f"option {name} must be an integer >= 0{extra}, got {v!r}")
    limit = out["time_limit"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
        raise ValueError(f"option time_limit must be a positive number of seconds or None, got {limit!r}")
    if out["effort"] not in ("fast", "high"):
        raise ValueError(f"option effort must be 'fast' or 'high', got {out['effort']!r}")
    return out


def _donors(donors: object, slots_per_gpu: int) -> int:
    # Under strong skew a wider donor search is what lowers the busiest gpu (v3-64 zipf 1.5:
    # 1.188 with 4 donors, 1.053 with 8). With two slots per gpu the pairing already decides
    # most of the balance and 8 donors cost a third more time for 0.05 %.
    if donors is not None:
        return int(donors)
    return 4 if slots_per_gpu <= 2 else 8


def place_hierarchical(loads: np.ndarray, topology: Topology, **options: object) -> np.ndarray:
    """``loads``: float64 ``[L, E]`` → ``phy2log`` int32 ``[L, P]``.

    1. pack expert groups onto nodes (equal group count per node);
    2. give each node's experts that node's slots by water-filling, at most one replica per gpu
       of the node;
    3. pack each node's replicas onto its gpus.
    Requires ``num_groups % num_nodes == 0``.
    """
    topo = topology
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    N, G, groups = topo.num_nodes, topo.num_gpus, topo.num_groups
    if groups % N:
        raise ValueError(
            f"hierarchical needs num_groups ({groups}) to be a multiple of num_nodes ({N}); use policy 'global'"
        )
    start = time.perf_counter()
    opts = _options(options)
    max_rounds = int(opts["max_rounds"])
    group_size = E // groups
    # Step 1: groups → nodes. node_groups[l, n, :] lists the groups of node n.
    group_load = loads.reshape(L, groups, group_size).sum(axis=2)
    node_groups = pack(group_load, N, max_rounds=max_rounds) if N > 1 else np.broadcast_to(np.arange(groups), (L, 1, groups))
    node_groups = np.sort(node_groups, axis=2)
    # node_experts[l, n, :]: the experts of node n's groups, ascending.
    node_experts = (node_groups[..., None] * group_size + np.arange(group_size)).reshape(L, N, E // N)
    # Step 2: replicate within each node, rows are (layer, node).
    local_loads = np.take_along_axis(loads, node_experts.reshape(L, E), axis=1).reshape(L * N, E // N)
    gpn = G // N
    counts = waterfill(local_loads, P // N, replica_cap(E // N, P // N, gpn))
    # Replicas as items: local expert id repeated count times, each carrying load / count.
    local_ids = np.repeat(np.tile(np.arange(E // N), L * N), counts.ravel()).reshape(L * N, P // N)
    rows = np.arange(L * N)[:, None]
    item_w = (local_loads / counts)[rows, local_ids]
    # Step 3: replicas → gpus of the node.
    # A gpu of the busiest node carries at least that node's mean, so no node needs its
    # gpus balanced below it.
    node_mean = local_loads.sum(axis=1).reshape(L, N) / gpn
    floor = np.repeat(node_mean.max(axis=1), N)
    assign = pack(item_w, gpn, local_ids, max_rounds=max_rounds, floor=floor)  # [L*N, gpn, S]
    slot_local = local_ids[rows[:, :, None], assign]
    cap = replica_cap(E // N, P // N, gpn)
    # Count moves need gpus free of duplicate replicas, which the cap guarantees.
    limit = opts["time_limit"] if opts["effort"] == "high" else None
    deadline = None if limit is None else start + limit
    if cap is not None and gpn > 1:
        if opts["effort"] == "high":
            slot_local = refine_thorough(local_loads, slot_local, cap, deadline)
        elif opts["refine"]:
            slot_local = refine_counts(
                local_loads,
                slot_local,
                cap,
                iterations=int(opts["refine"]),
                donors=_donors(opts["donors"], P // G),
                target=np.maximum(floor, local_loads.sum(axis=1) / gpn * 1.001),
            )
    # With few gpus per node, water-filling can make two hot experts share gpus; only nodes
    # whose busiest gpu is above the floor matter. The global policy's cap is the whole gpu
    # count, where this does not arise at the standard scales; effort="high" tries anyway.
    if cap is not None and gpn > 1 and (N > 1 or opts["effort"] == "high"):
        slot_local = separate_hot(local_loads, slot_local, cap, target=floor, deadline=deadline)
    slot_local = np.sort(slot_local, axis=2).reshape(L, N, P // N)
    phy2log = np.take_along_axis(node_experts, slot_local, axis=2).reshape(L, P)
    return phy2log.astype(np.int32)


def place_global(loads: np.ndarray, topology: Topology, **options: object) -> np.ndarray:
    """``loads``: float64 ``[L, E]`` → ``phy2log`` int32 ``[L, P]``, ignoring nodes and groups."""
    flat = Topology(topology.num_layers, topology.num_experts, topology.num_slots, topology.num_gpus)
    return place_hierarchical(loads, flat, **options)
