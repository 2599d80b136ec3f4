"""Prometheus metrics, labelled by deployment (and policy) only, so cardinality stays low."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]


@dataclass(frozen=True)
class Metrics:
    """One registry per server, so several servers in one process (tests) do not collide."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        set_("reports", Counter("eplb_reports", "Load reports received", ["deployment", "outcome"], registry=r))
        set_("rebalances", Counter("eplb_rebalances", "Re-plans", ["deployment", "policy", "outcome"], registry=r))
        set_("rebalance_seconds", Histogram(
            "eplb_rebalance_seconds", "Time to plan a rebalance (window read, solve, publish)",
            ["deployment", "policy"], registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        ))
        set_("imbalance", Gauge("eplb_imbalance", "Mean imbalance of the current placement when it was planned",
                                ["deployment"], registry=r))
        set_("version", Gauge("eplb_placement_version", "Current placement version seen by this replica",
                              ["deployment"], registry=r))
        set_("watchers", Gauge("eplb_watchers", "Open WatchPlacements streams on this replica", ["deployment"], registry=r))
        set_("budget_limited", Counter(
            "eplb_budget_limited", "Published re-plans that a move budget held below their tolerances",
            ["deployment"], registry=r,
        ))

    def forget(self, deployment: str) -> None:
        """Drops a deleted deployment's series."""
        for metric in (
            self.reports, self.rebalances, self.rebalance_seconds, self.imbalance, self.version, self.watchers,
            self.budget_limited,
        ):
            for labels in list(metric._metrics):  # prometheus_client offers no public label listing
                if labels and labels[0] == deployment:
                    metric.remove(*labels)
