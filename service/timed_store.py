"""``TimedStore``: a ``Store`` whose calls are timed and counted into :class:`.metrics.Metrics`.

Apart from :mod:`.metrics` (which :mod:`.errors` imports for the call counters), so that the
store's error classes are imported at the top here without an import circle.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable

from .errors import ServiceError, StoreUnavailable
from .metrics import Metrics

__all__ = ["TimedStore"]


class TimedStore:
    """A ``Store`` that times every call into ``eplb_store_latency_seconds{op}`` and keeps
    ``eplb_store_up`` at 0 after a call failed with ``StoreUnavailable`` (or answered a list
    holding one: ``accept_many``'s per-deployment answers) and 1 after one answered.

    Everything else (attributes, async-generator methods such as ``follow``) passes through.
    """

    def __init__(self, store: object, metrics: Metrics) -> None:
        self._store = store
        self._metrics = metrics
        self._calls: dict[str, Callable[..., Awaitable[object]]] = {}

    @property
    def inner(self) -> object:
        """The wrapped store."""
        return self._store

    def __getattr__(self, name: str) -> object:
        timed = self._calls.get(name)
        if timed is not None:
            return timed
        attr = getattr(self._store, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        latency = self._metrics.store_latency.labels(name)
        errors = self._metrics.store_errors.labels(name)
        up = self._metrics.store_up

        async def call(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                out = await attr(*args, **kwargs)
            except StoreUnavailable:
                errors.inc()
                up.set(0)
                raise
            except ServiceError:  # NotFound, Aborted, …: the store answered
                up.set(1)
                raise
            finally:
                latency.observe(time.perf_counter() - start)
            if isinstance(out, list) and any(isinstance(a, StoreUnavailable) for a in out):
                # accept_many answers each deployment's batch apart (a Redis Cluster master's
                # failure fails its own): a call of which any part found the store unreachable
                # counts as one that did, as when each was a call of its own.
                errors.inc()
                up.set(0)
                return out
            up.set(1)
            return out

        self._calls[name] = call
        return call
