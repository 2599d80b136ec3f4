"""How good a placement is: per-gpu load, imbalance, balancedness and the lower bound."""

from __future__ import annotations

import numpy as np

from . import bounds
from .placement import Placement
from .topology import Topology

__all__ = ["gpu_loads", "imbalance", "balancedness", "lower_bound", "imbalance_lb", "moves"]


def gpu_loads(loads: np.ndarray, placement: Placement) -> np.ndarray:
    """``loads``: ``[L, E]``; returns float64 ``[L, G]``: tokens each gpu serves, replicas splitting evenly."""
    topo = placement.topology
    per_replica = np.asarray(loads, dtype=np.float64) / np.maximum(placement.logcnt, 1)
    slot_load = np.take_along_axis(per_replica, placement.phy2log, axis=1)
    return slot_load.reshape(topo.num_layers, topo.num_gpus, topo.slots_per_gpu).sum(axis=2)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    # An all-zero layer is perfectly balanced by definition.
    return np.divide(num, den, out=np.ones_like(num, dtype=np.float64), where=den > 0)


def imbalance(gpu_load: np.ndarray) -> np.ndarray:
    """``gpu_load``: ``[L, G]`` → ``[L]`` max / mean (1.0 for an all-zero layer)."""
    return _ratio(gpu_load.max(axis=1), gpu_load.mean(axis=1))


def balancedness(gpu_load: np.ndarray) -> np.ndarray:
    """``gpu_load``: ``[L, G]`` → ``[L]`` mean / max, what vLLM and SGLang log."""
    return _ratio(gpu_load.mean(axis=1), gpu_load.max(axis=1))


def lower_bound(loads: np.ndarray, topology: Topology) -> np.ndarray:
    """``loads``: ``[L, E]`` → ``[L]``: no placement's busiest gpu can carry less.

    ``max(mean gpu load, min over replica counts of max_e loads[e] / count[e])`` with counts
    summing to the slot count and capped at the gpu count (water-filling gives the min), and
    with two slots per gpu the pairing bound (``eplb.bounds``).
    """
    return bounds.lower_bound(np.asarray(loads, dtype=np.float64), topology)


def imbalance_lb(loads: np.ndarray, topology: Topology) -> np.ndarray:
    """``[L]`` lower bound / mean gpu load (1.0 for an all-zero layer)."""
    loads = np.asarray(loads, dtype=np.float64)
    return _ratio(lower_bound(loads, topology), loads.sum(axis=1) / topology.num_gpus)


def moves(old: Placement, new: Placement) -> np.ndarray:
    """``[L]`` int: slots whose expert changes, each one an expert's weights copied."""
    if old.topology != new.topology:
        raise ValueError(f"placements have different topologies: {old.topology} vs {new.topology}")
    return (old.phy2log != new.phy2log).sum(axis=1)
