"""Drop-in for ``rebalance_experts`` of DeepSeek's EPLB (github deepseek-ai/EPLB), on numpy arrays."""

from __future__ import annotations

import numpy as np

from .. import checks
from ..limits import check_plan_bytes
from ..loads import check_layer_sums
from ..policies.deepseek import FLOAT32_LAYER_SUM, deepseek_log2phy, deepseek_rebalance
from ..topology import Topology

__all__ = ["rebalance_experts"]


def _count(name: str, value: object) -> int:
    return checks.positive_int(name, value, allowed="a positive integer")


def rebalance_experts(
    weight: object, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``weight``: ``[layers, num_logical_experts]`` → int64 arrays, exactly as DeepSeek's eplb.py:

    - ``phy2log``: ``[layers, num_replicas]``, the expert of each slot;
    - ``log2phy``: ``[layers, num_logical_experts, X]``, each expert's slots in replica-creation
      order, -1 padded, ``X`` the largest replica count of the call;
    - ``logcnt``: ``[layers, num_logical_experts]``, replicas per expert.

    Where eplb.py would fail an ``assert``, this raises ``ValueError`` saying which rule broke;
    so does a plan whose ``eplb.limits.plan_bytes`` (the library's estimate, more than eplb.py's
    linear memory needs) is above ``eplb.limits.max_plan_bytes()``.
    """
    w = np.asarray(weight)
    if w.ndim != 2 or w.dtype == bool or w.dtype.kind not in "iuf":
        raise ValueError(
            f"weight must be a numeric [layers, num_logical_experts] array, got shape {w.shape} dtype {w.dtype}"
        )
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weight must be finite and >= 0")
    check_layer_sums(w, FLOAT32_LAYER_SUM, "weight", "eplb.py computes in float32")
    num_replicas, num_groups = _count("num_replicas", num_replicas), _count("num_groups", num_groups)
    num_nodes, num_gpus = _count("num_nodes", num_nodes), _count("num_gpus", num_gpus)
    num_log = w.shape[1]
    if num_replicas < num_log:
        raise ValueError(f"num_replicas ({num_replicas}) must be >= num_logical_experts ({num_log})")
    if num_replicas % num_gpus:
        raise ValueError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    if num_groups % num_nodes == 0:
        if num_log % num_groups:
            raise ValueError(f"num_logical_experts ({num_log}) must be a multiple of num_groups ({num_groups})")
        if num_replicas % num_nodes or (num_log // num_nodes) > (num_replicas // num_nodes):
            raise ValueError("each node needs at least as many slots as it has experts")
    if w.size:
        hier = (num_nodes, num_groups) if num_groups % num_nodes == 0 else ()
        check_plan_bytes(Topology(w.shape[0], num_log, num_replicas, num_gpus, *hier))
    phy2log, phyrank, logcnt, _ = deepseek_rebalance(w, num_replicas, num_groups, num_nodes, num_gpus)
    return phy2log, deepseek_log2phy(phy2log, phyrank, logcnt), logcnt
