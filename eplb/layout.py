"""The ``[rows, bins, slots]`` layout every placement step works on, and its shared tolerances.

A *row* is one packing problem: a layer (``global``), or one node of a layer
(``hierarchical``, with node-local expert ids). ``phy`` ``[X, B, S]`` holds the expert of
each of the ``S`` slots of each of the ``B`` bins (gpus) of each of the ``X`` rows; an
expert's load is split evenly over its replicas. ``phy2log`` ``[L, P]`` is the same array
with ``P = B * S`` slots per layer, gpu by gpu.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

__all__ = [
    "REL_TOL",
    "GOOD_ENOUGH",
    "replica_counts",
    "per_replica",
    "bin_loads",
    "busiest",
    "count_true",
    "distinct_per_bin",
    "distinct_rows",
    "slot_sums",
    "stable_argsort",
    "take_rows",
]

# Relative gain below which a change is float noise, not an improvement (all steps compare
# busiest bins with it, so a plan never flips on rounding).
REL_TOL = 1e-12
# Distance above a row's mean (or bound) below which it is left alone: further moves are not
# worth their time.
GOOD_ENOUGH = 1e-3


def replica_counts(phy: np.ndarray, num_experts: int) -> np.ndarray:
    """``phy`` ``[X, ...]`` expert ids (-1: an empty slot, counted for no expert) → ``[X, E]``
    int64 replicas of each expert per row."""
    X = phy.shape[0]
    # One bincount over (row, expert + 1) keys, so that an empty slot (-1) lands in a column of
    # its own that is dropped: np.add.at is several times slower on the hot path.
    width = num_experts + 1
    keys = (np.arange(X, dtype=np.int64)[:, None] * width + 1 + phy.reshape(X, -1)).ravel()
    counts = np.bincount(keys, minlength=X * width).reshape(X, width)
    return np.ascontiguousarray(counts[:, 1:], dtype=np.int64)


def per_replica(loads: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """``loads``, ``cnt`` ``[X, E]`` → float64 ``[X, E + 1]``: each replica's load, and a last
    column of zeros, which ``take_rows`` reads for an empty slot (-1)."""
    out = np.zeros((loads.shape[0], loads.shape[1] + 1))
    np.divide(loads, np.maximum(cnt, 1), out=out[:, :-1])
    return out


def bin_loads(loads: np.ndarray, phy: np.ndarray) -> np.ndarray:
    """``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` → ``[X, B]`` load of each bin (each replica
    carries its expert's load over its replica count; an empty slot, -1, carries none)."""
    cnt = replica_counts(phy, loads.shape[1])
    return slot_sums(take_rows(per_replica(loads, cnt), phy))


def busiest(loads: np.ndarray, phy: np.ndarray) -> np.ndarray:
    """``loads`` ``[X, E]``, ``phy`` ``[X, B, S]`` → ``[X]`` load of each row's busiest bin."""
    return bin_loads(loads, phy).max(axis=1)


def distinct_per_bin(phy: np.ndarray) -> bool:
    """``phy`` ``[X, B, S]`` → whether no bin holds two replicas of one expert (count moves and
    the repairs need that)."""
    srt = np.sort(phy, axis=2)
    return not (srt[:, :, 1:] == srt[:, :, :-1]).any()


def distinct_rows(phy: np.ndarray) -> np.ndarray:
    """``phy`` ``[X, B, S]`` → ``[X]`` whether no bin of each row holds two replicas of one
    expert (``distinct_per_bin`` row by row, so a row's repair never hangs on another's)."""
    srt = np.sort(phy, axis=2)
    return ~(srt[:, :, 1:] == srt[:, :, :-1]).any(axis=(1, 2))


def _sums_by_slices(w: np.ndarray) -> np.ndarray:
    """``w`` ``[..., S]``, ``3 <= S < 16`` → ``[...]``: the sum over the last axis in numpy's own
    order, as whole-array additions of slices. Below 8 numpy adds in turn; from 8 to 127 on a
    contiguous last axis it keeps 8 running sums (slot k, k + 8, ...), adds them pairwise
    (((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7))) and then the remainder in turn."""
    S = w.shape[-1]
    if S < 8:
        out = w[..., 0] + w[..., 1]
        for j in range(2, S):
            out += w[..., j]
        return out
    pairs = w[..., 0:8:2] + w[..., 1:8:2]
    quads = pairs[..., 0:4:2] + pairs[..., 1:4:2]
    out = quads[..., 0] + quads[..., 1]
    for j in range(8, S):
        out += w[..., j]
    return out


def _sums_in_order() -> frozenset[int]:
    """The slot counts ``S`` (3 to 15) for which ``_sums_by_slices`` gives ``w.sum(axis=-1)`` to
    the bit on this numpy, checked once on import over a few shapes and scales of values: the
    order is numpy's implementation, not its contract, and a plan must not change with it."""
    rng = np.random.default_rng(12345)
    ok = set()
    for S in range(3, 16):
        same = True
        for shape in ((7, 5), (40, 33), (3, 129)):
            w = rng.random(shape + (S,)) * rng.choice([1e-3, 1.0, 1e3, 1e9], size=shape + (S,))
            same &= bool((_sums_by_slices(w) == w.sum(axis=-1)).all())
        if same:
            ok.add(S)
    return frozenset(ok)


# Slot counts whose per-bin sums ``slot_sums`` may add slice by slice (see ``_sums_in_order``).
_SUMS_IN_ORDER = _sums_in_order()


def slot_sums(w: np.ndarray) -> np.ndarray:
    """``w`` ``[..., S]`` → ``[...]``: ``w.sum(axis=-1)``, to the bit. A reduction over a short
    last axis costs a call per bin (the two-slot decode shape has hundreds of bins): with one or
    two slots the sum is one addition whatever the order, done as one vector operation; with 3
    to 15 slots of a contiguous array, as a few whole-array additions in numpy's own order
    (where the check on import found it so): 128 gpus x 3 slots 98 -> 6 us, 32 x 9 29 -> 19 us."""
    S = w.shape[-1]
    if S == 2:
        return w[..., 0] + w[..., 1]
    if S == 1:
        return w[..., 0].copy()
    if S in _SUMS_IN_ORDER and w.ndim > 1 and w.flags.c_contiguous and w.dtype == np.float64:
        return _sums_by_slices(w)
    return w.sum(axis=-1)


def count_true(x: np.ndarray) -> np.ndarray:
    """``x`` ``[..., n]`` bool → int64 ``[...]``: ``x.sum(axis=-1)``. Below 256 summed as bytes
    (no count can wrap), then widened: a bool sum goes through a cast per element, 2.6 times
    the time ([116, 8, 126]: 52 -> 20 us)."""
    if x.dtype != np.bool_ or x.shape[-1] >= 256 or not x.flags.c_contiguous:
        return x.sum(axis=-1)
    return x.view(np.uint8).sum(axis=-1, dtype=np.uint8).astype(np.int64)


# Row length from which ``stable_argsort`` sorts integer keys rather than calling numpy's sort.
_STABLE_FROM = 48


def stable_argsort(a: np.ndarray) -> np.ndarray:
    """``a`` ``[X, n]`` float64 → int64 ``[X, n]``: ``np.argsort(a, axis=1, kind="stable")``, to the index.

    numpy sorts floats stably by timsort, whose insertion runs cost four times its vectorised
    quicksort on rows of a few dozen to a few hundred (a row of gpu loads). Ties are common
    there (gpus holding the same experts), so a quicksort's order cannot stand. Instead each
    row sorts one unique integer key: the bits of a float >= 0 read as an integer rise with it,
    so ``(bits - row's least bits) << k | index`` orders by value, then index, and the index is
    its low ``k`` bits. Rows whose spread of bits does not fit beside the index (zeros next to
    large values, infinities), and arrays with a negative value or -0.0, take numpy's sort.
    The packing steps' rows (v3-decode-144 and qwen3-64 re-plans): 2.3-2.8 times faster."""
    X, n = a.shape
    # Below about 48 numpy's sort is a binary insertion sort that beats the integer sort's few
    # passes (32 gpus: 9 against 15 us on 58 rows; 64 gpus: 38 against 22 us).
    if n < _STABLE_FROM or a.dtype != np.float64:
        return np.argsort(a, axis=1, kind="stable")
    key = np.ascontiguousarray(a).view(np.int64)
    lo = key.min(axis=1, keepdims=True)
    if X == 0 or lo.min() < 0:  # a sign bit set: a negative value or -0.0 (equal to 0.0 for numpy)
        return np.argsort(a, axis=1, kind="stable")
    k = (n - 1).bit_length()
    c = key - lo
    wide = c.max(axis=1) >= 1 << (63 - k)
    c <<= k
    c |= np.arange(n)
    c.sort(axis=1)
    c &= (1 << k) - 1
    if wide.any():
        rows = np.flatnonzero(wide)
        c[rows] = np.argsort(a[rows], axis=1, kind="stable")
    return c


@lru_cache(maxsize=256)
def _row_offsets(X: int, n: int, ndim: int) -> np.ndarray:
    """``[X, 1, ...]`` (``ndim`` axes) row offsets ``x * n``, read-only: the same few shapes
    recur on every round of a plan."""
    out = (np.arange(X) * n).reshape((X,) + (1,) * (ndim - 1))
    out.setflags(write=False)
    return out


def take_rows(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a`` ``[X, n]``, ``idx`` ``[X, ...]`` ints in ``[0, n)`` → ``[X, ...]``: ``a[x, idx[x, ...]]``.

    The same values as ``a[np.arange(X)[:, None, ...], idx]``, through one flat ``np.take``:
    fancy indexing that broadcasts a row index costs about four times more, and the placement
    steps gather this way on every round. An index of -1 (an empty slot) reads the previous
    row's last entry (row 0: the last row's): give ``a`` a trailing column of zeros
    (``per_replica``) and an empty slot reads 0. The placement steps themselves plan on the
    live gpus only (``eplb.survivors``), so their slots are never empty."""
    X, n = a.shape
    flat = idx + _row_offsets(X, n, idx.ndim)
    return np.take(a.reshape(-1) if a.flags.c_contiguous else np.ascontiguousarray(a).reshape(-1), flat)
