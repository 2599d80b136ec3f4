"""order_local_copies: an in-place order of the copies within one gpu."""

import random

import pytest

from eplb_engine.local_order import SPARE, order_local_copies


def _apply(order: list[tuple[int, int]], n: int) -> dict[int, object]:
    mem: dict[int, object] = {i: ("old", i) for i in range(n)}
    for src, dst in order:
        mem[dst] = mem[src]  # SPARE is key -1
    return mem


def test_random_copy_sets_end_with_every_destination_holding_its_sources_old_content() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        n = rng.randint(2, 10)
        dsts = rng.sample(range(n), rng.randint(0, n))
        copies = [(rng.choice([s for s in range(n) if s != d]), d) for d in dsts]
        order = order_local_copies(copies)
        mem = _apply(order, n)
        assert all(mem[d] == ("old", s) for s, d in copies)
        assert len(order) == len(copies) + sum(1 for _, d in order if d == SPARE)


def test_a_chain_needs_no_spare_and_a_cycle_one_extra_copy() -> None:
    assert order_local_copies([(1, 0), (2, 1)]) == [(1, 0), (2, 1)]
    assert order_local_copies([(1, 0), (0, 1)]) == [(0, SPARE), (1, 0), (SPARE, 1)]
    # two 3-cycles: one spare copy each, the spare reused
    order = order_local_copies([(1, 0), (2, 1), (0, 2), (4, 3), (5, 4), (3, 5)])
    assert sum(1 for _, d in order if d == SPARE) == 2 and len(order) == 8


def test_repeated_destinations_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct destinations"):
        order_local_copies([(1, 0), (2, 0)])
    with pytest.raises(ValueError, match="different from its source"):
        order_local_copies([(0, 0)])
