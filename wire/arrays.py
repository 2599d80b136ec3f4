"""``Array`` messages ↔ numpy: explicit dtype, shape and little-endian bytes, checked.

The one codec of both sides. Errors are :class:`ArrayError` (a ``WireError``, a ``ValueError``)
naming the field path (``loads.shape``, ``phy2log.data``, …) and the rule; the service maps it to
``INVALID_ARGUMENT`` with that field violation, the engine side lets it through as a ``ValueError``.
"""

from __future__ import annotations

import math

import numpy as np

from ._gen.eplb.v1 import balancer_pb2 as pb
from .errors import WireError

__all__ = ["ArrayError", "encode", "decode", "decode_counts"]

# Largest value of the signed integer dtypes by item size (np.iinfo costs microseconds a call).
_INT_MAX = {4: 2**31 - 1, 8: 2**63 - 1}

_DTYPES: dict[pb.Dtype, np.dtype] = {
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
}
_CODES = {dt: code for code, dt in _DTYPES.items()}


class ArrayError(WireError):
    """A bad ``Array``: ``field`` is its path in the message (e.g. ``logical.shape``),
    ``description`` what is wrong and what is allowed."""


def encode(arr: np.ndarray, *, widen: bool = False) -> pb.Array:
    """Any-shape int32/int64/float32/float64 array → ``Array`` (little-endian, row-major).

    Other dtypes raise ``ValueError``, unless ``widen``: then other integer dtypes (uint8,
    int16, ...) go as int64 and other floats (float16, bfloat16 cast by the caller) as float32,
    since the wire has only these four; booleans are refused either way.
    """
    arr = np.asarray(arr)
    if arr.dtype.kind == "b":
        raise ValueError("cannot encode a boolean array; allowed: integer or floating dtypes")
    dt = arr.dtype.newbyteorder("<")
    if dt not in _CODES:
        if widen and arr.dtype.kind in "iu":
            dt = np.dtype("<i8")
        elif widen and arr.dtype.kind == "f":
            dt = np.dtype("<f4")
        elif widen:
            raise ValueError(f"cannot encode dtype {arr.dtype}; allowed: integer or floating dtypes")
        else:
            raise ValueError(f"cannot encode dtype {arr.dtype}; allowed: int32, int64, float32, float64")
    return pb.Array(dtype=_CODES[dt], shape=list(arr.shape), data=np.ascontiguousarray(arr, dtype=dt).tobytes())


def decode(msg: pb.Array, field: str = "array", shape: tuple[int, ...] | None = None, kinds: str = "iuf") -> np.ndarray:
    """``Array`` → a read-only numpy view of ``shape`` (None: of the shape it says it has);
    ``kinds``: the numpy dtype kinds allowed. Raises :class:`ArrayError` naming ``field``."""
    if msg.dtype not in _DTYPES:
        allowed = ", ".join(pb.Dtype.Name(c) for c in _DTYPES)
        raise ArrayError(f"{field}.dtype", f"dtype {msg.dtype} is not one of {allowed}")
    dt = _DTYPES[msg.dtype]
    if dt.kind not in kinds:
        raise ArrayError(f"{field}.dtype", f"{pb.Dtype.Name(msg.dtype)} is not allowed here; use an integer dtype")
    if shape is None:
        shape = tuple(int(n) for n in msg.shape)
    elif tuple(msg.shape) != shape:
        raise ArrayError(f"{field}.shape", f"shape is {list(msg.shape)}; expected {list(shape)}")
    # Python ints: a shape of large dims neither overflows nor under-counts.
    want = math.prod(int(n) for n in shape) * dt.itemsize
    data = msg.data  # once: each read of a bytes field copies it
    if len(data) != want:
        raise ArrayError(f"{field}.data", f"holds {len(data)} bytes; shape {list(shape)} of {dt.name} needs {want}")
    return np.frombuffer(data, dtype=dt).reshape(shape)


def decode_counts(
    msg: pb.Array, field: str, shape: tuple[int, ...], cap: float | None = None, native: bool = False
) -> np.ndarray:
    """Load counters ``shape`` → float64 (``native``: a read-only view in the dtype they came
    in, so that int32 counts stay int32 without a pass), rejecting NaN, infinities, negatives
    and (with ``cap``) any count above ``cap``."""
    arr = decode(msg, field, shape)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ArrayError(f"{field}.data", "counts must be finite (found NaN or infinity)")
    if arr.size and arr.min() < 0:
        raise ArrayError(f"{field}.data", f"counts must be >= 0 (found {arr.min()})")
    # An integer dtype whose largest value is within the cap cannot exceed it: no pass needed.
    if (
        cap is not None
        and arr.size
        and not (arr.dtype.kind in "iu" and _INT_MAX[arr.dtype.itemsize] <= cap)
        and arr.max() > cap
    ):
        raise ArrayError(
            f"{field}.data", f"a count of {arr.max():g} is over the per-report cap of {cap:g} tokens per entry"
        )
    return arr if native else arr.astype(np.float64)
