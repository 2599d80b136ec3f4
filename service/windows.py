"""Load windows: ``[L, E]`` token counts a re-plan sees, kept in memory per instance.

Each instance sums the reports it receives into a window in memory and periodically flushes
one blob per deployment to the store (``Store.put_window``); the planner sums every
instance's blob. A batch of reports is accepted together with a write-ahead blob of its sums
(``Store.accept_many``), which the next flush of that instance deletes as it folds it in: the
blobs plus the write-ahead entries always hold every accepted report, whenever an instance dies. Store memory is therefore at most ``instances × L × E × 8`` bytes per deployment
(4 where the sums are whole and fit int32, as token counts in a sliding window do), whatever
the number of reporting ranks, the report rate or the window length.

Two formats, both little-endian, told apart by their magic and both read by :func:`sum_blobs`:

- ``b"EPW1"`` (window blobs before 1.0; still read): kind ``u8`` (0
  sliding, 1 decay), ``f64`` time the sums are as of, ``u64`` reports, ``f64`` half-life
  seconds (0 for sliding), then ``L × E`` ``f64`` sums, row-major.
- ``b"EPW2"`` (window blobs, :func:`encode_blob`, and write-ahead entries,
  :func:`encode_sums`): the same header plus a ``u8`` dtype code (0 int32, 1 int64, 2 float32,
  3 float64), then ``L × E`` sums of that dtype: the narrowest one that holds the sums exactly,
  so an int32 report costs 4 bytes a count, not 8, and sums that overflow int32 widen to int64
  (that blob or entry only).

EPW2 entries live in a write-ahead stream of their own (the store's ``wal2``, see
:mod:`.redis_store.keys`).
"""

from __future__ import annotations

import math
import struct
from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["WindowSpec", "SlidingWindow", "DecayWindow", "make_window", "encode_blob", "encode_sums", "sum_blobs"]

_HEADER = struct.Struct("<4sBdQd")
_MAGIC = b"EPW1"
_MAGIC2 = b"EPW2"
_ENTRY_DTYPES = (np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4"), np.dtype("<f8"))
_INT32_MAX = np.iinfo(np.int32).max
# float64 holds every integer below this exactly, so integer-valued sums below it are exact.
_EXACT_INT = 2.0**53


@dataclass(frozen=True)
class WindowSpec:
    """``kind`` "sliding" (``duration_s`` and/or ``report_count``, in ``buckets``) or "decay"."""

    kind: str = "sliding"
    duration_s: float = 600.0
    report_count: int = 0
    buckets: int = 10
    half_life_s: float = 0.0

    @property
    def stale_after_s(self) -> float:
        """How old an instance's blob may get before the planner drops it (its instance is gone)."""
        if self.kind == "decay":
            return 10 * self.half_life_s
        return self.duration_s if self.duration_s > 0 else 600.0


class SlidingWindow:
    """Sums ``[L, E]`` over the last ``duration_s`` and/or ``report_count`` reports.

    Buckets expire whole and the window never reaches further back than the configured span:
    a count window holds between ``report_count - ceil(report_count / buckets) + 1`` and
    ``report_count`` of the last reports, a time window the buckets that began within the last
    ``duration_s`` (with reports flowing, at least ``(buckets - 1) / buckets`` of it). Memory is
    at most ``buckets + 1`` arrays.
    """

    def __init__(self, shape: tuple[int, int], spec: WindowSpec) -> None:
        self.shape = shape
        self.spec = spec
        self._span_s = spec.duration_s / spec.buckets if spec.duration_s > 0 else math.inf
        self._span_n = math.ceil(spec.report_count / spec.buckets) if spec.report_count > 0 else None
        # (start time, reports, sums); the last one is open.
        self._buckets: deque[tuple[float, int, np.ndarray]] = deque()
        self._bound = 0

    def add(self, counts: np.ndarray, now: float, reports: int = 1) -> None:
        """``counts``: ``[L, E]`` of any real dtype, the sum of ``reports`` reports (a node
        report's covers), all >= 0 (checked on the way in).

        A bucket is as narrow as its sums allow: int32 while whole counts fit (engines' token
        counts: half the memory of float64, and an instance keeps up to ``buckets + 1`` of
        them for every deployment it takes reports for), widened to int64 when a sum would
        pass 2^31 - 1, and float64 once a count is not whole."""
        if not self._buckets or self._full(self._buckets[-1], now):
            self._buckets.append((now, 0, np.zeros(self.shape, dtype=np.int32)))
            self._bound = 0  # the open bucket's largest sum is at most this
        start, n, sums = self._buckets[-1]
        counts = np.asarray(counts)
        if sums.dtype.kind != "f" and counts.dtype.kind not in "iu":
            if counts.max(initial=0) < _EXACT_INT and (counts == np.floor(counts)).all():
                counts = counts.astype(np.int64)  # whole counts sent as floats
            else:
                sums = sums.astype(np.float64)
        if sums.dtype == np.int32:
            # One pass over the counts, none over the bucket: the bound only grows.
            self._bound += int(counts.max(initial=0))
            if self._bound > _INT32_MAX:
                sums = sums.astype(np.int64)
        np.add(sums, counts, out=sums, casting="unsafe")
        self._buckets[-1] = (start, n + reports, sums)
        # After the report is counted, so that a count window never holds more than its span.
        self._expire(now)

    def _full(self, bucket: tuple[float, int, np.ndarray], now: float) -> bool:
        start, n, _ = bucket
        return now - start >= self._span_s or (self._span_n is not None and n >= self._span_n)

    def _expire(self, now: float) -> None:
        buckets = self._buckets
        if self.spec.duration_s > 0:
            # A bucket that began before the window did is gone (it used to stay until its
            # whole span was older, so the window reached back up to one bucket further).
            while buckets and buckets[0][0] < now - self.spec.duration_s:
                buckets.popleft()
        if self._span_n is not None:
            # The newest buckets whose reports add up to at most report_count (the open one
            # alone never exceeds it: it holds at most ceil(report_count / buckets)).
            total = sum(n for _, n, _ in buckets)
            while len(buckets) > 1 and total > self.spec.report_count:
                total -= buckets.popleft()[1]
        while len(buckets) > self.spec.buckets + 1:
            buckets.popleft()

    def total(self, now: float) -> tuple[np.ndarray, int]:
        """``[L, E]`` sums in the window as of ``now`` (int64 while every bucket is whole,
        else float64), and the reports behind them."""
        self._expire(now)
        whole = all(s.dtype.kind in "iu" for _, _, s in self._buckets)
        sums = np.zeros(self.shape, dtype=np.int64 if whole else np.float64)
        n = 0
        for _, k, s in self._buckets:
            sums += s
            n += k
        return sums, n


class DecayWindow:
    """Exponentially decayed ``[L, E]`` sums: a report of age ``a`` weighs ``2 ** (-a / half_life_s)``."""

    def __init__(self, shape: tuple[int, int], spec: WindowSpec) -> None:
        self.shape = shape
        self.spec = spec
        self._sums = np.zeros(shape)
        self._at = 0.0
        self._reports = 0

    def _decay_to(self, now: float) -> None:
        if now > self._at:
            self._sums *= 2.0 ** (-(now - self._at) / self.spec.half_life_s)
            self._at = now

    def add(self, counts: np.ndarray, now: float, reports: int = 1) -> None:
        self._decay_to(now)
        self._sums += counts
        self._reports += reports

    def total(self, now: float) -> tuple[np.ndarray, int]:
        self._decay_to(now)
        return self._sums.copy(), self._reports


def make_window(shape: tuple[int, int], spec: WindowSpec) -> SlidingWindow | DecayWindow:
    return DecayWindow(shape, spec) if spec.kind == "decay" else SlidingWindow(shape, spec)


def encode_blob(window: SlidingWindow | DecayWindow, now: float) -> bytes:
    """The window as of ``now`` → the EPW2 blob flushed to the store (layout in the module doc):
    whole counts that fit as int32, 4 bytes a sum. Every instance flushes a blob per deployment
    it received reports for, about once a second, so its width is most of what the store
    writes for a fleet of deployments (EPW1, float64, is still read)."""
    sums, n = window.total(now)
    return encode_sums(sums, n, now, window.spec)


def _header(magic: bytes, reports: int, at: float, spec: WindowSpec) -> bytes:
    decay = spec.kind == "decay"
    return _HEADER.pack(magic, int(decay), at, reports, spec.half_life_s if decay else 0.0)


def encode_sums(sums: np.ndarray, reports: int, at: float, spec: WindowSpec) -> bytes:
    """``sums``: ``[L, E]`` of ``reports`` reports as of ``at`` → the EPW2 write-ahead entry the
    store keeps with a batch of accepted reports until a flush folds it, in the narrowest dtype
    that holds every sum exactly (int32 for int32 reports, also folded from physical counts)."""
    sums = np.asarray(sums)
    code = 3
    if sums.dtype == np.int32:
        code = 0  # counts are >= 0 (checked on the way in): no pass needed
    elif sums.dtype.kind in "iu" or (sums == np.floor(sums)).all():
        top = sums.max(initial=0)
        code = 0 if top <= _INT32_MAX else 1 if top < _EXACT_INT else 3
    elif (sums.astype(np.float32) == sums).all():
        code = 2
    data = np.ascontiguousarray(sums, dtype=_ENTRY_DTYPES[code]).tobytes()
    return _header(_MAGIC2, reports, at, spec) + bytes([code]) + data


def _decode(blob: bytes, shape: tuple[int, int]) -> np.ndarray | None:
    """An EPW1 or EPW2 blob's float64 ``[L, E]`` sums; None when it is neither (or of another shape)."""
    size = shape[0] * shape[1]
    if blob[:4] == _MAGIC and len(blob) == _HEADER.size + size * 8:
        return np.frombuffer(blob, dtype="<f8", offset=_HEADER.size).reshape(shape)
    if blob[:4] == _MAGIC2 and len(blob) > _HEADER.size and blob[_HEADER.size] < len(_ENTRY_DTYPES):
        dt = _ENTRY_DTYPES[blob[_HEADER.size]]
        if len(blob) == _HEADER.size + 1 + size * dt.itemsize:
            return np.frombuffer(blob, dtype=dt, offset=_HEADER.size + 1).reshape(shape).astype(np.float64)
    return None


def sum_blobs(
    blobs: dict[str, bytes], shape: tuple[int, int], now: float, stale_after_s: float
) -> tuple[np.ndarray, int, list[str]]:
    """Replica blobs and write-ahead entries (EPW1 or EPW2) → float64 ``[L, E]`` summed as of
    ``now``, reports, and stale keys.

    Decay sums are decayed from their flush time to ``now``; blobs older than ``stale_after_s``
    belong to instances that stopped flushing and are left out, and so are blobs holding a NaN
    or an infinity (written before reports were capped): one bad blob never poisons a window.
    """
    total = np.zeros(shape)
    reports = 0
    stale = []
    for instance, blob in blobs.items():
        sums = _decode(blob, shape)
        if sums is None:
            stale.append(instance)
            continue
        _, kind, at, n, half_life = _HEADER.unpack_from(blob)
        if now - at > stale_after_s:
            stale.append(instance)
            continue
        if not np.isfinite(sums).all():
            stale.append(instance)
            continue
        total += sums * (2.0 ** (-max(0.0, now - at) / half_life)) if kind == 1 else sums
        reports += n
    return total, reports, stale
