"""The engine client across service restarts and replica failover (Redis-backed replicas)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import eplb
from eplb_engine.client import ServiceClient
from eplb_engine.reporter import LoadReporter
from eplb_engine.watcher import PlacementWatcher
from svc_thread import REDIS_URL, ServerThread

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


def test_restart_mid_stream_loses_nothing_and_counts_nothing_twice(prefix):
    server = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()
    seen: list[int] = []
    with ServiceClient(server.address, timeout_s=15) as client:
        client.create_deployment("d1", TOPO)
        reporter = LoadReporter(server.address, "d1", rank=0, topology=TOPO, interval_s=0.02)
        watcher = PlacementWatcher(server.address, "d1", lambda p: seen.append(p.version), rank=0)
        steps = Steps(reporter)
        assert watcher.wait_for(1)
        time.sleep(0.3)
        server.stop(grace_s=1.0)
        time.sleep(0.5)  # reports pile up in the outbox while the service is away
        assert reporter.stats().pending >= 1
        server.start()
        client.rebalance("d1", force=True)
        assert watcher.wait_for(2, timeout_s=15)
        time.sleep(0.3)
        steps.stop()
        assert reporter.flush(15)
        stats = reporter.stats()
        reporter.close()
        watcher.close()
        tokens = client.rebalance("d1", dry_run=True).window_tokens
    server.stop()
    assert stats.dropped_reports == 0 and stats.rejected == 0 and stats.dropped_adds == 0
    assert tokens == pytest.approx(steps.total)
    assert seen == [1, 2] and watcher.reconnects >= 1
    assert steps.slowest < 0.05


def test_failover_between_two_replicas(prefix):
    a = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()
    b = ServerThread(redis_url=REDIS_URL, key_prefix=prefix).start()
    addresses = [a.address, b.address]
    seen: list[int] = []
    with ServiceClient(addresses, timeout_s=15) as client:
        client.create_deployment("d1", TOPO)
        reporter = LoadReporter(addresses, "d1", rank=2, topology=TOPO, interval_s=0.02)
        watcher = PlacementWatcher(addresses, "d1", lambda p: seen.append(p.version), rank=2)
        steps = Steps(reporter)
        assert watcher.wait_for(1)
        assert reporter.stats().address == a.address
        time.sleep(0.3)
        a.stop(grace_s=0.5)  # a is gone for good: everything continues through b
        client.rebalance("d1", force=True)
        assert watcher.wait_for(2, timeout_s=15)
        time.sleep(0.3)
        steps.stop()
        assert reporter.flush(15)
        stats = reporter.stats()
        reporter.close()
        watcher.close()
        tokens = client.rebalance("d1", dry_run=True).window_tokens
    b.stop()
    assert stats.address == b.address and stats.failovers >= 1
    assert stats.dropped_reports == 0 and stats.rejected == 0
    assert tokens == pytest.approx(steps.total)
    assert seen == [1, 2]
