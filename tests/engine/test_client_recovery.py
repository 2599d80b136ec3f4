"""The engine client across service restarts and replica failover (Redis-backed replicas)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from svc_thread import REDIS_URL, ServerThread

import eplb
from eplb_engine.client import ServiceClient
from eplb_engine.reporter import LoadReporter, ReporterStats
from eplb_engine.watcher import PlacementWatcher

TOPO = eplb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)


class Steps:
    """An engine loop in a thread: adds counts every 2 ms, never waiting on the reporter."""

    def __init__(self, reporter: LoadReporter) -> None:
        self.reporter, self.total, self.slowest = reporter, 0.0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        rng = np.random.default_rng(1)
        while not self._stop.is_set():
            counts = rng.integers(0, 50, (4, 16))
            start = time.perf_counter()
            assert self.reporter.add(counts)
            self.slowest = max(self.slowest, time.perf_counter() - start)
            self.total += counts.sum()
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass(frozen=True)
class Run:
    """What one reporter and one watcher saw through an outage (``through_outage``)."""

    stats: ReporterStats
    window_tokens: float
    tokens_added: float
    slowest_add_s: float
    versions: list[int]
    reconnects: int


def through_outage(addresses: str | list[str], rank: int, outage: Callable[[LoadReporter], None]) -> Run:
    """Reports from ``rank`` every 2 ms and watches ``d1``; once version 1 arrived, runs
    ``outage(reporter)`` (which must leave a replica serving), forces version 2 and flushes."""
    seen: list[int] = []
    with ServiceClient(addresses, timeout_s=15) as client:
        client.create_deployment("d1", TOPO)
        reporter = LoadReporter(addresses, "d1", rank=rank, topology=TOPO, interval_s=0.02)
        watcher = PlacementWatcher(addresses, "d1", lambda p: seen.append(p.version), rank=rank)
        steps = Steps(reporter)
        assert watcher.wait_for(1)
        outage(reporter)
        client.rebalance("d1", force=True)
        assert watcher.wait_for(2, timeout_s=15)
        time.sleep(0.3)
        steps.stop()
        assert reporter.flush(15)
        stats = reporter.stats()
        reporter.close()
        watcher.close()
        tokens = client.rebalance("d1", dry_run=True).window_tokens
    return Run(stats, tokens, steps.total, steps.slowest, seen, watcher.reconnects)


def test_restart_mid_stream_loses_nothing_and_counts_nothing_twice(prefix):
    server = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()

    def restart(reporter: LoadReporter) -> None:
        time.sleep(0.3)
        server.stop(grace_s=1.0)
        time.sleep(0.5)  # reports pile up in the outbox while the service is away
        assert reporter.stats().pending >= 1
        server.start()

    run = through_outage(server.address, 0, restart)
    server.stop()
    assert run.stats.dropped_reports == 0 and run.stats.rejected == 0 and run.stats.dropped_adds == 0
    assert run.window_tokens == pytest.approx(run.tokens_added)
    assert run.versions == [1, 2] and run.reconnects >= 1
    assert run.slowest_add_s < 0.05


def test_failover_between_two_replicas(prefix):
    a = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()
    b = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()

    def lose_a(reporter: LoadReporter) -> None:
        assert reporter.stats().address == a.address
        time.sleep(0.3)
        a.stop(grace_s=0.5)  # a is gone for good: everything continues through b

    run = through_outage([a.address, b.address], 2, lose_a)
    b.stop()
    assert run.stats.address == b.address and run.stats.failovers >= 1
    assert run.stats.dropped_reports == 0 and run.stats.rejected == 0
    assert run.window_tokens == pytest.approx(run.tokens_added)
    assert run.versions == [1, 2]


def test_a_deployments_ranks_report_to_the_instance_its_name_picks(prefix):
    """Every rank of one deployment, given the same addresses, reports to one instance (its
    name's hash), and deployments spread over the instances: a deployment's window is kept
    by the instance it reports to, not by all of them."""
    servers = [ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start() for _ in range(3)]
    addresses = [s.address for s in servers]
    names = [f"dep-{i}" for i in range(12)]
    try:
        with ServiceClient(addresses, timeout_s=15) as client:
            for name in names:
                client.create_deployment(name, TOPO)
        used: dict[str, set[str]] = {}
        for name in names:
            for rank in (0, 3):
                with LoadReporter(addresses, name, rank=rank, topology=TOPO, interval_s=0.02) as reporter:
                    reporter.add(np.ones((4, 16)))
                    assert reporter.flush(10)
                    used.setdefault(name, set()).add(reporter.stats().address)
    finally:
        for s in servers:
            s.stop()
    assert all(len(a) == 1 for a in used.values()), used
    assert len({a for s in used.values() for a in s}) == 3  # twelve names land on all three
