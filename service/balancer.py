"""The balancer: one per service instance, on top of a ``Store``. It builds one collaborator per
room, each handed the ones it uses (dependencies run one way, top to bottom), and runs their
background loops:

- :mod:`.store_health` ``StoreHealth(store)``: reachable or not, the deployments whose part of
  the store is down, the store's run id;
- :mod:`.registry` ``Registry(store, metrics, health)``: the deployments this instance follows
  and their local state (:mod:`.local`), and the write-back after the store restarted empty;
- :mod:`.ingest` ``Ingest(registry, store, …)``: reports in (checks, dedup, durable
  acceptance), windows out (:mod:`.windows`);
- :mod:`.liveness` ``Liveness(registry, store, …)``: when each rank was last heard from, and
  the suspect ones;
- :mod:`.planner` ``Planner(registry, ingest, solver, …)``: the trigger loop, Rebalance and the
  survivor plans, under the planning lease, in worker processes (:mod:`.solver`);
  :mod:`.trigger` decides what is published;
- :mod:`.compute` ``Compute(solver)``: stateless ComputePlacement calls;
- :mod:`.deployments` ``Deployments(registry, …, planner)``: create, get, list, delete,
  placements, watches, acks and SetRanksDown (:mod:`.rollout` holds the rollout rules).

The servicer calls the collaborator each RPC needs. Background tasks (this module) flush
windows, run the trigger loop, check the store's health, follow every deployment and share
the ranks' last-seen times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from . import plugins
from .compute import Compute
from .config import BalancerConfig
from .deployments import Deployments
from .errors import ServiceError
from .ingest import Ingest
from .liveness import Liveness
from .metrics import Metrics
from .planner import Planner
from .registry import Registry
from .solver import Solver
from .store import Store
from .store_health import StoreHealth

__all__ = ["Balancer", "BalancerConfig"]

log = logging.getLogger(__name__)


class Balancer:
    """One per service instance: builds the collaborators (see the module doc) and runs the loops."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics | None = None,
        config: BalancerConfig | None = None,
        on_health: Callable[[bool], None] | None = None,
        on_deployment_health: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics or Metrics()
        self.config = config or BalancerConfig()
        added = plugins.load(self.config.plugins)
        if added:
            log.info("plugin policies: %s", ", ".join(added))
        self.solver = Solver(
            self.config.plan_workers,
            self.config.compute_workers,
            self.config.plugins,
            small_workers=self.config.small_plan_workers,
        )
        self.health = StoreHealth(store, on_health, on_deployment_health)
        self.registry = Registry(store, self.metrics, self.health)
        self.ingest = Ingest(
            self.registry, store, self.health, self.metrics, self.config.replica_id, self.config.report_linger_s
        )
        self.liveness = Liveness(self.registry, store, self.metrics, self.config.liveness_s)
        self.planner = Planner(self.registry, self.ingest, self.solver, store, self.health, self.metrics, self.config)
        self.compute = Compute(self.solver)
        self.deployments = Deployments(
            self.registry, store, self.health, self.liveness, self.planner, self.metrics, self.config
        )
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    @property
    def healthy(self) -> bool:
        """Whether the store answers (``StoreHealth.healthy``; the server sets it at start)."""
        return self.health.healthy

    @healthy.setter
    def healthy(self, ok: bool) -> None:
        self.health.healthy = ok

    # lifecycle

    async def start(self) -> None:
        await self.health.start()
        loops = (
            ("flush", self.config.flush_s, self.ingest.flush_all),
            ("trigger", self.config.tick_s, self.planner.trigger_all),
            ("health", self.config.tick_s, self.registry.check_health),
            ("refresh", self.config.refresh_s, self.registry.refresh),
            ("liveness", self.config.liveness_s, self.liveness.run),
        )
        if self.config.reads_only:
            # No windows to flush and no plans to trigger: the instances that take reports do both.
            loops = tuple(loop for loop in loops if loop[0] not in ("flush", "trigger"))
        self._tasks = [asyncio.create_task(self._every(s, fn), name=name) for name, s, fn in loops]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # The flag ends the loops even if a client library swallowed the cancellation.
            await asyncio.wait(self._tasks, timeout=2.0)
        await self.planner.stop()
        with contextlib.suppress(ServiceError):
            await self.ingest.flush_all()
        for local in self.registry.local.values():
            # The last second's report and ack times, so other instances do not see them late.
            with contextlib.suppress(ServiceError):
                await self.liveness.write_seen(local)
        for local in self.registry.local.values():
            await local.hub.stop()

    async def _every(self, seconds: float, fn: Callable[[], Awaitable[None]]) -> None:
        while not self._stopping:
            await asyncio.sleep(seconds)
            try:
                await fn()
            except ServiceError as exc:
                log.debug("%s: %s", fn.__qualname__, exc)
            except Exception:
                log.exception("background task %s failed", fn.__qualname__)
