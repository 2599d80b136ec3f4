"""vLLM's live EPLB maps (``EplbModelState``) from and to ``eplb.Placement``.

Matched against vllm-project/vllm ``vllm/distributed/eplb/eplb_state.py`` at commit
50feac95f9e53a97d6ed27fee6bfe3b163d18594. There, per model, ``EplbState.model_states[...]``
holds (all int64 on the device unless said):

- ``physical_to_logical_map`` ``[L, P]``;
- ``logical_to_physical_map`` ``[L, E, 1024]``: each expert's slots, -1 padded to
  ``MAX_EXPERT_REDUNDANCY + 1 = 1024`` (the width is fixed when the state is built; MoE
  layers hold views of it, so it is updated with ``copy_``, never replaced);
- ``logical_replica_count`` ``[L, E]``;
- ``expert_load_window`` int32 ``[W, L, P]``: tokens per physical slot over the last ``W``
  steps, this rank's view (vLLM sums it over the window, folds slots into experts with
  ``scatter_add_`` and all-reduces over the EP group before its own rebalance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import eplb

__all__ = [
    "VLLM_MAP_WIDTH",
    "VllmMaps",
    "apply_to_vllm",
    "from_vllm",
    "to_vllm",
    "vllm_expert_loads",
    "vllm_slot_loads",
]

# logical_to_physical_map's last dimension in vLLM: MAX_EXPERT_REDUNDANCY (1023) + 1.
VLLM_MAP_WIDTH = 1024


@dataclass(frozen=True)
class VllmMaps:
    """int64 ``physical_to_logical_map [L, P]``, ``logical_to_physical_map [L, E, W]``
    (slots ascending, -1 padded), ``logical_replica_count [L, E]``."""

    physical_to_logical_map: torch.Tensor
    logical_to_physical_map: torch.Tensor
    logical_replica_count: torch.Tensor


def to_vllm(
    placement: eplb.Placement, *, width: int = VLLM_MAP_WIDTH, device: torch.device | str | None = None
) -> VllmMaps:
    """``placement`` ``[L, P]`` → vLLM's three maps; ``width`` is the live map's last dimension."""
    R = int(placement.logcnt.max())
    if width < R:
        raise ValueError(
            f"width={width} is below the most replicas of one expert ({R}); vLLM's maps are {VLLM_MAP_WIDTH} wide"
        )
    l2p = np.full((*placement.logcnt.shape, width), -1, dtype=np.int64)
    l2p[..., :R] = placement.log2phy[..., :R]
    return VllmMaps(
        physical_to_logical_map=torch.as_tensor(placement.phy2log.astype(np.int64), device=device),
        logical_to_physical_map=torch.as_tensor(l2p, device=device),
        logical_replica_count=torch.as_tensor(placement.logcnt.astype(np.int64), device=device),
    )


def from_vllm(physical_to_logical_map: torch.Tensor, topology: eplb.Topology) -> eplb.Placement:
    """vLLM's ``physical_to_logical_map`` ``[L, P]`` → ``eplb.Placement`` (``ValueError`` on misfit)."""
    return eplb.Placement(physical_to_logical_map.detach().cpu().numpy(), topology)


def apply_to_vllm(model_state: Any, placement: eplb.Placement, *, layers: Sequence[int] | None = None) -> None:
    """Switch a live ``EplbModelState`` to ``placement``: ``copy_`` into its three maps, in
    place (the MoE layers' views stay valid). Call it at the switch step, after the weights
    are in place (``WeightMover.commit()``), on every rank. ``layers``: write only these
    layers' rows (the chunk ``Rollout``'s ``on_switch`` names; default all)."""
    from .sglang import _chosen_layers

    live = (model_state.physical_to_logical_map, model_state.logical_to_physical_map, model_state.logical_replica_count)
    maps = to_vllm(placement, width=live[1].shape[-1], device=live[0].device)
    chosen = _chosen_layers(layers, placement.topology.num_layers)
    index = torch.tensor(chosen, dtype=torch.int64, device=live[0].device)
    for name, dst, src in zip(
        ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"),
        live,
        (maps.physical_to_logical_map, maps.logical_to_physical_map, maps.logical_replica_count),
    ):
        if dst.shape != src.shape:
            raise ValueError(
                f"{name} of the live state has shape {list(dst.shape)}; the placement gives {list(src.shape)}"
            )
        if len(chosen) == src.shape[0]:
            dst.copy_(src.to(dst.dtype))
        else:
            dst.index_copy_(0, index, src[index].to(dst.dtype))


def vllm_slot_loads(expert_load_window: torch.Tensor) -> np.ndarray:
    """``expert_load_window`` ``[W, L, P]`` → float64 ``[L, P]``: this rank's tokens per slot
    over the window, for ``LoadReporter`` as physical counts (with the placement version the
    window was recorded under)."""
    if expert_load_window.dim() != 3:
        raise ValueError(
            f"expert_load_window must be [window, layers, slots], got shape {list(expert_load_window.shape)}"
        )
    return expert_load_window.sum(dim=0).double().cpu().numpy()


def vllm_expert_loads(
    expert_load_window: torch.Tensor, physical_to_logical_map: torch.Tensor, num_experts: int
) -> np.ndarray:
    """``expert_load_window`` ``[W, L, P]`` and the map it was recorded under → float64
    ``[L, E]``: tokens per expert (replicas summed), this rank's view."""
    slots = torch.as_tensor(vllm_slot_loads(expert_load_window))
    p2l = physical_to_logical_map.detach().cpu().long()
    if p2l.shape != slots.shape:
        raise ValueError(
            f"physical_to_logical_map has shape {list(p2l.shape)}; expert_load_window gives [layers, slots] = {list(slots.shape)}"
        )
    out = torch.zeros((slots.shape[0], num_experts), dtype=torch.float64)
    out.scatter_add_(1, p2l, slots)
    return out.numpy()
