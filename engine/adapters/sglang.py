"""SGLang's live expert-location maps (``ExpertLocationMetadata``) from and to ``eplb.Placement``.

Matched against sgl-project/sglang ``python/sglang/srt/eplb/expert_location.py`` at commit
6270b01498692d05d29267efe96d0eb7d9824545. ``ExpertLocationMetadata`` holds (int64, built
from Python lists, on the server's device):

- ``physical_to_logical_map`` ``[L, P]`` and its CPU copy ``physical_to_logical_map_cpu``;
- ``logical_to_all_physical_map`` ``[L, E, P]``: each expert's slots in ascending order,
  -1 padded to the full ``P`` width; ``logical_to_all_physical_map_num_valid`` ``[L, E]``;
- ``logical_to_rank_dispatch_physical_map`` ``[L, E]`` (only with
  ``--ep-dispatch-algorithm static``; else ``None``): the slot this EP rank sends each
  expert's tokens to: its own gpu's first replica if it has one, otherwise one of the
  expert's replicas spread evenly over the ranks without one by ``random.Random(42)``,
  drawn layer by layer and expert by expert, so every rank computes the same table.

``ExpertLocationMetadata.update(other, update_layer_ids)`` writes a new map into the live
tensors in place (``field[...] = ...``); ``apply_to_sglang`` does the same for given rows.
Its layer axis counts model layers (dense ones too); the MoE layers are the keys of
``model.routed_experts_weights_of_layer``. Loads: the expert-distribution recorder's
``logical_count`` (``[T, L, E]`` per pass, or ``[L, E]``), ``sglang_expert_loads``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import eplb

__all__ = ["SGLangMaps", "apply_to_sglang", "from_sglang", "rank_dispatch_map", "sglang_expert_loads", "to_sglang"]

_FIELDS = (
    "physical_to_logical_map",
    "physical_to_logical_map_cpu",
    "logical_to_all_physical_map",
    "logical_to_all_physical_map_num_valid",
    "logical_to_rank_dispatch_physical_map",
)


@dataclass(frozen=True)
class SGLangMaps:
    """The five fields of SGLang's ``ExpertLocationMetadata``, int64: ``physical_to_logical_map``
    ``[L, P]`` (and ``_cpu``), ``logical_to_all_physical_map`` ``[L, E, P]`` (-1 padded),
    ``logical_to_all_physical_map_num_valid`` ``[L, E]``, ``logical_to_rank_dispatch_physical_map``
    ``[L, E]`` or ``None``. ``ExpertLocationMetadata(**maps.fields())`` builds one."""

    physical_to_logical_map: torch.Tensor
    physical_to_logical_map_cpu: torch.Tensor
    logical_to_all_physical_map: torch.Tensor
    logical_to_all_physical_map_num_valid: torch.Tensor
    logical_to_rank_dispatch_physical_map: torch.Tensor | None

    def fields(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in _FIELDS}


def to_sglang(
    placement: eplb.Placement, *, ep_rank: int | None = None, device: torch.device | str | None = None
) -> SGLangMaps:
    """``placement`` → SGLang's maps; ``ep_rank`` (this rank, for the static dispatch table)
    or ``None`` when the server dispatches dynamically (the table is then ``None``)."""
    topo = placement.topology
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    all_phys = np.full((L, E, P), -1, dtype=np.int64)
    width = placement.log2phy.shape[-1]
    all_phys[..., :width] = placement.log2phy  # ascending slot order, like SGLang's loop over slots
    dispatch = None
    if ep_rank is not None:
        dispatch = torch.as_tensor(rank_dispatch_map(placement, ep_rank), device=device)
    p2l = torch.as_tensor(placement.phy2log.astype(np.int64))
    return SGLangMaps(
        physical_to_logical_map=p2l.to(device),
        physical_to_logical_map_cpu=p2l.clone(),
        logical_to_all_physical_map=torch.as_tensor(all_phys, device=device),
        logical_to_all_physical_map_num_valid=torch.as_tensor(placement.logcnt.astype(np.int64), device=device),
        logical_to_rank_dispatch_physical_map=dispatch,
    )


def rank_dispatch_map(placement: eplb.Placement, ep_rank: int, seed: int = 42) -> np.ndarray:
    """int64 ``[L, E]``: where EP rank ``ep_rank`` sends each expert's tokens under SGLang's
    static dispatch: the first replica on its own gpu, else a fair random replica.

    Every rank's table comes out of one draw sequence (``random.Random(seed)``, layers then
    experts, only for experts some gpu lacks), so all ranks agree; ranks without a replica
    of an expert share its replicas evenly (each replica ``k // n`` or one more times).
    """
    topo = placement.topology
    G, S = topo.num_gpus, topo.slots_per_gpu
    if isinstance(ep_rank, bool) or not isinstance(ep_rank, (int, np.integer)) or not 0 <= ep_rank < G:
        raise ValueError(f"ep_rank must be an integer in [0, {G}), got {ep_rank!r}")
    rng = random.Random(seed)
    L, P = topo.num_layers, topo.num_slots
    # own[l, e, g]: the lowest slot of expert e on gpu g, or -1
    own = np.full((L, topo.num_experts, G), P, dtype=np.int64)
    slots = np.broadcast_to(np.arange(P), (L, P))
    np.minimum.at(own, (np.broadcast_to(np.arange(L)[:, None], (L, P)), placement.phy2log, slots // S), slots)
    own[own == P] = -1
    out = own[:, :, ep_rank].copy()
    missing = (own < 0).any(axis=2)
    for lay, exp in zip(*np.nonzero(missing)):
        candidates = [int(p) for p in placement.log2phy[lay, exp] if p >= 0]
        lacking = np.flatnonzero(own[lay, exp] < 0)
        quotient, remainder = divmod(len(lacking), len(candidates))
        picks = candidates * quotient + rng.sample(candidates, k=remainder)
        rng.shuffle(picks)
        if own[lay, exp, ep_rank] < 0:
            out[lay, exp] = picks[int(np.searchsorted(lacking, ep_rank))]
    return out


def from_sglang(physical_to_logical_map: torch.Tensor, topology: eplb.Topology) -> eplb.Placement:
    """SGLang's ``physical_to_logical_map`` ``[L, P]`` → ``eplb.Placement`` (``ValueError`` on misfit)."""
    return eplb.Placement(physical_to_logical_map.detach().cpu().numpy(), topology)


def apply_to_sglang(
    metadata: Any,
    placement: eplb.Placement,
    *,
    layer_ids: list[int] | None = None,
    ep_rank: int | None = None,
    layers: Sequence[int] | None = None,
) -> None:
    """Switch a live ``ExpertLocationMetadata`` to ``placement`` in place (what its
    ``update(other, layer_ids)`` does). ``layer_ids``: the metadata rows the placement's
    ``L`` layers go to (SGLang numbers model layers, dense ones included: DeepSeek-V3's 58
    MoE layers are rows 3..60 of 61); default ``0..L-1``. Other rows are left alone. Call it
    at the switch step, after the weights are in place, on every rank; pass ``ep_rank`` when
    the metadata has a static dispatch table. ``layers``: write only these placement layers
    (the chunk ``Rollout``'s ``on_switch`` names; default all). The dispatch table is drawn
    from the whole ``placement`` (a mixed one between chunks): every rank draws the same."""
    has_dispatch = getattr(metadata, "logical_to_rank_dispatch_physical_map", None) is not None
    if has_dispatch and ep_rank is None:
        raise ValueError(
            "the metadata has a static dispatch table (logical_to_rank_dispatch_physical_map): pass ep_rank"
        )
    L = placement.topology.num_layers
    rows = list(range(L)) if layer_ids is None else [int(i) for i in layer_ids]
    if len(rows) != L or len(set(rows)) != L:
        raise ValueError(f"layer_ids must name {L} distinct metadata rows, one per placement layer; got {layer_ids!r}")
    chosen = _chosen_layers(layers, L)
    rows = [rows[i] for i in chosen]
    maps = to_sglang(placement, ep_rank=ep_rank if has_dispatch else None)
    for name, full in maps.fields().items():
        src = full[chosen] if full is not None else None
        dst = getattr(metadata, name)
        if dst is None:
            continue
        if not rows:
            continue
        if dst.shape[1:] != src.shape[1:] or max(rows) >= dst.shape[0]:
            raise ValueError(
                f"{name} of the live metadata has shape {list(dst.shape)}; the placement gives {L} rows of {list(src.shape[1:])} for rows {rows[0]}..{rows[-1]}"
            )
        index = torch.tensor(rows, device=dst.device)
        dst.index_copy_(0, index, src.to(device=dst.device, dtype=dst.dtype))


def _chosen_layers(layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """``layers`` (placement layers to write) → a sorted list; ``ValueError`` outside ``0..L-1``."""
    if layers is None:
        return list(range(num_layers))
    chosen = sorted({int(i) for i in layers})
    if chosen and (chosen[0] < 0 or chosen[-1] >= num_layers):
        raise ValueError(f"layers must be placement layers in 0..{num_layers - 1}, got {list(layers)!r}")
    return chosen


def sglang_expert_loads(logical_count: torch.Tensor, layer_ids: list[int] | None = None) -> np.ndarray:
    """The expert-distribution recorder's ``logical_count`` (``[T, L_model, E]`` or
    ``[L_model, E]``) → float64 ``[L, E]``: summed over passes, the MoE ``layer_ids`` rows."""
    counts = logical_count.detach().double().cpu()
    if counts.dim() == 3:
        counts = counts.sum(dim=0)
    if counts.dim() != 2:
        raise ValueError(
            f"logical_count must be [passes, layers, experts] or [layers, experts], got shape {list(logical_count.shape)}"
        )
    if layer_ids is not None:
        counts = counts[list(layer_ids)]
    return counts.numpy()
