"""Checking load counters before any policy sees them."""

from __future__ import annotations

import numpy as np

from .topology import Topology

__all__ = ["check_loads", "check_layer_sums", "max_layer_sum"]


def max_layer_sum(topology: Topology) -> float:
    """The largest sum of one layer's loads the float64 policies can plan.

    Water-filling scales each load by the redundant slot count (< ``num_slots``) before dividing
    by the layer's sum, and re-plans aim at up to ``num_gpus`` x a gpu's load (tolerances are
    capped there), so ``sum x num_slots`` must stay finite.
    """
    return float(np.finfo(np.float64).max) / topology.num_slots


def check_layer_sums(arr: np.ndarray, limit: float, name: str, why: str) -> None:
    """``arr``: ``[L, E]`` finite, >= 0, summed in float64 (integer sums cannot wrap). Raises
    ``ValueError`` naming ``name``, the first layer whose sum is above ``limit`` (or overflows)
    and ``why`` that is the limit."""
    with np.errstate(over="ignore"):  # a sum that overflows is inf, which the test below catches
        sums = arr.sum(axis=1, dtype=np.float64)
    over = ~(sums <= limit)
    if over.any():
        layer = int(np.argmax(over))
        raise ValueError(
            f"{name} too large: layer {layer} sums to {sums[layer]:.4g}, above the limit of {limit:.4g} "
            f"per layer ({why}; {int(over.sum())} layers over); scale the counts down: plans depend on their ratios"
        )


def check_loads(loads: object, topology: Topology) -> np.ndarray:
    """``loads``: ``[L, E]`` finite, >= 0, each layer summing to at most ``max_layer_sum(topology)``
    → float64 ``[L, E]`` (a new array).

    Integer counts up to 2**53 convert exactly. Raises ``ValueError`` naming what is wrong.
    """
    try:
        arr = np.asarray(loads)
    except Exception as exc:  # ragged lists and the like
        raise ValueError(f"loads must be a numeric [num_layers, num_experts] array: {exc}") from None
    if arr.dtype == bool or arr.dtype.kind not in "iuf":
        raise ValueError(f"loads must hold integers or floats, got dtype {arr.dtype}")
    want = (topology.num_layers, topology.num_experts)
    if arr.shape != want:
        raise ValueError(f"loads has shape {list(arr.shape)}; expected [num_layers, num_experts] = {list(want)}")
    out = arr.astype(np.float64)
    if not np.isfinite(out).all():
        bad = np.argwhere(~np.isfinite(out))[0]
        raise ValueError(
            f"loads must be finite; loads[{bad[0]}, {bad[1]}] is {out[bad[0], bad[1]]} "
            f"({int((~np.isfinite(out)).sum())} non-finite values)"
        )
    if (out < 0).any():
        bad = np.argwhere(out < 0)[0]
        raise ValueError(
            f"loads must be >= 0; loads[{bad[0]}, {bad[1]}] is {out[bad[0], bad[1]]} "
            f"({int((out < 0).sum())} negative values)"
        )
    check_layer_sums(out, max_layer_sum(topology), "loads", "float64 max / num_slots")
    return out
