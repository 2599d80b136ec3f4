"""``Batcher``: coalescing, and the group commit (``linger_s``) that spaces a shard's store calls
while reports keep coming, without delaying a report after a quiet spell."""

from __future__ import annotations

import asyncio
import time

import pytest

from eplb_service.batcher import Batcher


class Recorder:
    """A store call that takes ``rtt_s`` and records when each call started and what it carried."""

    def __init__(self, rtt_s: float = 0.001) -> None:
        self.rtt_s = rtt_s
        self.calls: list[tuple[float, list]] = []

    async def __call__(self, items: list) -> list:
        self.calls.append((time.monotonic(), list(items)))
        await asyncio.sleep(self.rtt_s)
        return [f"ok:{i}" for i in items]


async def test_items_that_arrive_during_a_call_share_the_next_one():
    rec = Recorder(rtt_s=0.02)
    b = Batcher(rec)
    first = asyncio.ensure_future(b.submit(0))
    await asyncio.sleep(0.005)  # its call is in flight
    out = await asyncio.gather(first, *(b.submit(i) for i in range(1, 5)))
    assert out == [f"ok:{i}" for i in range(5)]
    # The first goes alone at once, the four that queued behind it go together.
    assert [items for _, items in rec.calls] == [[0], [1, 2, 3, 4]]


async def test_a_report_after_a_quiet_spell_goes_at_once():
    rec = Recorder()
    b = Batcher(rec, linger_s=0.5)
    t = time.monotonic()
    assert await b.submit("a") == "ok:a"
    assert time.monotonic() - t < 0.25  # not held for the linger
    await asyncio.sleep(0.6)
    t = time.monotonic()
    assert await b.submit("b") == "ok:b"
    assert time.monotonic() - t < 0.25


async def test_under_a_steady_rate_calls_start_a_linger_apart_and_carry_what_came_meanwhile():
    rec = Recorder()
    linger = 0.1
    b = Batcher(rec, linger_s=linger, fill=1000)

    async def steady(k: int) -> list:
        out = []
        for i in range(10):
            out.append(await b.submit((k, i)))
        return out

    # Four callers, each waiting for its answer before the next: no more than four can wait.
    results = await asyncio.gather(*(steady(k) for k in range(4)))
    assert results == [[f"ok:{(k, i)}" for i in range(10)] for k in range(4)]
    starts = [t for t, _ in rec.calls]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert min(gaps) >= linger * 0.95, gaps
    # 40 items in about 11 calls rather than 40 (one per item and caller without the linger).
    assert len(rec.calls) <= 12 and sum(len(items) for _, items in rec.calls) == 40


async def test_fill_waiting_items_go_without_waiting_for_the_linger():
    rec = Recorder(rtt_s=0.01)
    b = Batcher(rec, linger_s=5.0, fill=4)
    await b.submit("first")  # the next call would wait 5 s, unless 4 items are waiting
    t = time.monotonic()
    out = await asyncio.gather(*(b.submit(i) for i in range(4)))
    assert out == [f"ok:{i}" for i in range(4)]
    assert time.monotonic() - t < 1.0
    assert [items for _, items in rec.calls] == [["first"], [0, 1, 2, 3]]


async def test_a_failed_call_fails_every_item_it_carried_and_the_next_still_runs():
    calls = []

    async def flaky(items: list) -> list:
        calls.append(list(items))
        await asyncio.sleep(0.01)
        if len(calls) == 1:
            raise RuntimeError("store down")
        return items

    b = Batcher(flaky, linger_s=0.02)
    first = asyncio.ensure_future(b.submit(1))
    await asyncio.sleep(0)
    rest = [asyncio.ensure_future(b.submit(i)) for i in (2, 3)]
    with pytest.raises(RuntimeError, match="store down"):
        await first
    assert await asyncio.gather(*rest) == [2, 3]
    assert calls == [[1], [2, 3]]


async def test_an_answer_that_is_an_exception_fails_its_item_alone():
    # One deployment's failure in a shared batch (NotFound, its master down) reaches only the
    # callers of that deployment's items; the others of the batch get their answers.
    async def some_fail(items: list) -> list:
        await asyncio.sleep(0.01)
        return [KeyError(f"item {i}") if i % 2 else i * 10 for i in items]

    b = Batcher(some_fail, linger_s=0.02)
    out = await asyncio.gather(*(b.submit(i) for i in range(4)), return_exceptions=True)
    assert out[0] == 0 and out[2] == 20
    assert isinstance(out[1], KeyError) and "item 1" in str(out[1])
    assert isinstance(out[3], KeyError) and "item 3" in str(out[3])
    assert await b.submit(6) == 60  # and the batcher goes on


@pytest.mark.parametrize("kw", [{"linger_s": -0.1}, {"fill": 0}])
def test_bad_settings_say_what_is_allowed(kw):
    with pytest.raises(ValueError, match="linger_s must be >= 0 and fill >= 1"):
        Batcher(lambda items: items, **kw)
