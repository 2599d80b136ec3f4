"""The service's face of :mod:`eplb_wire.arrays` (the one ``Array`` codec, shared with the engine):
the same functions, with a bad array raised as ``InvalidArgument`` carrying its field violation
(``logical.shape``, ``phy2log.data``, …), which the service's handlers extend (a report stream
adds how many of its reports were kept) and count (rejected reports by reason). Encoding has no
service face: ``eplb_wire.arrays.encode``.
"""

from __future__ import annotations

import numpy as np

from eplb_wire import arrays as _wire
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import ArrayError

from .errors import FieldViolation, InvalidArgument

__all__ = ["decode", "decode_counts"]


def decode(msg: pb.Array, field: str, shape: tuple[int, ...], kinds: str = "iuf") -> np.ndarray:
    """:func:`eplb_wire.arrays.decode`; ``InvalidArgument`` naming ``field`` (``field.dtype`` …)."""
    try:
        return _wire.decode(msg, field, shape, kinds)
    except ArrayError as exc:
        raise InvalidArgument(FieldViolation(exc.field, exc.description)) from None


def decode_counts(
    msg: pb.Array, field: str, shape: tuple[int, ...], cap: float | None = None, native: bool = False
) -> np.ndarray:
    """:func:`eplb_wire.arrays.decode_counts`; ``InvalidArgument`` naming ``field``."""
    try:
        return _wire.decode_counts(msg, field, shape, cap, native)
    except ArrayError as exc:
        raise InvalidArgument(FieldViolation(exc.field, exc.description)) from None
