"""Prometheus metrics: one registry per server, labels kept to low-cardinality values.

Deployment-labelled series are dropped when the deployment is deleted (:meth:`Metrics.forget`).
RPC series are labelled by the method's short name and the gRPC status code name; store series
by the ``Store`` operation. The registry also carries prometheus-client's process, platform and
GC collectors, so ``/metrics`` shows the instance's CPU, memory and open file descriptors.
"""

from __future__ import annotations

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

__all__ = ["LATENCY_BUCKETS", "SERIES", "Metrics", "Series"]

# Seconds: unary reads take ~1 ms, report batches and Redis scripts a few, plans up to minutes.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class Series:
    """One ``eplb_`` series as ``/metrics`` shows it: ``name`` as scraped (a counter's ends in
    ``_total``), ``kind`` (``counter``, ``gauge`` or ``histogram``), its label names in order,
    its help text, and a histogram's bucket bounds in seconds."""

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


# Every eplb_ series a server registers, by the Metrics attribute that updates it (the table in
# docs/service.md §Metrics lists the same): for dashboards, alerts and checks of the docs.
SERIES: dict[str, Series] = {
    # Per deployment.
    "reports": Series("eplb_reports_total", "counter", ("deployment", "outcome"), "Load reports received"),
    "rebalances": Series("eplb_rebalances_total", "counter", ("deployment", "policy", "outcome"), "Re-plans"),
    "rebalance_seconds": Series(
        "eplb_rebalance_seconds",
        "histogram",
        ("deployment", "policy"),
        "Time to plan a rebalance (window read, solve, publish)",
        (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    ),
    "imbalance": Series(
        "eplb_imbalance", "gauge", ("deployment",), "Mean imbalance of the current placement when it was planned"
    ),
    "version": Series(
        "eplb_placement_version", "gauge", ("deployment",), "Current placement version seen by this instance"
    ),
    "watchers": Series("eplb_watchers", "gauge", ("deployment",), "Open WatchPlacements streams on this instance"),
    "suspect_ranks": Series(
        "eplb_suspect_ranks",
        "gauge",
        ("deployment",),
        "Ranks not down that sent no report and no ack for over liveness.suspect_after, as this instance last counted",
    ),
    "budget_limited": Series(
        "eplb_budget_limited_total",
        "counter",
        ("deployment",),
        "Published re-plans that a move budget held below their tolerances",
    ),
    "replan_failures": Series(
        "eplb_replan_failures_total",
        "counter",
        ("deployment",),
        "Triggered re-plans that raised (the trigger loop goes on with other deployments)",
    ),
    "reports_rejected": Series(
        "eplb_reports_rejected_total",
        "counter",
        ("deployment", "reason"),
        "Load reports refused, by reason (e.g. invalid, over_cap, unknown_rank, stale_version)",
    ),
    "rollouts": Series(
        "eplb_rollout_total",
        "counter",
        ("deployment", "state"),
        "Placement versions whose rollout reached a state: prepared (every rank), switched (every rank), failed (aborted)",
    ),
    # Per RPC method (short name, e.g. ReportLoad) and status code name (e.g. OK, UNAVAILABLE).
    "rpc_requests": Series(
        "eplb_rpc_requests_total", "counter", ("method", "code"), "gRPC calls finished, by method and status code"
    ),
    "rpc_latency": Series(
        "eplb_rpc_latency_seconds",
        "histogram",
        ("method",),
        "gRPC call duration, start to status (streams: their whole life)",
        LATENCY_BUCKETS,
    ),
    # The store (Redis or in-memory).
    "store_up": Series("eplb_store_up", "gauge", (), "1 while the store answered its last call, 0 after it failed"),
    "store_latency": Series(
        "eplb_store_latency_seconds",
        "histogram",
        ("op",),
        "Store call duration by operation (failed calls included)",
        LATENCY_BUCKETS,
    ),
    "store_errors": Series(
        "eplb_store_errors_total", "counter", ("op",), "Store calls that failed because the store was unreachable"
    ),
}

# Series labelled by deployment first, dropped by ``forget``.
_PER_DEPLOYMENT = tuple(attr for attr, s in SERIES.items() if s.labels[:1] == ("deployment",))
_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


@dataclass(frozen=True)
class Metrics:
    """One registry per server, so several servers in one process (tests) do not collide; an
    attribute per entry of ``SERIES`` (``metrics.reports``, ...)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        for attr, series in SERIES.items():
            # prometheus-client adds a counter's _total itself.
            name = series.name.removesuffix("_total") if series.kind == "counter" else series.name
            extra = {"buckets": series.buckets} if series.buckets else {}
            metric = _KINDS[series.kind](name, series.help, series.labels, registry=r, **extra)
            object.__setattr__(self, attr, metric)  # frozen: set once, here
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
