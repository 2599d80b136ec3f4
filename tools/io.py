"""File I/O at the edge: load traces, placements and topology configs on disk.

Formats are chosen by ``fmt`` or by the file suffix; the decoding itself lives in the pure
converters ``eplb.traces`` and ``eplb.formats``. Every error is a ``ValueError`` that starts
with the file name, then names the field and what was expected.
"""

from __future__ import annotations

import csv
import io
import json
import pickle
import tomllib
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from eplb import formats, traces
from eplb.placement import Placement
from eplb.topology import Topology

__all__ = [
    "PLACEMENT_FORMATS",
    "PLACEMENT_SUFFIXES",
    "TRACE_FORMATS",
    "placement_format_of",
    "placement_output_format",
    "placement_text",
    "read_phy2log",
    "read_placement",
    "read_topology",
    "read_trace",
    "trace_format_of",
    "write_placement",
    "write_trace",
]

TRACE_FORMATS = ("native", "json", "npy", "npz", "csv", "sglang-pt", "vllm")
# vLLM's own names first-class: EplbState.expert_load_window and physical_to_logical_map.
_WINDOW_KEYS = ("window", "expert_load_window")
_MAP_KEYS = ("physical_to_logical", "physical_to_logical_map")
PLACEMENT_FORMATS = ("native", "sglang", "vllm", "listing")
# The suffix a placement file of each format has, so that reading it back by suffix works.
PLACEMENT_SUFFIXES = {"native": ".json", "sglang": ".json", "vllm": ".npz", "listing": ".txt"}

T = TypeVar("T")


def _in_file(path: Path, fn: Callable[[], T]) -> T:
    """Run a converter and prefix its error with the file it was reading."""
    try:
        return fn()
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError as exc:
        # Say what the file is when it is one of the binary kinds eplb reads (a .npy given as
        # --trace-format csv), else where the text breaks.
        kind = _kind_of(path)
        why = f"it is {kind}" if kind else f"byte {exc.start}: {exc.reason}"
        raise ValueError(f"{path}: not a UTF-8 text file ({why})") from None


def _read_json(path: Path) -> object:
    text = _read_text(path)
    if not text.strip():
        raise ValueError(f"{path}: the file is empty; expected a JSON object")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None


def _empty(path: Path, what: str) -> None:
    # numpy reports an empty or cut-short file as EOFError, with no file name.
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: the file is empty; expected {what}")


_NPY_MAGIC, _ZIP_MAGIC = b"\x93NUMPY", b"PK\x03\x04"
# A zip archive with no members (np.savez of no arrays) is its end record alone.
_EMPTY_ZIP_MAGIC = b"PK\x05\x06"


_NPZ, _TORCH, _BAD_ZIP = "an .npz archive", "a torch.save file", "a damaged or cut-short zip archive"


def _kind_of(path: Path) -> str:
    """What ``path`` is by its first bytes (``"an .npz archive"``, ``"a Python pickle"``, ...),
    for an error about reading it as something else; ``""`` when none of the kinds known here."""
    with path.open("rb") as f:
        head = f.read(8)
    if head.startswith(_NPY_MAGIC):
        return "a .npy array"
    if head.startswith((_ZIP_MAGIC, _EMPTY_ZIP_MAGIC)):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except (OSError, zipfile.BadZipFile):
            return _BAD_ZIP
        if any(n.endswith("/data.pkl") for n in names):
            return _TORCH
        # np.savez writes name.npy entries at the top level (none at all for no arrays).
        return _NPZ if all(n.endswith(".npy") and "/" not in n for n in names) else "a zip archive"
    if head[:1] == b"\x80":
        return "a Python pickle"
    if head.lstrip()[:1] in (b"{", b"["):
        return "JSON text"
    return ""


def _not(path: Path, what: str, kind: str, otherwise: str) -> ValueError:
    return ValueError(f"{path}: not {what} (it is {kind})" if kind else f"{path}: not {what} ({otherwise})")


# numpy's advice for an object array (load it unsafely with allow_pickle=) is not for a load
# trace: eplb reads numbers only, and unpickling a file can run code.
_OBJECTS = "it holds Python objects (a pickled object array), not numbers"


def _read_npy(path: Path) -> np.ndarray:
    _empty(path, "a .npy array")
    kind = _kind_of(path)
    if kind != "a .npy array":
        # np.load would read an .npz (or a torch.save zip) as an archive, a pickle with advice.
        raise _not(path, "a .npy array", kind, "no .npy header")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        why = _OBJECTS if "allow_pickle" in str(exc) else (str(exc) or "cut short")
        raise ValueError(f"{path}: not a readable .npy array ({why})") from None


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    _empty(path, "a .npz archive")
    kind = _kind_of(path)
    if kind not in (_NPZ, _BAD_ZIP):  # a damaged one: numpy's own error says more
        raise _not(path, "an .npz archive", kind, "not a zip archive")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        why = _OBJECTS if "allow_pickle" in str(exc) else (str(exc) or "cut short")
        raise ValueError(f"{path}: not a readable .npz archive ({why})") from None


def trace_format_of(path: Path, fmt: str | None = None) -> str:
    """The trace format to read ``path`` with: ``fmt`` if given, else from the suffix
    (``.json`` is sniffed: native when its ``format`` is ``eplb-trace``; ``.npz`` holding a
    ``window`` is vLLM-shaped)."""
    if fmt is not None:
        if fmt not in TRACE_FORMATS:
            raise ValueError(f"trace format {fmt!r} is unknown; allowed: {', '.join(TRACE_FORMATS)}")
        return fmt
    suffix = path.suffix.lower()
    if suffix == ".json":
        doc = _read_json(path)
        return "native" if isinstance(doc, dict) and doc.get("format") == traces.TRACE_FORMAT else "json"
    if suffix == ".npz":
        return "vllm" if set(_read_npz(path)) & set(_WINDOW_KEYS) else "npz"
    by_suffix = {".npy": "npy", ".csv": "csv", ".pt": "sglang-pt"}
    if suffix not in by_suffix:
        raise ValueError(
            f"{path}: cannot tell the trace format from suffix {suffix!r}; use one of .json .npy .npz .csv .pt or pass a format ({', '.join(TRACE_FORMATS)})"
        )
    return by_suffix[suffix]


def _load_torch(path: Path) -> object:
    try:
        import torch  # optional extra: only SGLang .pt dumps need it
    except ImportError:
        raise ValueError(
            f"{path}: reading SGLang .pt dumps needs torch; install it with `pip install 'eplb[torch]'` or convert the dump to .npz"
        ) from None
    _empty(path, "an SGLang expert-distribution dump saved by torch.save")
    kind = _kind_of(path)
    if kind and kind not in (_TORCH, _BAD_ZIP, "a Python pickle"):  # torch's legacy format is a pickle
        raise _not(path, "an SGLang expert-distribution dump saved by torch.save", kind, "")
    if not kind:
        # Neither torch.save's zip nor its legacy pickle: torch's weights-only loader would call
        # whatever the bytes are "Python objects besides tensors".
        raise ValueError(
            f"{path}: not an SGLang expert-distribution dump saved by torch.save (it starts with neither a zip "
            "nor a pickle header: damaged, or another kind of file)"
        )
    try:
        with warnings.catch_warnings():
            # torch warns about the pickle protocol of files it then refuses anyway.
            warnings.simplefilter("ignore")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError) as exc:
        # Never torch's advice to re-run with weights_only=False: that unpickles anything (runs
        # code), and an expert-distribution dump holds only tensors and plain containers.
        text = str(exc)
        if "Unsupported operand" in text:  # bytes that are no pickle opcode: not objects, damage
            why = "its pickle is damaged (an invalid opcode)"
        elif "weights_only" in text or "Weights only" in text:
            why = "it holds Python objects besides tensors, numbers and containers, which eplb does not unpickle"
        else:
            why = (text.splitlines() or ["cut short"])[0]
        raise ValueError(f"{path}: not a readable SGLang expert-distribution dump ({why})") from None
    if isinstance(obj, dict):
        return {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in obj.items()}
    return obj


_PLACEMENT_NOT_TRACE = (
    "this is a placement (it maps slots to experts), not a load trace (counts per expert); "
    "give it as --previous PLACEMENT, and a trace of loads as TRACE"
)


def read_trace(path: str | Path, fmt: str | None = None, phy2log: np.ndarray | None = None) -> traces.LoadTrace:
    """Read a load trace. ``phy2log [L, P]`` (``--recorded-under``) maps a vLLM window without
    its own ``physical_to_logical`` array. It is refused where it cannot apply (a trace of
    logical counts) and where the archive's own map says otherwise: the archive records what
    the window was recorded under, and silently preferring either would plan on wrong counts."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: is a directory; give a trace file in it")
    if not path.is_file():
        raise ValueError(f"{path}: no such trace file")
    kind = trace_format_of(path, fmt)
    if phy2log is not None and kind != "vllm":
        raise ValueError(
            f"{path}: --recorded-under maps a vLLM window of physical counts (.npz with window or "
            f"expert_load_window); this is a {kind} trace of logical (per-expert) counts: drop --recorded-under"
        )
    if kind in ("native", "json"):
        doc = _read_json(path)
        if isinstance(doc, dict) and not {"counts", "logical_count"} & set(doc) and {"phy2log", *_MAP_KEYS} & set(doc):
            raise ValueError(f"{path}: {_PLACEMENT_NOT_TRACE}")
        if kind == "native":
            return _in_file(path, lambda: traces.from_native(doc))
        return _in_file(path, lambda: traces.from_counts_json(doc))
    if kind == "npy":
        arr = _read_npy(path)
        return _in_file(path, lambda: traces.from_array(arr, "array"))
    if kind == "csv":
        rows = list(csv.reader(io.StringIO(_read_text(path))))
        return _in_file(path, lambda: traces.from_csv_rows(rows))
    if kind == "sglang-pt":
        obj = _load_torch(path)
        return _in_file(path, lambda: traces.from_sglang_dump(obj))
    arrays = _read_npz(path)
    if kind == "vllm":
        window = next((arrays[k] for k in _WINDOW_KEYS if k in arrays), None)
        if window is None:
            raise ValueError(
                f"{path}: field 'window': missing; expected [W, layers, slots] physical counts named window or expert_load_window"
            )
        own = next((arrays[k] for k in _MAP_KEYS if k in arrays), None)
        if own is not None and phy2log is not None and not np.array_equal(own, phy2log):
            raise ValueError(
                f"{path}: the archive has its own physical_to_logical {list(np.shape(own))}, which differs from "
                f"--recorded-under {list(np.shape(phy2log))}; the archive's is the one its window was recorded "
                "under: drop --recorded-under"
            )
        p2l = own if own is not None else phy2log
        if p2l is None:
            raise ValueError(
                f"{path}: field 'physical_to_logical': missing; store it in the archive or pass the placement the window was recorded under (--recorded-under)"
            )
        return _in_file(path, lambda: traces.from_vllm_window(window, p2l))
    for key in ("counts", "logical_count"):
        if key in arrays:
            return _in_file(path, lambda key=key: traces.from_array(arrays[key], key))
    if set(_MAP_KEYS) & set(arrays):
        raise ValueError(f"{path}: {_PLACEMENT_NOT_TRACE}")
    raise ValueError(
        f"{path}: field 'counts': missing; expected an array named counts or logical_count (archive has: {', '.join(arrays) or 'nothing'})"
    )


def write_trace(path: str | Path, trace: traces.LoadTrace, fmt: str = "native") -> None:
    """Write ``trace`` as native JSON, counts JSON, .npy, .npz (``counts``) or long CSV."""
    path = Path(path)
    if fmt == "native":
        path.write_text(json.dumps(traces.to_native(trace)))
    elif fmt == "json":
        path.write_text(json.dumps({"counts": traces.to_native(trace)["counts"]}))
    elif fmt == "npy":
        with path.open("wb") as f:
            np.save(f, trace.counts)
    elif fmt == "npz":
        with path.open("wb") as f:
            np.savez(f, counts=trace.counts)
    elif fmt == "csv":
        with path.open("w", newline="") as f:
            csv.writer(f).writerows(traces.to_csv_rows(trace))
    else:
        raise ValueError(f"cannot write traces as {fmt!r}; allowed: native, json, npy, npz, csv")


def placement_format_of(path: Path, fmt: str | None = None) -> str:
    """``fmt`` if given, else by suffix: ``.npz`` vllm, ``.txt`` listing, ``.json`` native or
    sglang (sniffed when reading; native when writing)."""
    if fmt is not None:
        if fmt not in PLACEMENT_FORMATS:
            raise ValueError(f"placement format {fmt!r} is unknown; allowed: {', '.join(PLACEMENT_FORMATS)}")
        return fmt
    suffix = path.suffix.lower()
    if suffix == ".json":
        if path.is_file():
            doc = _read_json(path)
            if isinstance(doc, dict) and "physical_to_logical_map" in doc:
                return "sglang"
        return "native"
    by_suffix = {".npz": "vllm", ".txt": "listing"}
    if suffix not in by_suffix:
        raise ValueError(
            f"{path}: cannot tell the placement format from suffix {suffix!r}; use .json .npz .txt or pass a format ({', '.join(PLACEMENT_FORMATS)})"
        )
    return by_suffix[suffix]


def placement_output_format(path: str | Path, fmt: str | None = None) -> str:
    """The format to write ``path`` in: ``fmt`` if given, else by suffix (``.json`` native).
    Raises ``ValueError`` when ``fmt`` and the suffix disagree (a vLLM ``.npz`` archive in a
    ``.json``), naming the suffix that fits."""
    path = Path(path)
    if fmt is None:
        return "native" if path.suffix.lower() == ".json" else placement_format_of(path)
    kind = placement_format_of(path, fmt)
    want = PLACEMENT_SUFFIXES[kind]
    if path.suffix.lower() != want:
        others = ", ".join(f"{s} {k}" for k, s in PLACEMENT_SUFFIXES.items() if s == path.suffix.lower())
        raise ValueError(
            f"{path}: a {kind} placement is written as a {want} file, not {path.suffix or 'a file without a suffix'}; "
            f"name it {path.with_suffix(want).name}"
            + (f" or choose a {path.suffix} format ({others})" if others else "")
        )
    return kind


def write_placement(
    path: str | Path,
    placement: Placement,
    fmt: str | None = None,
    stats: dict | None = None,
    loads: np.ndarray | None = None,
) -> str:
    """Write ``placement``; returns the format used. ``stats`` go into native files,
    ``loads [L, E]`` into the listing's per-gpu tokens."""
    path = Path(path)
    kind = placement_output_format(path, fmt)
    if kind == "vllm":
        with path.open("wb") as f:
            np.savez(f, **formats.to_vllm(placement))
    else:
        path.write_text(placement_text(placement, kind, stats, loads))
    return kind


def placement_text(placement: Placement, fmt: str, stats: dict | None = None, loads: np.ndarray | None = None) -> str:
    """``placement`` in a text format (native, sglang, listing), e.g. for stdout; ``stats`` go
    into native files, ``loads [L, E]`` into the listing's per-gpu tokens."""
    if fmt == "native":
        return json.dumps(formats.to_native(placement, stats)) + "\n"
    if fmt == "sglang":
        return json.dumps(formats.to_sglang(placement)) + "\n"
    if fmt == "listing":
        return formats.to_listing(placement, loads)
    raise ValueError(f"{fmt} placements are not text (vllm: an .npz archive); text formats: native, sglang, listing")


def read_placement(
    path: str | Path, fmt: str | None = None, num_gpus: int | None = None, num_nodes: int = 1, num_groups: int = 1
) -> Placement:
    """Read a placement. SGLang and vLLM files do not carry the gpu count: pass ``num_gpus``."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such placement file")
    kind = placement_format_of(path, fmt)
    if kind in ("sglang", "vllm") and num_gpus is None:
        raise ValueError(f"{path}: {kind} placements do not record the gpu count; pass num_gpus (--gpus)")
    if kind == "native":
        doc = _read_json(path)
        return _in_file(path, lambda: formats.from_native(doc))
    if kind == "sglang":
        doc = _read_json(path)
        return _in_file(path, lambda: formats.from_sglang(doc, num_gpus, num_nodes, num_groups))
    if kind == "vllm":
        arrays = _read_npz(path)
        return _in_file(path, lambda: formats.from_vllm(arrays, num_gpus, num_nodes, num_groups))
    text = _read_text(path)
    return _in_file(path, lambda: formats.from_listing(text))


def read_phy2log(path: str | Path) -> np.ndarray:
    """``[L, P]`` expert of each slot from a placement file in any format, or a bare ``.npy``
    (the gpu count does not matter for the map, so engine formats are read with one gpu)."""
    path = Path(path)
    if path.suffix.lower() == ".npy":
        if not path.is_file():
            raise ValueError(f"{path}: no such placement file")
        return _read_npy(path)
    return read_placement(path, num_gpus=1).phy2log


def read_topology(path: str | Path) -> Topology:
    """A small topology config, JSON or TOML: ``layers, experts, slots, gpus[, nodes, groups]``
    (``num_*`` spellings too), at the top level or under a ``topology`` table."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such topology config")
    if path.suffix.lower() == ".toml":
        try:
            doc = tomllib.loads(_read_text(path))
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: not valid TOML ({exc})") from None
    else:
        doc = _read_json(path)
    if isinstance(doc, dict) and "topology" in doc:
        doc = doc["topology"]
    return _in_file(path, lambda: formats.topology_from_dict(doc))
