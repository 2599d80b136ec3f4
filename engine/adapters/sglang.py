"""SGLang's live expert-location maps (``ExpertLocationMetadata``) from and to ``eplb.Placement``.

Supported SGLang: ``SUPPORTED_SGLANG`` (0.5.23), proven by ``tests_engines/sglang`` against the
released ``sglang/srt/eplb/expert_location.py``, its ``update()``, its dispatch maps and its
``ExpertLocationUpdater``. ``apply_to_sglang`` on SGLang's own class, and the drop-in plugin
(``eplb_engine.adapters.sglang_plugin``), check the running version: another one warns
(``UnsupportedSglangWarning``) and a metadata without the fields written here is refused with a
``RuntimeError`` naming them. The conversions are plain tensor work and need no SGLang installed.

``ExpertLocationMetadata`` (0.5.23) holds, int64, on the server's device unless said:

- ``physical_to_logical_map`` ``[L, P]`` and ``physical_to_logical_map_cpu``, a host copy;
- ``logical_to_all_physical_map`` ``[L, E, P]``: each expert's slots in ascending order, -1
  padded to the full ``P`` width, and ``logical_to_all_physical_map_cpu``, a host copy (what
  ``logical_to_all_physical()``, and so the weight loader, reads);
  ``logical_to_all_physical_map_num_valid`` ``[L, E]``. On a CPU server the host copies are the
  live tensors themselves (``.cpu()`` of a CPU tensor); on a GPU they are separate tensors, so
  each is written here;
- ``ep_size``: the EP ranks;
- ``logical_to_rank_dispatch_physical_map`` ``[L, E]`` (``--ep-dispatch-algorithm static``
  only; else ``None``): the slot this rank sends each expert's tokens to.

With an all-to-all MoE backend (``--moe-a2a-backend deepep``, ``mooncake``, ...; ``a2a=True``
here) SGLang cuts ``logical_to_all_physical_map`` per rank: an expert with a replica on this
rank's gpu keeps only its first one there (with several nodes, else its first on this node,
when that narrows the list), an expert with one replica keeps it; the others keep all. Its
static dispatch table is drawn from that cut map: ``random.Random(42)``, layers then experts;
for each expert every rank takes its nearest replica and the ranks with none share the
expert's replicas evenly (``k // n`` each, ``k % n`` of them drawn); an expert that every rank
finds a replica of (one replica only, for one) draws nothing.

``ExpertLocationMetadata.update(other, update_layer_ids)`` writes a new map into the live
tensors in place; ``apply_to_sglang`` does the same for given rows. Its layer axis counts model
layers (dense ones too); the MoE layers are ``moe_layer_rows(model)``. Loads: the
expert-distribution recorder's ``logical_count`` (``[T, L, E]`` per pass, or ``[L, E]``),
already summed over the EP ranks by the recorder's all-reduce: ``sglang_expert_loads``.

Every array and tensor returned here is contiguous (``tests/engine/test_adapter_contiguity.py``
all-reduces each over gloo ranks).
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import eplb
from eplb import checks

__all__ = [
    "SUPPORTED_SGLANG",
    "SGLangMaps",
    "UnsupportedSglangWarning",
    "apply_to_sglang",
    "check_sglang_version",
    "from_sglang",
    "moe_layer_rows",
    "moe_layer_weights",
    "rank_dispatch_map",
    "rank_physical_map",
    "sglang_expert_loads",
    "to_sglang",
]

# The SGLang versions whose ExpertLocationMetadata / ExpertLocationUpdater tests_engines/sglang
# proves the adapter on.
SUPPORTED_SGLANG = ("0.5.23",)

_TENSORS = (
    "physical_to_logical_map",
    "physical_to_logical_map_cpu",
    "logical_to_all_physical_map",
    "logical_to_all_physical_map_cpu",
    "logical_to_all_physical_map_num_valid",
)
_FIELDS = (*_TENSORS, "ep_size", "logical_to_rank_dispatch_physical_map")
_checked: dict[str, str] = {}


class UnsupportedSglangWarning(UserWarning):
    """The running SGLang is not one of ``SUPPORTED_SGLANG``."""


def check_sglang_version(version: str | None = None) -> str:
    """The running SGLang's version (``sglang.__version__``; ``version`` to check another). One of
    ``SUPPORTED_SGLANG`` passes; any other warns ``UnsupportedSglangWarning`` naming them (the
    maps are still written where the metadata has the fields: see ``apply_to_sglang``)."""
    if version is None:
        import sglang

        version = str(sglang.__version__)
    base = version.split("+")[0]
    if base not in SUPPORTED_SGLANG:
        warnings.warn(
            f"SGLang {version} is not a version eplb's SGLang adapter is proven on "
            f"({', '.join(SUPPORTED_SGLANG)}); its ExpertLocationMetadata fields, dispatch tables and "
            "EPLB manager may differ",
            UnsupportedSglangWarning,
            stacklevel=2,
        )
    return version


def _check_live(metadata: Any) -> None:
    """On SGLang's own class: the version, once per process; on any metadata: the fields."""
    if type(metadata).__module__.startswith("sglang.") and "sglang" not in _checked:
        _checked["sglang"] = check_sglang_version()
    missing = [name for name in _FIELDS if not hasattr(metadata, name)]
    if missing:
        raise RuntimeError(
            f"the live expert-location metadata has no {', '.join(missing)}: not the ExpertLocationMetadata of a "
            f"supported SGLang ({', '.join(SUPPORTED_SGLANG)}); eplb cannot switch its maps"
        )


@dataclass(frozen=True)
class SGLangMaps:
    """The fields of SGLang's ``ExpertLocationMetadata`` (0.5.23), int64:
    ``physical_to_logical_map`` ``[L, P]`` (and ``_cpu``), ``logical_to_all_physical_map``
    ``[L, E, P]`` (-1 padded; and ``_cpu``), ``logical_to_all_physical_map_num_valid`` ``[L, E]``,
    ``ep_size``, ``logical_to_rank_dispatch_physical_map`` ``[L, E]`` or ``None``.
    ``ExpertLocationMetadata(**maps.fields())`` builds one."""

    physical_to_logical_map: torch.Tensor
    physical_to_logical_map_cpu: torch.Tensor
    logical_to_all_physical_map: torch.Tensor
    logical_to_all_physical_map_cpu: torch.Tensor
    logical_to_all_physical_map_num_valid: torch.Tensor
    ep_size: int
    logical_to_rank_dispatch_physical_map: torch.Tensor | None

    def fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}


def to_sglang(
    placement: eplb.Placement,
    *,
    ep_rank: int | None = None,
    static_dispatch: bool = True,
    a2a: bool = False,
    nnodes: int = 1,
    device: torch.device | str | None = None,
) -> SGLangMaps:
    """``placement`` → SGLang's maps as rank ``ep_rank`` holds them.

    ``ep_rank``: this rank, for the static dispatch table (built when ``static_dispatch``, the
    default; ``None``: no table, the server dispatches dynamically) and for ``a2a``'s cut.
    ``a2a``: the server runs an all-to-all MoE backend (``--moe-a2a-backend`` other than
    ``none``): ``logical_to_all_physical_map`` keeps, per expert, this rank's nearest replica
    where it has one (needs ``ep_rank``). ``nnodes``: the server's nodes (SGLang prefers a
    replica on the rank's node). The host copies (``_cpu``) are separate tensors, as on a GPU.
    """
    topo = placement.topology
    if a2a and ep_rank is None:
        raise ValueError("a2a=True cuts logical_to_all_physical_map per rank: pass ep_rank")
    if ep_rank is not None:
        _check_rank(ep_rank, topo.num_gpus)
    _check_nodes(nnodes, topo.num_gpus)
    all_phys = rank_physical_map(placement, ep_rank if a2a else None, nnodes=nnodes)
    dispatch = None
    if ep_rank is not None and static_dispatch:
        table = rank_dispatch_map(placement, ep_rank, a2a=a2a, nnodes=nnodes)
        dispatch = torch.as_tensor(table, device=device)
    p2l = torch.as_tensor(placement.phy2log.astype(np.int64))
    l2p = torch.as_tensor(all_phys)
    return SGLangMaps(
        physical_to_logical_map=p2l.to(device),
        physical_to_logical_map_cpu=p2l.clone(),
        logical_to_all_physical_map=l2p.to(device),
        logical_to_all_physical_map_cpu=l2p.clone(),
        logical_to_all_physical_map_num_valid=torch.as_tensor((all_phys >= 0).sum(axis=2), device=device),
        ep_size=topo.num_gpus,
        logical_to_rank_dispatch_physical_map=dispatch,
    )


def _check_rank(ep_rank: object, num_gpus: int) -> None:
    if not (checks.is_int(ep_rank) and 0 <= int(ep_rank) < num_gpus):
        raise ValueError(f"ep_rank must be an integer in [0, {num_gpus}), got {ep_rank!r}")


def _check_nodes(nnodes: object, num_gpus: int) -> None:
    if not (checks.is_int(nnodes) and int(nnodes) >= 1 and num_gpus % int(nnodes) == 0):
        raise ValueError(f"nnodes must be a positive integer dividing the {num_gpus} EP ranks, got {nnodes!r}")


class _Nearest:
    """SGLang's ``_find_nearest_expert`` for one topology: a replica of ``candidates`` (slots,
    ascending) on rank ``r``'s gpu, else (several nodes) on its node if that narrows the list,
    else -1; a single candidate is always it."""

    def __init__(self, topo: eplb.Topology, nnodes: int) -> None:
        self.S = topo.slots_per_gpu
        self.gpus_per_node = topo.num_gpus // nnodes
        self.node_slots = self.S * self.gpus_per_node

    def __call__(self, candidates: list[int], r: int) -> int:
        if len(candidates) == 1:
            return candidates[0]
        for p in candidates:
            if p // self.S == r:
                return p
        node = r // self.gpus_per_node
        same = [p for p in candidates if p // self.node_slots == node]
        if 0 < len(same) < len(candidates):
            return same[0]
        return -1


def _candidates(placement: eplb.Placement) -> list[list[list[int]]]:
    """``[L][E]`` each expert's slots, ascending (SGLang's loop over slots)."""
    return [[[int(p) for p in row if p >= 0] for row in layer] for layer in placement.log2phy]


def _cut(candidates: list[list[list[int]]], nearest: _Nearest, ep_rank: int) -> list[list[list[int]]]:
    """SGLang's a2a cut: every expert's list replaced by ``[nearest]`` where rank ``ep_rank`` has one."""
    out = []
    for layer in candidates:
        rows = []
        for cands in layer:
            p = nearest(cands, ep_rank)
            rows.append([p] if p != -1 else cands)
        out.append(rows)
    return out


def rank_physical_map(placement: eplb.Placement, ep_rank: int | None = None, *, nnodes: int = 1) -> np.ndarray:
    """int64 ``[L, E, P]``: SGLang's ``logical_to_all_physical_map``, each expert's slots ascending,
    -1 padded to ``P``; with ``ep_rank`` (an all-to-all backend) as that rank holds it: one slot,
    its nearest replica, for every expert it has one of."""
    topo = placement.topology
    L, E, P = topo.num_layers, topo.num_experts, topo.num_slots
    out = np.full((L, E, P), -1, dtype=np.int64)
    if ep_rank is None:
        width = placement.log2phy.shape[-1]
        out[..., :width] = placement.log2phy
        return out
    _check_rank(ep_rank, topo.num_gpus)
    _check_nodes(nnodes, topo.num_gpus)
    for lay, layer in enumerate(_cut(_candidates(placement), _Nearest(topo, nnodes), ep_rank)):
        for exp, cands in enumerate(layer):
            out[lay, exp, : len(cands)] = cands
    return out


def rank_dispatch_map(
    placement: eplb.Placement, ep_rank: int, seed: int = 42, *, a2a: bool = False, nnodes: int = 1
) -> np.ndarray:
    """int64 ``[L, E]``: where EP rank ``ep_rank`` sends each expert's tokens under SGLang's
    static dispatch (``compute_logical_to_rank_dispatch_physical_map``).

    One draw sequence (``random.Random(seed)``, layers then experts) over the candidate lists
    (with ``a2a``, the ones rank ``ep_rank`` holds after the cut): each rank takes its nearest
    replica; the ranks with none share the replicas evenly (``k // n`` each, ``k % n`` drawn,
    then shuffled). An expert every rank finds a replica of draws nothing.

    With gpus down (their slots all -1; SGLang's own maps have no such state): a down rank
    sends nothing (its row is all -1) and takes no share, so the live ranks split each
    replica's share among themselves; no entry points at an empty slot.
    """
    topo = placement.topology
    _check_rank(ep_rank, topo.num_gpus)
    _check_nodes(nnodes, topo.num_gpus)
    G = topo.num_gpus
    nearest = _Nearest(topo, nnodes)
    candidates = _candidates(placement)
    if a2a:
        candidates = _cut(candidates, nearest, ep_rank)
    rng = random.Random(seed)
    down = set(placement.down_gpus)
    out = np.empty((topo.num_layers, topo.num_experts), dtype=np.int64)
    for lay, layer in enumerate(candidates):
        for exp, cands in enumerate(layer):
            picks = [-1 if r in down else nearest(cands, r) for r in range(G)]
            lacking = [r for r in range(G) if picks[r] == -1 and r not in down]
            if lacking:
                quotient, remainder = divmod(len(lacking), len(cands))
                fair = cands * quotient + rng.sample(cands, k=remainder)
                rng.shuffle(fair)
                for r, p in zip(lacking, fair):
                    picks[r] = p
            out[lay, exp] = picks[ep_rank]
    return out


def from_sglang(physical_to_logical_map: torch.Tensor, topology: eplb.Topology) -> eplb.Placement:
    """SGLang's ``physical_to_logical_map`` ``[L, P]`` → ``eplb.Placement`` (``ValueError`` on misfit)."""
    return eplb.Placement(physical_to_logical_map.detach().cpu().numpy(), topology)


def moe_layer_weights(model: Any) -> dict[int, list[torch.Tensor]]:
    """``model.routed_experts_weights_of_layer`` as a dict ``{row: [tensors [local slots, ...]]}``,
    rows ascending. SGLang's models hold a dict or a ``LazyValue`` around one (Qwen3-MoE,
    DeepSeek-V2/V3, GPT-OSS, ...): ``sorted(lazy)`` raises ``KeyError``, ``.items()`` works on both."""
    weights = model.routed_experts_weights_of_layer
    return {int(row): list(tensors) for row, tensors in sorted(weights.items())}


def moe_layer_rows(model: Any) -> list[int]:
    """The MoE layers' rows in SGLang's maps (model layers, dense ones included), ascending:
    the keys of ``model.routed_experts_weights_of_layer`` (a dict or a ``LazyValue``)."""
    return sorted(int(row) for row in model.routed_experts_weights_of_layer.keys())


def apply_to_sglang(
    metadata: Any,
    placement: eplb.Placement,
    *,
    layer_ids: list[int] | None = None,
    ep_rank: int | None = None,
    layers: Sequence[int] | None = None,
    a2a: bool = False,
    nnodes: int = 1,
    target: eplb.Placement | None = None,
) -> None:
    """Switch a live ``ExpertLocationMetadata`` to ``placement`` in place (what its
    ``update(other, layer_ids)`` does), host copies (``_cpu``) included. ``layer_ids``: the
    metadata rows the placement's ``L`` layers go to (``moe_layer_rows(model)``: SGLang numbers
    model layers, dense ones included); default ``0..L-1``. Other rows are left alone. Call it
    at the switch step, after the weights are in place, on every rank. ``ep_rank``: this rank,
    needed with a static dispatch table and with ``a2a`` (an all-to-all MoE backend: the map is
    cut per rank, see ``to_sglang``); ``nnodes``: the server's nodes. ``layers``: write only these
    placement layers (the chunk ``Rollout``'s ``on_switch`` names; default all). The dispatch
    table is drawn as SGLang draws it, over all the metadata's rows (the dense ones as they
    are, the MoE ones from ``target``, default ``placement``). ``target``: the placement the
    switch is heading to, when ``placement`` is the mixed map between the chunks of a chunked
    switch: SGLang's own chunked update copies each chunk's rows from the target's table
    (``update(target, update_layer_ids=chunk)``), drawn over the whole target map, and so
    does this with it."""
    _check_live(metadata)
    has_dispatch = metadata.logical_to_rank_dispatch_physical_map is not None
    if (has_dispatch or a2a) and ep_rank is None:
        why = "a static dispatch table (logical_to_rank_dispatch_physical_map)" if has_dispatch else "a2a=True"
        raise ValueError(f"the metadata has {why}: pass ep_rank")
    G = placement.topology.num_gpus
    if int(metadata.ep_size) != G:
        raise ValueError(f"the live metadata has ep_size {metadata.ep_size}; the placement's topology has {G} gpus")
    L = placement.topology.num_layers
    rows = list(range(L)) if layer_ids is None else [int(i) for i in layer_ids]
    if len(rows) != L or len(set(rows)) != L:
        raise ValueError(f"layer_ids must name {L} distinct metadata rows, one per placement layer; got {layer_ids!r}")
    chosen = _chosen_layers(layers, L)
    rows = [rows[i] for i in chosen]
    if not rows:
        return
    if target is not None and target.topology != placement.topology:
        raise ValueError(f"target has topology {target.topology}; the placement has {placement.topology}")
    drawn = placement if target is None else target
    maps = to_sglang(placement, ep_rank=ep_rank, static_dispatch=False, a2a=a2a, nnodes=nnodes)
    writes = {name: getattr(maps, name)[chosen] for name in _TENSORS}
    if has_dispatch:
        # SGLang draws its table over every row of the metadata (dense rows too) in one
        # sequence: draw over the live map with the target's rows in, as init_by_mapping
        # would for it, and write the rows that switch (the target's rows, chunk or not).
        all_rows = list(range(L)) if layer_ids is None else [int(i) for i in layer_ids]
        model_map = metadata.physical_to_logical_map_cpu.detach().cpu().numpy().astype(np.int64)
        model_map[all_rows] = drawn.phy2log
        model = eplb.Placement(model_map, placement.topology.with_layers(model_map.shape[0]))
        table = rank_dispatch_map(model, ep_rank, a2a=a2a, nnodes=nnodes)
        writes["logical_to_rank_dispatch_physical_map"] = torch.as_tensor(table[rows])
    for name, src in writes.items():
        dst = getattr(metadata, name)
        if dst.shape[1:] != src.shape[1:] or max(rows) >= dst.shape[0]:
            raise ValueError(
                f"{name} of the live metadata has shape {list(dst.shape)}; the placement gives {L} rows of {list(src.shape[1:])} for rows {rows[0]}..{rows[-1]}"
            )
        # On a CPU server a host copy is the live tensor itself: written twice, same values.
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
    ``[L_model, E]``) → float64 ``[L, E]``: summed over passes, the MoE ``layer_ids`` rows.
    The recorder all-reduces it over the EP ranks before it returns it: report it from one
    rank only, or the service counts every token once per rank."""
    counts = logical_count.detach().double().cpu()
    if counts.dim() == 3:
        counts = counts.sum(dim=0)
    if counts.dim() != 2:
        raise ValueError(
            f"logical_count must be [passes, layers, experts] or [layers, experts], got shape {list(logical_count.shape)}"
        )
    if layer_ids is not None:
        counts = counts[list(layer_ids)]
    # The recorder's tensor may be a strided view (then the cast and cpu() above return it as
    # it is): a strided result all-reduces to wrong values on gloo.
    return counts.contiguous().numpy()
