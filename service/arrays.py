"""``Array`` messages ↔ numpy: explicit dtype, shape and little-endian bytes, checked."""

from __future__ import annotations

import numpy as np

from ._gen.eplb.v1 import balancer_pb2 as pb
from .errors import FieldViolation, InvalidArgument

__all__ = ["encode", "decode", "decode_counts"]

_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
}
_CODES = {dt: code for code, dt in _DTYPES.items()}


def encode(arr: np.ndarray) -> pb.Array:
    """Any int32/int64/float32/float64 array → ``Array`` (little-endian, row-major)."""
    arr = np.asarray(arr)
    dt = arr.dtype.newbyteorder("<")
    if dt not in _CODES:
        raise ValueError(f"cannot encode dtype {arr.dtype}; allowed: int32, int64, float32, float64")
    return pb.Array(dtype=_CODES[dt], shape=list(arr.shape), data=np.ascontiguousarray(arr, dtype=dt).tobytes())


def decode(msg: pb.Array, field: str, shape: tuple[int, ...], kinds: str = "iuf") -> np.ndarray:
    """``Array`` → a read-only numpy view of ``shape``; raises ``InvalidArgument`` naming ``field``."""
    if msg.dtype not in _DTYPES:
        allowed = ", ".join(pb.Dtype.Name(c) for c in _DTYPES)
        raise InvalidArgument(FieldViolation(f"{field}.dtype", f"dtype {msg.dtype} is not one of {allowed}"))
    dt = _DTYPES[msg.dtype]
    if dt.kind not in kinds:
        raise InvalidArgument(
            FieldViolation(f"{field}.dtype", f"{pb.Dtype.Name(msg.dtype)} is not allowed here; use an integer dtype")
        )
    if tuple(msg.shape) != shape:
        raise InvalidArgument(FieldViolation(f"{field}.shape", f"shape is {list(msg.shape)}; expected {list(shape)}"))
    want = int(np.prod(shape)) * dt.itemsize
    if len(msg.data) != want:
        raise InvalidArgument(
            FieldViolation(
                f"{field}.data", f"holds {len(msg.data)} bytes; shape {list(shape)} of {dt.name} needs {want}"
            )
        )
    return np.frombuffer(msg.data, dtype=dt).reshape(shape)


def decode_counts(msg: pb.Array, field: str, shape: tuple[int, ...], cap: float | None = None) -> np.ndarray:
    """Load counters ``shape`` → float64, rejecting NaN, infinities, negatives and (with ``cap``)
    any count above ``cap``."""
    arr = decode(msg, field, shape)
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InvalidArgument(FieldViolation(f"{field}.data", "counts must be finite (found NaN or infinity)"))
    if arr.size and arr.min() < 0:
        raise InvalidArgument(FieldViolation(f"{field}.data", f"counts must be >= 0 (found {arr.min()})"))
    if cap is not None and arr.size and arr.max() > cap:
        raise InvalidArgument(
            FieldViolation(
                f"{field}.data", f"a count of {arr.max():g} is over the per-report cap of {cap:g} tokens per entry"
            )
        )
    return arr.astype(np.float64)
