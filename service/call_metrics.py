"""``CallMetrics``: the interceptor's hook that counts every call by method and status code
(``eplb_rpc_requests_total``) and times it (``eplb_rpc_latency_seconds``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .metrics import Metrics

if TYPE_CHECKING:
    from .calls import Call

__all__ = ["CallMetrics"]


class CallMetrics:
    """Counts and times each call as it ends, into ``metrics``."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        # Label children are looked up once: ``labels()`` costs more than the update itself.
        self._counts: dict[tuple[str, str], Any] = {}
        self._latencies: dict[str, Any] = {}

    def bind(self, method: str, label: str) -> Callable[[Call], None]:
        """The hook for ``method``'s calls: every call is counted and timed."""
        return self.finish

    def finish(self, call: Call) -> None:
        key = (call.label, call.code)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = self._metrics.rpc_requests.labels(*key)
        latency = self._latencies.get(call.label)
        if latency is None:
            latency = self._latencies[call.label] = self._metrics.rpc_latency.labels(call.label)
        count.inc()
        latency.observe(time.perf_counter() - call.start)
