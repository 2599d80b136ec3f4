"""Checking load counters before any policy sees them."""

from __future__ import annotations

import numpy as np

from .topology import Topology

__all__ = ["check_loads"]


def check_loads(loads: object, topology: Topology) -> np.ndarray:
    """``loads``: ``[L, E]`` finite, >= 0 → float64 ``[L, E]`` (a new array).

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
    return out
