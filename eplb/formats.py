"""Placements in the engines' formats: pure converters to and from dicts, arrays and text.

Writing and reading files is the caller's job (``eplb_tools.io``). Readers raise
``ValueError`` naming the field and what was expected; the caller prefixes the file name.

- native: ``{"format": "eplb-placement", "version": 1, "topology": {...}, "phy2log": [L][P],
  "stats": {...}}`` (:func:`to_native` / :func:`from_native`);
- SGLang ``--init-expert-location`` JSON: ``{"physical_to_logical_map": [L][P]}``;
- vLLM-shaped arrays: ``physical_to_logical [L, P]``, ``logical_to_physical [L, E, R]``
  (-1 padded, ``R = P - E + 1``) and ``logical_replica_count [L, E]``;
- a per-gpu listing a person can read (and :func:`from_listing` can parse back).

Empty slots (-1, every slot of a down gpu) travel as -1 in every format, as vLLM's
fault-tolerance maps write them.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from .metrics import gpu_loads
from .placement import Placement
from .topology import Topology

__all__ = [
    "PLACEMENT_FORMAT",
    "PLACEMENT_VERSION",
    "topology_to_dict",
    "topology_from_dict",
    "to_native",
    "from_native",
    "to_sglang",
    "from_sglang",
    "to_vllm",
    "from_vllm",
    "to_listing",
    "from_listing",
]

PLACEMENT_FORMAT = "eplb-placement"
"""The ``format`` field of the native placement file."""
PLACEMENT_VERSION = 1
"""The native placement file's format version; 1.x reads every version it wrote."""

_TOPO_FIELDS = ("num_layers", "num_experts", "num_slots", "num_gpus", "num_nodes", "num_groups")


def topology_to_dict(topology: Topology) -> dict[str, Any]:
    """The topology as the files write it: ``{"num_layers": L, "num_experts": E, ...}``."""
    return {name: getattr(topology, name) for name in _TOPO_FIELDS}


def topology_from_dict(doc: object, field: str = "topology") -> Topology:
    """``{"num_layers": L, ...}`` (short names ``layers, experts, slots, gpus, nodes, groups``
    accepted too) → Topology; ``num_nodes`` and ``num_groups`` default to 1."""
    if not isinstance(doc, dict):
        raise ValueError(
            f"field {field!r}: expected an object with {', '.join(_TOPO_FIELDS)}, got {type(doc).__name__}"
        )
    known = set(_TOPO_FIELDS) | {n.removeprefix("num_") for n in _TOPO_FIELDS}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise ValueError(
            f"field {field!r}: unknown keys {', '.join(unknown)}; allowed: {', '.join(_TOPO_FIELDS)} (or without 'num_')"
        )
    values = {}
    for name in _TOPO_FIELDS:
        short = name.removeprefix("num_")
        if name in doc or short in doc:
            values[name] = doc[name] if name in doc else doc[short]
        elif name not in ("num_nodes", "num_groups"):
            raise ValueError(f"field '{field}.{name}': missing; expected a positive integer")
    try:
        return Topology(**values)
    except ValueError as exc:
        raise ValueError(f"field {field!r}: {exc}") from None


def _int_array(value: object, field: str, ndim: int, shape_doc: str) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception:
        arr = np.asarray([], dtype=object)
    if arr.dtype == object or arr.ndim != ndim:
        raise ValueError(
            f"field {field!r}: expected a rectangular integer array {shape_doc}, got {'ragged data' if arr.dtype == object else f'shape {list(arr.shape)}'}"
        )
    if arr.dtype.kind == "f" and np.array_equal(arr, np.round(arr)):
        arr = arr.astype(np.int64)  # some writers emit 3.0 for 3
    if arr.dtype.kind not in "iu":
        raise ValueError(f"field {field!r}: expected integers {shape_doc}, got dtype {arr.dtype}")
    return arr


def _placement(phy2log: np.ndarray, topology: Topology, field: str) -> Placement:
    try:
        return Placement(phy2log, topology)
    except ValueError as exc:
        raise ValueError(f"field {field!r}: {exc}") from None


def to_native(placement: Placement, stats: dict[str, Any] | None = None) -> dict[str, Any]:
    """Placement (+ plain-Python ``stats``, e.g. ``Plan.summary()``) → native JSON object."""
    return {
        "format": PLACEMENT_FORMAT,
        "version": PLACEMENT_VERSION,
        "topology": topology_to_dict(placement.topology),
        "phy2log": placement.phy2log.tolist(),
        "stats": dict(stats or {}),
    }


def from_native(doc: object) -> Placement:
    """Native JSON object → Placement (validated against its topology)."""
    if not isinstance(doc, dict):
        raise ValueError(
            f"expected a JSON object with fields format, version, topology, phy2log; got {type(doc).__name__}"
        )
    if doc.get("format") != PLACEMENT_FORMAT:
        raise ValueError(f"field 'format': expected {PLACEMENT_FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("version") != PLACEMENT_VERSION:
        raise ValueError(f"field 'version': expected {PLACEMENT_VERSION}, got {doc.get('version')!r}")
    for key in ("topology", "phy2log"):
        if key not in doc:
            raise ValueError(f"field {key!r}: missing")
    topo = topology_from_dict(doc["topology"])
    return _placement(_int_array(doc["phy2log"], "phy2log", 2, "[num_layers][num_slots]"), topo, "phy2log")


def _topology_for(phy2log: np.ndarray, num_gpus: int, num_nodes: int, num_groups: int, field: str) -> Topology:
    # Every expert holds >= 1 slot, so the largest id present is E - 1 (empty slots are -1).
    L, P = phy2log.shape
    try:
        return Topology(L, int(phy2log.max()) + 1, P, num_gpus, num_nodes, num_groups)
    except ValueError as exc:
        raise ValueError(f"field {field!r}: {exc}") from None


def to_sglang(placement: Placement) -> dict[str, Any]:
    """Placement → SGLang ``--init-expert-location`` object ``{"physical_to_logical_map": [L][P]}``."""
    return {"physical_to_logical_map": placement.phy2log.tolist()}


def from_sglang(doc: object, num_gpus: int, num_nodes: int = 1, num_groups: int = 1) -> Placement:
    """SGLang ``--init-expert-location`` object → Placement (the file does not carry the gpu
    count, so the caller supplies it)."""
    field = "physical_to_logical_map"
    if not isinstance(doc, dict) or field not in doc:
        raise ValueError(f'field {field!r}: missing; expected {{"{field}": [layers][slots]}}')
    arr = _int_array(doc[field], field, 2, "[layers][slots]")
    if arr.min() < -1:
        raise ValueError(f"field {field!r}: expected expert ids >= 0 or -1 (empty slot), got {int(arr.min())}")
    return _placement(arr, _topology_for(arr, num_gpus, num_nodes, num_groups, field), field)


def to_vllm(placement: Placement) -> dict[str, np.ndarray]:
    """Placement → vLLM-shaped int64 arrays ``physical_to_logical [L, P]``,
    ``logical_to_physical [L, E, R]`` (-1 padded, each expert's slots ascending) and
    ``logical_replica_count [L, E]``."""
    return {
        "physical_to_logical": placement.phy2log.astype(np.int64),
        "logical_to_physical": placement.log2phy.astype(np.int64),
        "logical_replica_count": placement.logcnt.astype(np.int64),
    }


def from_vllm(arrays: dict[str, Any], num_gpus: int, num_nodes: int = 1, num_groups: int = 1) -> Placement:
    """vLLM-shaped arrays → Placement; the two redundant maps must agree with
    ``physical_to_logical`` (replicas may be listed in any order)."""
    for key in ("physical_to_logical", "logical_to_physical", "logical_replica_count"):
        if key not in arrays:
            raise ValueError(
                f"field {key!r}: missing; expected physical_to_logical [L, P], logical_to_physical [L, E, R], logical_replica_count [L, E]"
            )
    p2l = _int_array(arrays["physical_to_logical"], "physical_to_logical", 2, "[layers, slots]")
    if p2l.min() < -1:
        raise ValueError(
            f"field 'physical_to_logical': expected expert ids >= 0 or -1 (empty slot), got {int(p2l.min())}"
        )
    placement = _placement(
        p2l, _topology_for(p2l, num_gpus, num_nodes, num_groups, "physical_to_logical"), "physical_to_logical"
    )
    topo = placement.topology
    cnt = _int_array(arrays["logical_replica_count"], "logical_replica_count", 2, "[layers, experts]")
    if cnt.shape != placement.logcnt.shape or not np.array_equal(cnt, placement.logcnt):
        raise ValueError(
            f"field 'logical_replica_count': expected shape {list(placement.logcnt.shape)} equal to the replica counts in physical_to_logical"
        )
    l2p = _int_array(arrays["logical_to_physical"], "logical_to_physical", 3, "[layers, experts, max_replicas]")
    if l2p.shape[:2] != (topo.num_layers, topo.num_experts) or l2p.shape[2] < int(cnt.max()):
        raise ValueError(
            f"field 'logical_to_physical': expected shape [{topo.num_layers}, {topo.num_experts}, R >= {int(cnt.max())}], got {list(l2p.shape)}"
        )
    valid = l2p >= 0
    if (l2p >= topo.num_slots).any() or not np.array_equal(valid.sum(axis=2), cnt):
        raise ValueError(
            "field 'logical_to_physical': expected each expert's logical_replica_count slot ids in [0, num_slots), -1 padded"
        )
    layer, expert, _ = np.nonzero(valid)
    if not np.array_equal(p2l[layer, l2p[valid]], expert):
        # An empty slot (-1) fails here too: logical_to_physical may never point at one.
        raise ValueError("field 'logical_to_physical': lists a slot whose physical_to_logical entry is another expert")
    return placement


# The listing's first line names its format, not a placement version (which "v1" was read as);
# files written with the earlier "# eplb placement v1: ..." read the same.
_LISTING_HEADER = "# eplb placement listing, format 1:"
_HEADER = re.compile(
    r"# eplb placement (?:v1|listing, format 1): " + " ".join(rf"{n.removeprefix('num_')}=(\d+)" for n in _TOPO_FIELDS)
)
_LINE = re.compile(r"layer (\d+) gpu (\d+) node (\d+):([-\d ]*)(?:\|.*)?$")


def to_listing(placement: Placement, loads: np.ndarray | None = None) -> str:
    """Placement (+ optional ``loads [L, E]``) → one text line per (layer, gpu) with the
    experts in its slots (slot order, -1 for an empty slot) and, given loads, its tokens and
    share of the mean over live gpus (a down gpu's line says ``down``)."""
    topo = placement.topology
    head = " ".join(f"{n.removeprefix('num_')}={getattr(topo, n)}" for n in _TOPO_FIELDS)
    lines = [f"{_LISTING_HEADER} {head}", "# layer L gpu G node N: experts in slot order | tokens (x mean gpu load)"]
    on_gpu = placement.experts_on_gpu()
    load = gpu_loads(loads, placement) if loads is not None else None
    for layer in range(topo.num_layers):
        mean = np.nanmean(load[layer]) if load is not None else 0.0
        for gpu in range(topo.num_gpus):
            text = f"layer {layer} gpu {gpu} node {gpu // topo.gpus_per_node}: " + " ".join(
                map(str, on_gpu[layer, gpu])
            )
            if load is not None and np.isnan(load[layer, gpu]):
                text += " | down"
            elif load is not None:
                ratio = load[layer, gpu] / mean if mean > 0 else 1.0
                text += f" | {load[layer, gpu]:.1f} ({ratio:.3f}x)"
            lines.append(text)
    return "\n".join(lines) + "\n"


def from_listing(text: str) -> Placement:
    """The text of :func:`to_listing` → Placement."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    match = _HEADER.match(lines[0]) if lines else None
    if not match:
        raise ValueError(f"line 1: expected '{_LISTING_HEADER} layers=L experts=E slots=P gpus=G nodes=N groups=K'")
    topo = Topology(*map(int, match.groups()))
    # -2 marks a (layer, gpu) no line gave: -1 is an empty slot.
    phy2log = np.full((topo.num_layers, topo.num_gpus, topo.slots_per_gpu), -2, dtype=np.int64)
    for number, line in enumerate(lines, 1):
        if line.startswith("#"):
            continue
        m = _LINE.match(line)
        experts = m.group(4).split() if m else []
        if not m or len(experts) != topo.slots_per_gpu:
            raise ValueError(
                f"line {number}: expected 'layer L gpu G node N: ' and {topo.slots_per_gpu} expert ids, got {line!r}"
            )
        layer, gpu = int(m.group(1)), int(m.group(2))
        if layer >= topo.num_layers or gpu >= topo.num_gpus:
            raise ValueError(
                f"line {number}: layer {layer} gpu {gpu} out of range (layers={topo.num_layers}, gpus={topo.num_gpus})"
            )
        phy2log[layer, gpu] = list(map(int, experts))
    if (phy2log == -2).any():
        layer, gpu, _ = np.argwhere(phy2log == -2)[0]
        raise ValueError(f"expected a line for every (layer, gpu); layer {layer} gpu {gpu} is missing")
    return _placement(phy2log.reshape(topo.num_layers, topo.num_slots), topo, "experts")
