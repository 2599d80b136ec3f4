"""How good a placement is: per-gpu load, imbalance, balancedness and the lower bound.

Down gpus (``Placement.down_gpus``: every slot empty) are absent: their gpu load is NaN, and
imbalance and balancedness are over the live gpus.
"""

from __future__ import annotations

import numpy as np

from . import bounds
from .layout import slot_sums
from .placement import Placement
from .survivors import survivors
from .topology import Topology

__all__ = ["gpu_loads", "imbalance", "balancedness", "lower_bound", "imbalance_lb", "moves"]


def gpu_loads(loads: np.ndarray, placement: Placement) -> np.ndarray:
    """``loads``: ``[L, E]``; returns float64 ``[L, G]``: tokens each gpu serves, replicas
    splitting evenly; an empty slot serves none, and a down gpu's load is NaN (absent)."""
    if not isinstance(placement, Placement):
        raise ValueError(f"placement must be a Placement, got {type(placement).__name__}")
    topo = placement.topology
    shape = np.shape(loads)
    if shape != (topo.num_layers, topo.num_experts):
        raise ValueError(
            f"loads has shape {list(shape)}; the placement needs [num_layers, num_experts] = "
            f"[{topo.num_layers}, {topo.num_experts}]"
        )
    # A last column of zeros: an empty slot's -1 reads it.
    per_replica = np.zeros((topo.num_layers, topo.num_experts + 1))
    np.divide(np.asarray(loads, dtype=np.float64), np.maximum(placement.logcnt, 1), out=per_replica[:, :-1])
    slot_load = np.take_along_axis(per_replica, placement.phy2log, axis=1)
    out = slot_sums(slot_load.reshape(topo.num_layers, topo.num_gpus, topo.slots_per_gpu))
    if not placement.full:
        out[:, ~placement.live] = np.nan
    return out


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    # An all-zero layer is perfectly balanced by definition.
    return np.divide(num, den, out=np.ones_like(num, dtype=np.float64), where=den > 0)


def _max_mean(gpu_load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[L, G]`` → ``[L]`` max and mean over the gpus that are not NaN (down)."""
    absent = np.isnan(gpu_load)
    if not absent.any():
        return gpu_load.max(axis=1), gpu_load.mean(axis=1)
    live = (~absent).sum(axis=1)
    # fmax skips NaN; a layer with no live gpu at all is all-zero (balanced).
    most = np.nan_to_num(np.fmax.reduce(gpu_load, axis=1))
    return most, np.divide(np.nansum(gpu_load, axis=1), live, out=np.zeros(live.shape), where=live > 0)


def imbalance(gpu_load: np.ndarray) -> np.ndarray:
    """``gpu_load``: ``[L, G]`` → ``[L]`` max / mean over the live gpus (NaN: down), 1.0 for
    an all-zero layer."""
    most, mean = _max_mean(gpu_load)
    return _ratio(most, mean)


def balancedness(gpu_load: np.ndarray) -> np.ndarray:
    """``gpu_load``: ``[L, G]`` → ``[L]`` mean / max over the live gpus, what vLLM and SGLang log."""
    most, mean = _max_mean(gpu_load)
    return _ratio(mean, most)


def lower_bound(loads: np.ndarray, topology: Topology, down_gpus: object = ()) -> np.ndarray:
    """``loads``: ``[L, E]`` → ``[L]``: no placement's busiest gpu can carry less.

    ``max(mean gpu load, min over replica counts of max_e loads[e] / count[e])`` with counts
    summing to the slot count and capped at the gpu count (water-filling gives the min), and
    with two slots per gpu the pairing bound (``eplb.bounds``). ``down_gpus``: gpus that are
    absent; the bound is then that of the live gpus' slots (``eplb.survivors``).
    """
    return bounds.lower_bound(np.asarray(loads, dtype=np.float64), survivors(topology, down_gpus).bound_topology)


def imbalance_lb(loads: np.ndarray, topology: Topology, down_gpus: object = ()) -> np.ndarray:
    """``[L]`` lower bound / mean gpu load over the live gpus (1.0 for an all-zero layer)."""
    loads = np.asarray(loads, dtype=np.float64)
    topo = survivors(topology, down_gpus).bound_topology
    return _ratio(bounds.lower_bound(loads, topo), loads.sum(axis=1) / topo.num_gpus)


def moves(old: Placement, new: Placement) -> np.ndarray:
    """``[L]`` int: slots whose expert changes to another expert, each one an expert's weights
    copied; a slot that empties (its gpu went down) copies nothing and is not counted."""
    if old.topology != new.topology:
        raise ValueError(f"placements have different topologies: {old.topology} vs {new.topology}")
    return ((old.phy2log != new.phy2log) & (new.phy2log >= 0)).sum(axis=1)
