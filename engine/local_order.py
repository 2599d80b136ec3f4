"""In-place order of the copies within one gpu: every byte copied once, cycles via one spare slot."""

from __future__ import annotations

from collections import Counter

__all__ = ["SPARE", "order_local_copies"]

SPARE = -1


def order_local_copies(copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``copies``: ``[(src, dst)]``, old content of slot ``src`` into slot ``dst`` (each ``dst``
    once, ``src != dst``) → the same copies in an order that is correct in place.

    A slot is overwritten only after every copy that reads its old content has run. When only
    cycles remain (a takes b's old expert, b takes a's), one slot's old content goes to the
    spare slot first (``(x, SPARE)``) and its readers read ``SPARE`` instead: one extra copy
    per cycle, and one spare slot is enough because each cycle unwinds completely before the
    next is broken.
    """
    source = {dst: src for src, dst in copies}
    if len(source) != len(copies) or any(src == dst for src, dst in copies):
        raise ValueError("local copies need distinct destinations, each different from its source")
    readers = Counter(src for src, _ in copies)
    ready = sorted((d for d in source if readers[d] == 0), reverse=True)
    out: list[tuple[int, int]] = []
    in_spare: int | None = None
    while source:
        while ready:
            dst = ready.pop()
            src = source.pop(dst)
            out.append((SPARE if src == in_spare else src, dst))
            readers[src] -= 1
            if readers[src] == 0 and src in source:
                ready.append(src)
        if source:
            in_spare = min(source)
            out.append((in_spare, SPARE))
            readers[in_spare] = 0
            ready.append(in_spare)
    return out
