"""Prometheus metrics: one registry per server, labels kept to low-cardinality values.

Deployment-labelled series are dropped when the deployment is deleted (:meth:`Metrics.forget`).
RPC series are labelled by the method's short name and the gRPC status code name; store series
by the ``Store`` operation. The registry also carries prometheus-client's process, platform and
GC collectors, so ``/metrics`` shows the replica's CPU, memory and open file descriptors.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

__all__ = ["LATENCY_BUCKETS", "Metrics", "TimedStore"]

# Seconds: unary reads take ~1 ms, report batches and Redis scripts a few, plans up to minutes.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

# Gauges and counters labelled by deployment first, dropped by ``forget``.
_PER_DEPLOYMENT = (
    "reports",
    "rebalances",
    "rebalance_seconds",
    "imbalance",
    "version",
    "watchers",
    "budget_limited",
    "replan_failures",
    "reports_rejected",
    "rollouts",
)


@dataclass(frozen=True)
class Metrics:
    """One registry per server, so several servers in one process (tests) do not collide."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        set_ = lambda name, value: object.__setattr__(self, name, value)  # frozen: set once, here
        # Per deployment.
        set_("reports", Counter("eplb_reports", "Load reports received", ["deployment", "outcome"], registry=r))
        set_("rebalances", Counter("eplb_rebalances", "Re-plans", ["deployment", "policy", "outcome"], registry=r))
        set_(
            "rebalance_seconds",
            Histogram(
                "eplb_rebalance_seconds",
                "Time to plan a rebalance (window read, solve, publish)",
                ["deployment", "policy"],
                registry=r,
                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            ),
        )
        set_(
            "imbalance",
            Gauge(
                "eplb_imbalance",
                "Mean imbalance of the current placement when it was planned",
                ["deployment"],
                registry=r,
            ),
        )
        set_(
            "version",
            Gauge(
                "eplb_placement_version", "Current placement version seen by this replica", ["deployment"], registry=r
            ),
        )
        set_(
            "watchers",
            Gauge("eplb_watchers", "Open WatchPlacements streams on this replica", ["deployment"], registry=r),
        )
        set_(
            "budget_limited",
            Counter(
                "eplb_budget_limited",
                "Published re-plans that a move budget held below their tolerances",
                ["deployment"],
                registry=r,
            ),
        )
        set_(
            "replan_failures",
            Counter(
                "eplb_replan_failures",
                "Triggered re-plans that raised (the trigger loop goes on with other deployments)",
                ["deployment"],
                registry=r,
            ),
        )
        set_(
            "reports_rejected",
            Counter(
                "eplb_reports_rejected",
                "Load reports refused, by reason (e.g. invalid, over_cap, unknown_rank, stale_version)",
                ["deployment", "reason"],
                registry=r,
            ),
        )
        set_(
            "rollouts",
            Counter(
                "eplb_rollout",
                "Placement versions whose rollout reached a state: prepared (every rank), switched (every rank), failed (aborted)",
                ["deployment", "state"],
                registry=r,
            ),
        )
        # Per RPC method (short name, e.g. ReportLoad) and status code name (e.g. OK, UNAVAILABLE).
        set_(
            "rpc_requests",
            Counter(
                "eplb_rpc_requests",
                "gRPC calls finished, by method and status code",
                ["method", "code"],
                registry=r,
            ),
        )
        set_(
            "rpc_latency",
            Histogram(
                "eplb_rpc_latency_seconds",
                "gRPC call duration, start to status (streams: their whole life)",
                ["method"],
                registry=r,
                buckets=LATENCY_BUCKETS,
            ),
        )
        # The store (Redis or in-memory).
        set_(
            "store_up",
            Gauge("eplb_store_up", "1 while the store answered its last call, 0 after it failed", registry=r),
        )
        set_(
            "store_latency",
            Histogram(
                "eplb_store_latency_seconds",
                "Store call duration by operation (failed calls included)",
                ["op"],
                registry=r,
                buckets=LATENCY_BUCKETS,
            ),
        )
        set_(
            "store_errors",
            Counter(
                "eplb_store_errors",
                "Store calls that failed because the store was unreachable",
                ["op"],
                registry=r,
            ),
        )
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)

    def forget(self, deployment: str) -> None:
        """Drops a deleted deployment's series."""
        for name in _PER_DEPLOYMENT:
            metric = getattr(self, name)
            for labels in list(metric._metrics):  # prometheus_client offers no public label listing
                if labels and labels[0] == deployment:
                    metric.remove(*labels)


class TimedStore:
    """A ``Store`` that times every call into ``eplb_store_latency_seconds{op}`` and keeps
    ``eplb_store_up`` at 0 after a call failed with ``StoreUnavailable`` and 1 after one answered.

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
        from .errors import ServiceError, StoreUnavailable  # errors imports this module

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
            up.set(1)
            return out

        self._calls[name] = call
        return call
