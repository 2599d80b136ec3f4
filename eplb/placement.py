"""Placement: which expert each slot holds, for every layer, and the maps derived from it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .layout import replica_counts
from .topology import Topology

__all__ = ["Placement"]


@dataclass(frozen=True, eq=False)
class Placement:
    """``phy2log``: int32 ``[L, P]``, the expert held by each slot, -1 for an empty slot.

    A gpu whose every slot is empty in every layer is down (``down_gpus``): it is absent from
    every metric (``eplb.metrics``), and ``rebalance(..., down_gpus=[...])`` plans such
    placements (vLLM's fault-tolerance maps mark a dead rank's slots with -1 the same way).

    Derived maps (computed once, read-only):
    - ``logcnt``: int32 ``[L, E]``, replicas per expert (empty slots count for none);
    - ``log2phy``: int32 ``[L, E, R]``, the slots of each expert in ascending slot order,
      padded with -1 (never an empty slot); ``R = topology.max_replicas`` so the shape is
      fixed for a topology;
    - ``gpu_of_slot``: int32 ``[P]``; ``live`` bool ``[G]`` and ``down_gpus``.

    Construction validates shapes and ranges against ``topology`` and raises ``ValueError``.
    """

    phy2log: np.ndarray
    topology: Topology

    def __post_init__(self) -> None:
        topo = self.topology
        if not isinstance(topo, Topology):
            raise ValueError(f"topology must be a Topology, got {type(topo).__name__}")
        arr = np.asarray(self.phy2log)
        if arr.dtype.kind not in "iu":
            raise ValueError(f"phy2log must hold integers, got dtype {arr.dtype}")
        want = (topo.num_layers, topo.num_slots)
        if arr.shape != want:
            raise ValueError(f"phy2log has shape {arr.shape}; expected [num_layers, num_slots] = {list(want)}")
        if arr.size and (arr.min() < -1 or arr.max() >= topo.num_experts):
            raise ValueError(
                f"phy2log holds expert ids in [{arr.min()}, {arr.max()}]; allowed range is "
                f"[0, {topo.num_experts - 1}], or -1 for an empty slot"
            )
        arr = np.ascontiguousarray(arr, dtype=np.int32)
        arr.setflags(write=False)
        object.__setattr__(self, "phy2log", arr)
        missing = self.logcnt == 0
        if missing.any():
            layer, expert = np.argwhere(missing)[0]
            raise ValueError(
                f"phy2log leaves expert {expert} of layer {layer} without a replica "
                f"({int(missing.sum())} (layer, expert) pairs missing); every expert needs >= 1 slot"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return self.topology == other.topology and np.array_equal(self.phy2log, other.phy2log)

    def __hash__(self) -> int:
        return hash((self.topology, self.phy2log.tobytes()))

    @cached_property
    def logcnt(self) -> np.ndarray:
        topo = self.topology
        out = replica_counts(self.phy2log, topo.num_experts).astype(np.int32)
        out.setflags(write=False)
        return out

    @cached_property
    def _by_expert(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``[L, P]`` slots sorted by expert (stable), their experts, and their replica ranks
        (-1 for empty slots, which sort first)."""
        order = np.argsort(self.phy2log, axis=1, kind="stable")
        sorted_exp = np.take_along_axis(self.phy2log, order, axis=1)
        empty = self.topology.num_slots - self.logcnt.sum(axis=1, keepdims=True)
        starts = np.cumsum(self.logcnt, axis=1) - self.logcnt + empty
        rank = np.arange(self.topology.num_slots)[None, :] - np.take_along_axis(
            starts, np.maximum(sorted_exp, 0), axis=1
        )
        return order, sorted_exp, np.where(sorted_exp >= 0, rank, -1)

    @cached_property
    def log2phy(self) -> np.ndarray:
        topo = self.topology
        L, P = topo.num_layers, topo.num_slots
        order, sorted_exp, rank = self._by_expert
        # Stable sort keeps each expert's slots in ascending slot order; empty slots go nowhere.
        out = np.full((L, topo.num_experts, topo.max_replicas), -1, dtype=np.int32)
        held = sorted_exp >= 0
        out[np.broadcast_to(np.arange(L)[:, None], (L, P))[held], sorted_exp[held], rank[held]] = order[held]
        out.setflags(write=False)
        return out

    @cached_property
    def replica_rank(self) -> np.ndarray:
        """int32 ``[L, P]``: the index of each slot among its expert's replicas (-1: empty)."""
        order, _, rank = self._by_expert
        out = np.empty_like(self.phy2log)
        np.put_along_axis(out, order, rank.astype(np.int32), axis=1)
        out.setflags(write=False)
        return out

    @cached_property
    def live(self) -> np.ndarray:
        """bool ``[G]``: gpus holding an expert in some layer (the others are down)."""
        topo = self.topology
        out = np.any(self.phy2log.reshape(topo.num_layers, topo.num_gpus, topo.slots_per_gpu) >= 0, axis=(0, 2))
        out.setflags(write=False)
        return out

    @property
    def down_gpus(self) -> tuple[int, ...]:
        """The gpus whose every slot is empty in every layer."""
        return tuple(int(g) for g in np.flatnonzero(~self.live))

    @property
    def full(self) -> bool:
        """Whether every slot holds an expert."""
        return bool(self.phy2log.min(initial=0) >= 0)

    @property
    def gpu_of_slot(self) -> np.ndarray:
        return np.arange(self.topology.num_slots, dtype=np.int32) // self.topology.slots_per_gpu

    def experts_on_gpu(self) -> np.ndarray:
        """int32 ``[L, G, P // G]``: the experts each gpu holds (-1: an empty slot)."""
        topo = self.topology
        return self.phy2log.reshape(topo.num_layers, topo.num_gpus, topo.slots_per_gpu)

    def validate(self, topology: Topology | None = None) -> None:
        """Re-check against ``topology`` (default: its own); raises ``ValueError``."""
        Placement(self.phy2log, topology or self.topology)

    @classmethod
    def contiguous(cls, topology: Topology) -> Placement:
        """The unbalanced baseline: expert ``e`` in slot ``e``, extra slots cycle through experts."""
        p = np.arange(topology.num_slots) % topology.num_experts
        return cls(np.broadcast_to(p, (topology.num_layers, topology.num_slots)).copy(), topology)
