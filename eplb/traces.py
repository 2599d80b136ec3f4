"""Load traces: expert counts ``[T, L, E]`` from the engines' formats, and windows over time.

Pure converters: each takes what a file decoder produced (a dict from JSON, CSV rows, an
array) and returns a :class:`LoadTrace`; reading files is the caller's job
(``eplb_tools.io``). Errors are ``ValueError`` naming the field and what was expected; the
caller prefixes the file name.

Native trace (``to_native`` / ``from_native``), a JSON object::

    {"format": "eplb-trace", "version": 1,
     "num_layers": L, "num_experts": E, "num_steps": T,
     "counts": [[[...E...] ...L...] ...T...],      # [T][L][E] numbers >= 0
     "meta": {...}}                               # free-form: model, source, window, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "LoadTrace",
    "from_array",
    "from_native",
    "to_native",
    "from_counts_json",
    "from_csv_rows",
    "to_csv_rows",
    "from_sglang_dump",
    "from_vllm_window",
]

TRACE_FORMAT = "eplb-trace"
"""The ``format`` field of the native trace file."""
TRACE_VERSION = 1
"""The native trace file's format version."""


@dataclass(frozen=True, eq=False)
class LoadTrace:
    """``counts``: float64 ``[T, L, E]`` tokens per expert in each of ``T`` steps (windows).

    A trace without a time axis has ``T == 1``. ``meta`` is free-form (model, source, ...).
    """

    counts: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arr = _check_counts(self.counts, "counts", ndims=(3,))
        arr.setflags(write=False)
        object.__setattr__(self, "counts", arr)

    @property
    def num_steps(self) -> int:
        return self.counts.shape[0]

    @property
    def num_layers(self) -> int:
        return self.counts.shape[1]

    @property
    def num_experts(self) -> int:
        return self.counts.shape[2]

    def window(self, last: int | None = None, half_life: float | None = None) -> np.ndarray:
        """``[L, E]`` loads to plan on: the sum of the ``last`` steps (default all), or an
        exponentially decayed sum where a step ``half_life`` steps older weighs half as much.
        """
        if last is not None and half_life is not None:
            raise ValueError("choose one window: last (steps) or half_life (exponential decay), not both")
        if half_life is not None:
            if not half_life > 0:
                raise ValueError(f"half_life must be > 0 steps, got {half_life}")
            age = np.arange(self.num_steps - 1, -1, -1, dtype=np.float64)
            return np.tensordot(0.5 ** (age / half_life), self.counts, axes=1)
        if last is None:
            return self.counts.sum(axis=0)
        if not 1 <= last <= self.num_steps:
            raise ValueError(f"last must be between 1 and the trace's {self.num_steps} steps, got {last}")
        return self.counts[-last:].sum(axis=0)


def _check_counts(value: object, name: str, ndims: tuple[int, ...] = (2, 3)) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception:  # ragged nested lists
        arr = None
    if arr is None or arr.dtype == object:
        raise ValueError(
            f"field {name!r}: expected a rectangular numeric array of {' or '.join(f'{d}-d' for d in ndims)}, got ragged or non-numeric data"
        )
    if arr.dtype == bool or arr.dtype.kind not in "iuf":
        raise ValueError(f"field {name!r}: expected numbers, got dtype {arr.dtype}")
    if arr.ndim not in ndims:
        want = " or ".join({2: "[layers, experts]", 3: "[steps, layers, experts]"}[d] for d in ndims)
        raise ValueError(f"field {name!r}: expected shape {want}, got {list(arr.shape)}")
    if 0 in arr.shape:
        raise ValueError(f"field {name!r}: expected a non-empty array, got shape {list(arr.shape)}")
    out = arr.astype(np.float64)
    bad = ~np.isfinite(out) | (out < 0)
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"field {name!r}: expected finite counts >= 0, got {out[idx]} at index {list(idx)}")
    return out


def from_array(value: object, name: str = "counts", meta: dict[str, Any] | None = None) -> LoadTrace:
    """``value``: ``[L, E]`` or ``[T, L, E]`` counts → trace (``[L, E]`` gets ``T = 1``)."""
    arr = _check_counts(value, name)
    return LoadTrace(arr[None] if arr.ndim == 2 else arr, dict(meta or {}))


def from_native(doc: object) -> LoadTrace:
    """The native JSON object (module docstring) → trace; checks the declared sizes."""
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object with fields format, version, counts; got {type(doc).__name__}")
    if doc.get("format") != TRACE_FORMAT:
        raise ValueError(f"field 'format': expected {TRACE_FORMAT!r}, got {doc.get('format')!r}")
    if doc.get("version") != TRACE_VERSION:
        raise ValueError(f"field 'version': expected {TRACE_VERSION}, got {doc.get('version')!r}")
    if "counts" not in doc:
        raise ValueError("field 'counts': missing; expected [steps][layers][experts] numbers")
    trace = from_array(doc["counts"], "counts", doc.get("meta") or {})
    if not isinstance(trace.meta, dict):
        raise ValueError(f"field 'meta': expected an object, got {type(doc.get('meta')).__name__}")
    declared = {"num_steps": trace.num_steps, "num_layers": trace.num_layers, "num_experts": trace.num_experts}
    for key, actual in declared.items():
        if key in doc and doc[key] != actual:
            raise ValueError(f"field {key!r}: declares {doc[key]!r} but 'counts' has {actual}")
    return trace


def to_native(trace: LoadTrace) -> dict[str, Any]:
    """Trace → the native JSON object; integral counts are written as ints."""
    counts = trace.counts
    values = counts.astype(np.int64).tolist() if np.array_equal(counts, np.round(counts)) else counts.tolist()
    return {
        "format": TRACE_FORMAT,
        "version": TRACE_VERSION,
        "num_steps": trace.num_steps,
        "num_layers": trace.num_layers,
        "num_experts": trace.num_experts,
        "counts": values,
        "meta": dict(trace.meta),
    }


def from_counts_json(doc: object) -> LoadTrace:
    """``{"counts": [layer][expert]}`` (or ``[step][layer][expert]``), what SGLang's expert
    distribution dumps give once converted; a ``logical_count`` field is accepted too."""
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object with a 'counts' field, got {type(doc).__name__}")
    for key in ("counts", "logical_count"):
        if key in doc:
            meta = {k: v for k, v in doc.items() if k != key and isinstance(v, (str, int, float, bool))}
            return from_array(doc[key], key, meta)
    raise ValueError(
        f"field 'counts': missing; expected counts[layer][expert] (fields present: {', '.join(sorted(doc)) or 'none'})"
    )


def _duplicates(idx: dict[str, np.ndarray], steps: bool) -> dict[str, Any]:
    """``{"duplicate_rows": what}`` when rows of a long CSV repeat a (step, layer, expert): their
    counts are summed (a log of several passes may mean that), but a caller should say so."""
    keys = np.stack([idx["step"], idx["layer"], idx["expert"]], axis=1)
    _, first, seen = np.unique(keys, axis=0, return_index=True, return_counts=True)
    extra = int((seen - 1).sum())
    if not extra:
        return {}
    repeated = np.ones(len(keys), dtype=bool)
    repeated[first] = False
    row = int(np.argmax(repeated))
    original = int(np.flatnonzero((keys == keys[row]).all(axis=1))[0])
    step, layer, expert = (int(v) for v in keys[row])
    where = f"{'step ' + str(step) + ', ' if steps else ''}layer {layer}, expert {expert}"
    return {
        "duplicate_rows": f"{extra} row{'s repeat' if extra > 1 else ' repeats'} an earlier ({'step, ' if steps else ''}layer, "
        f"expert) and {'were' if extra > 1 else 'was'} summed with it; the first: line {row + 2} repeats line "
        f"{original + 2} ({where})"
    }


def from_csv_rows(rows: list[list[str]]) -> LoadTrace:
    """CSV rows → trace. Two layouts:

    - long, with a header ``layer,expert,count`` (optionally ``step`` first): one row per
      (step, layer, expert); missing pairs are 0 and the sizes are the largest indices + 1
      (so list trailing experts with a 0 count); rows repeating a (step, layer, expert) are
      summed, and ``meta["duplicate_rows"]`` says how many and where the first is;
    - wide, no header: one row per layer, one column per expert (``[L, E]``).
    """
    rows = [r for r in rows if r and any(c.strip() for c in r)]
    if not rows:
        raise ValueError("expected a header 'layer,expert,count' or rows of numbers, got an empty table")
    header = [c.strip().lower() for c in rows[0]]
    if "count" in header or "layer" in header:
        need = {"layer", "expert", "count"}
        if not need <= set(header):
            raise ValueError(
                f"header: expected columns layer, expert, count (and optionally step), got {', '.join(header)}"
            )
        cols = {name: header.index(name) for name in need | ({"step"} & set(header))}
        body = rows[1:]
        if not body:
            raise ValueError("expected at least one data row after the header")
        data = {}
        for name, col in cols.items():
            try:
                data[name] = np.array([float(r[col]) for r in body])
            except (ValueError, IndexError):
                line = next(i for i, r in enumerate(body, 2) if len(r) <= col or not _is_number(r[col]))
                raise ValueError(f"line {line}, column {name!r}: expected a number") from None
        data.setdefault("step", np.zeros(len(body)))
        for k in ("step", "layer", "expert"):
            bad = (data[k] < 0) | (data[k] != np.round(data[k]))
            if bad.any():
                raise ValueError(
                    f"line {int(np.argmax(bad)) + 2}, column {k!r}: expected an integer index >= 0, got {data[k][bad][0]}"
                )
        idx = {k: data[k].astype(np.int64) for k in ("step", "layer", "expert")}
        counts = np.zeros((idx["step"].max() + 1, idx["layer"].max() + 1, idx["expert"].max() + 1))
        np.add.at(counts, (idx["step"], idx["layer"], idx["expert"]), data["count"])
        return from_array(counts, "count", _duplicates(idx, "step" in cols))
    widths = [len(r) for r in rows]
    if len(set(widths)) != 1:
        line = next(i for i, w in enumerate(widths, 1) if w != widths[0])
        raise ValueError(
            f"line {line}: expected {widths[0]} columns like line 1 (wide layout: one row per layer, one column per expert), got {widths[line - 1]}"
        )
    for line, r in enumerate(rows, 1):
        if not all(_is_number(c) for c in r):
            raise ValueError(f"line {line}: expected numbers only (wide layout) or a header layer,expert,count")
    table = np.array([[float(c) for c in r] for r in rows])
    return from_array(table, "rows")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def to_csv_rows(trace: LoadTrace) -> list[list[str]]:
    """Trace → long-layout rows ``step,layer,expert,count`` (header first)."""
    t, layer, e = np.indices(trace.counts.shape).reshape(3, -1)
    vals = trace.counts.ravel()
    fmt = (lambda v: str(int(v))) if np.array_equal(vals, np.round(vals)) else repr
    return [["step", "layer", "expert", "count"]] + [
        [str(a), str(b), str(c), fmt(float(v))] for a, b, c, v in zip(t, layer, e, vals)
    ]


def from_sglang_dump(doc: object) -> LoadTrace:
    """An SGLang expert-distribution recorder dump (``.pt`` loaded and tensors turned into
    numpy by the caller): a dict with ``logical_count`` ``[T, L, E]`` or ``[L, E]``."""
    if not isinstance(doc, dict):
        raise ValueError(f"expected a dict with a 'logical_count' field, got {type(doc).__name__}")
    if "logical_count" not in doc:
        raise ValueError(
            f"field 'logical_count': missing; expected a [steps, layers, experts] tensor (fields present: {', '.join(map(str, sorted(doc)))})"
        )
    meta = {k: v for k, v in doc.items() if isinstance(v, (str, int, float, bool))}
    return from_array(doc["logical_count"], "logical_count", meta | {"source": "sglang"})


def from_vllm_window(window: object, phy2log: object) -> LoadTrace:
    """vLLM-shaped physical counts ``window: [W, L, P]`` (or ``[L, P]``) and the
    ``physical_to_logical`` map ``[L, P]`` they were recorded under → trace ``[W, L, E]``
    (each expert's count is the sum over its replicas; ``E = max(phy2log) + 1``)."""
    win = _check_counts(window, "window")
    if win.ndim == 2:
        win = win[None]
    p2l = np.asarray(phy2log)
    if p2l.dtype.kind not in "iu" or p2l.ndim != 2:
        raise ValueError(
            f"field 'physical_to_logical': expected an integer [layers, slots] array, got dtype {p2l.dtype} shape {list(p2l.shape)}"
        )
    if p2l.shape != win.shape[1:]:
        raise ValueError(
            f"field 'physical_to_logical': expected shape [layers, slots] = {list(win.shape[1:])} to match 'window', got {list(p2l.shape)}"
        )
    if p2l.min() < 0:
        raise ValueError(f"field 'physical_to_logical': expected expert ids >= 0, got {int(p2l.min())}")
    W, L, _ = win.shape
    E = int(p2l.max()) + 1
    out = np.zeros((W, L, E))
    layer = np.broadcast_to(np.arange(L)[:, None], p2l.shape)
    for_all = np.broadcast_to(np.arange(W)[:, None, None], win.shape)
    np.add.at(out, (for_all, np.broadcast_to(layer, win.shape), np.broadcast_to(p2l, win.shape)), win)
    return LoadTrace(out, {"source": "vllm"})
