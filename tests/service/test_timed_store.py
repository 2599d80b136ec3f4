"""``TimedStore``'s store gauge and error counter for ``accept_many``, whose per-deployment
answers may hold a ``StoreUnavailable`` (a Redis Cluster master down) without raising."""

from __future__ import annotations

from eplb_service.errors import NotFound, StoreUnavailable
from eplb_service.metrics import Metrics
from eplb_service.timed_store import TimedStore


class Answers:
    """A store whose ``accept_many`` returns what it is given (pure logic: no store behind)."""

    def __init__(self) -> None:
        self.next: list = []

    async def accept_many(self, calls: list) -> list:
        return self.next


def _up_and_errors(metrics: Metrics) -> tuple[float, float]:
    errors = metrics.store_errors.labels("accept_many")._value.get()
    return metrics.store_up._value.get(), errors


async def test_an_unavailable_answer_counts_as_a_failed_call_and_others_as_answers():
    metrics, inner = Metrics(), Answers()
    store = TimedStore(inner, metrics)
    inner.next = [([True], "1-0"), NotFound("gone")]  # the store answered each
    await store.accept_many([])
    assert _up_and_errors(metrics) == (1, 0)
    inner.next = [([True], "2-0"), StoreUnavailable("master down")]
    out = await store.accept_many([])
    assert isinstance(out[1], StoreUnavailable)  # handed back, not raised
    assert _up_and_errors(metrics) == (0, 1)
    inner.next = [([True], "3-0")]
    await store.accept_many([])
    assert _up_and_errors(metrics) == (1, 1)
