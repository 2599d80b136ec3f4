"""The order in which libstdc++'s ``std::sort`` leaves equal keys, as torch's CPU sort does.

torch sorts on the CPU with ``std::sort`` (introsort) unless asked for a stable sort, so the
order of tied values, which decides eplb.py's packing, is introsort's. Rows of up to 16
items are insertion-sorted, which is stable; longer rows need this emulation.
"""

from __future__ import annotations

import numpy as np

__all__ = ["argsort_desc_like_torch"]

_THRESHOLD = 16


def argsort_desc_like_torch(values: np.ndarray, keys: np.ndarray | None = None) -> np.ndarray:
    """``values``: ``[X, n]`` → int64 ``[X, n]``, what ``torch.sort(values, -1, descending=True).indices`` gives.

    Rows without ties have one right answer, taken from numpy; rows with ties replay introsort.
    With ``keys`` (``[X, n]``), a caller that only needs the sequence of keys in sorted order
    (not which of two equal items comes first) skips the replay for rows whose tied values
    all share one key, where every order gives the same key sequence.
    """
    values = np.asarray(values)
    order = np.argsort(-values, axis=1, kind="stable")
    n = values.shape[1]
    if n <= _THRESHOLD:
        return order
    srt = np.take_along_axis(values, order, axis=1)
    same = srt[:, 1:] == srt[:, :-1]
    if keys is not None:
        # A tie only matters between different keys. Equal values of one key are contiguous
        # in numpy's stable order only if no other key shares the value, so test every run.
        srt_keys = np.take_along_axis(keys, order, axis=1)
        run_start = np.concatenate([np.ones((len(srt), 1), dtype=bool), ~same], axis=1)
        start = np.maximum.accumulate(np.where(run_start, np.arange(n), 0), axis=1)
        tied = (srt_keys != np.take_along_axis(srt_keys, start, axis=1)).any(axis=1)
    else:
        tied = same.any(axis=1)
    for x in np.flatnonzero(tied):
        order[x] = _introsort_desc(values[x].tolist())
    return order


def _introsort_desc(keys: list[float]) -> list[int]:
    n = len(keys)
    k = keys[:]
    v = list(range(n))
    _introsort_loop(k, v, 0, n, 2 * (n.bit_length() - 1))
    # __final_insertion_sort: guarded on the first 16, unguarded on the rest.
    _insertion_sort(k, v, 0, _THRESHOLD)
    for i in range(_THRESHOLD, n):
        _unguarded_linear_insert(k, v, i)
    return v


def _introsort_loop(k: list[float], v: list[int], first: int, last: int, depth: int) -> None:
    while last - first > _THRESHOLD:
        if depth == 0:
            _heap_sort(k, v, first, last)
            return
        depth -= 1
        cut = _partition_pivot(k, v, first, last)
        _introsort_loop(k, v, cut, last, depth)
        last = cut


def _swap(k: list[float], v: list[int], a: int, b: int) -> None:
    k[a], k[b] = k[b], k[a]
    v[a], v[b] = v[b], v[a]


def _partition_pivot(k: list[float], v: list[int], first: int, last: int) -> int:
    mid = first + (last - first) // 2
    a, b, c = first + 1, mid, last - 1
    # __move_median_to_first with comp(x, y) = x > y (descending).
    if k[a] > k[b]:
        if k[b] > k[c]:
            _swap(k, v, first, b)
        elif k[a] > k[c]:
            _swap(k, v, first, c)
        else:
            _swap(k, v, first, a)
    elif k[a] > k[c]:
        _swap(k, v, first, a)
    elif k[b] > k[c]:
        _swap(k, v, first, c)
    else:
        _swap(k, v, first, b)
    # __unguarded_partition(first + 1, last, pivot=first)
    pivot = k[first]
    lo, hi = first + 1, last
    while True:
        while k[lo] > pivot:
            lo += 1
        hi -= 1
        while pivot > k[hi]:
            hi -= 1
        if not lo < hi:
            return lo
        _swap(k, v, lo, hi)
        lo += 1


def _insertion_sort(k: list[float], v: list[int], first: int, last: int) -> None:
    for i in range(first + 1, last):
        if k[i] > k[first]:
            ki, vi = k[i], v[i]
            k[first + 1 : i + 1] = k[first:i]
            v[first + 1 : i + 1] = v[first:i]
            k[first], v[first] = ki, vi
        else:
            _unguarded_linear_insert(k, v, i)


def _unguarded_linear_insert(k: list[float], v: list[int], last: int) -> None:
    kv, vv = k[last], v[last]
    nxt = last - 1
    while kv > k[nxt]:
        k[last], v[last] = k[nxt], v[nxt]
        last = nxt
        nxt -= 1
    k[last], v[last] = kv, vv


def _heap_sort(k: list[float], v: list[int], first: int, last: int) -> None:
    # std::partial_sort(first, last, last): make_heap then sort_heap, comp = (x > y).
    n = last - first
    for parent in range((n - 2) // 2, -1, -1):
        _adjust_heap(k, v, first, parent, n, k[first + parent], v[first + parent])
    while n > 1:
        n -= 1
        kv, vv = k[first + n], v[first + n]
        k[first + n], v[first + n] = k[first], v[first]
        _adjust_heap(k, v, first, 0, n, kv, vv)


def _adjust_heap(k: list[float], v: list[int], base: int, hole: int, length: int, kv: float, vv: int) -> None:
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if k[base + child] > k[base + child - 1]:
            child -= 1
        k[base + hole], v[base + hole] = k[base + child], v[base + child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        k[base + hole], v[base + hole] = k[base + child - 1], v[base + child - 1]
        hole = child - 1
    # __push_heap
    parent = (hole - 1) // 2
    while hole > top and k[base + parent] > kv:
        k[base + hole], v[base + hole] = k[base + parent], v[base + parent]
        hole = parent
        parent = (hole - 1) // 2
    k[base + hole], v[base + hole] = kv, vv
