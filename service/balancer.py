"""The balancer: one per service replica, on top of a ``Store``, composed of one room per idea:

- :mod:`.deployments`: which deployments this replica follows; create, get, list, delete,
  placements, watches and rollout acks (:mod:`.rollout` holds the rollout rules);
- :mod:`.ingest`: reports in (checks, dedup, durable acceptance), windows out (:mod:`.windows`);
- :mod:`.planner`: the trigger loop, Rebalance and ComputePlacement, under the planning lease,
  run in worker processes (:mod:`.solver`); :mod:`.trigger` decides what is published;
- :mod:`.recovery`: store health, and write-back after the store restarted empty;
- :mod:`.liveness`: when each rank was last heard from, and the suspect ones.

Background tasks (this module) flush windows, run the trigger loop, check the store's health,
follow every deployment and share the ranks' last-seen times.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from . import limits, plugins
from .deployments import Deployments, LocalDeployment
from .errors import ServiceError
from .ingest import Ingest
from .liveness import Liveness
from .metrics import Metrics
from .planner import Planner
from .recovery import Recovery
from .solver import Solver
from .store import Store

__all__ = ["Balancer", "BalancerConfig"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BalancerConfig:
    """Timings in seconds. ``lease_s`` bounds how long a crashed planner blocks the others."""

    replica_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    lease_s: float = 10.0
    flush_s: float = 1.0
    tick_s: float = 0.5
    refresh_s: float = 2.0
    # Worker processes for re-plans and for stateless ComputePlacement calls (service/solver.py);
    # 0 plans in a thread of the serving process (only to measure what the pools buy).
    plan_workers: int = limits.REPLAN_WORKERS
    compute_workers: int = limits.COMPUTE_WORKERS
    # Processes only re-plans below limits.SMALL_PLAN_CELLS take (service/solver.py); 0: none.
    small_plan_workers: int = limits.SMALL_PLAN_WORKERS
    # Processes one re-plan of a deployment (Rebalance, the trigger loop) plans its layers in
    # (the library's workers=; the plan is the same for any number). Stateless calls and dry
    # runs always plan in one, so a remote caller cannot take more than its worker's core.
    layer_workers: int = 1
    # Plugin modules whose policies deployments may name (service/plugins.py); installed
    # packages' eplb.policies entry points load as well.
    plugins: tuple[str, ...] = ()
    # The server's largest gRPC message (--max-message-bytes): a deployment whose placement
    # cannot be sent in one is refused on create (the server sets it from its own config).
    max_message_bytes: int = 16 << 20
    # How often this replica writes the times it saw ranks (reports, acks) to the store and
    # re-counts suspect ranks (service/liveness.py): another replica's view is this much old at
    # most, so it is the precision of Liveness.suspect_after (added to it as a margin).
    liveness_s: float = 1.0


class Balancer(Deployments, Ingest, Planner, Recovery, Liveness):
    """One per service replica; each room of it lives in its own module (see the module doc)."""

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
        self.healthy = True
        self._on_health = on_health
        self._on_deployment_health = on_deployment_health
        # Deployments whose part of the store is down while the rest answers (recovery.py).
        self._down: set[str] = set()
        self._local: dict[str, LocalDeployment] = {}
        self._latest: dict[str, pb.Placement] = {}
        self._run_id: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False

    # lifecycle

    async def start(self) -> None:
        with contextlib.suppress(ServiceError):
            self._run_id = await self.store.ping()
        self._tasks = [
            asyncio.create_task(self._every(self.config.flush_s, self._flush_all), name="flush"),
            asyncio.create_task(self._every(self.config.tick_s, self._trigger_all), name="trigger"),
            asyncio.create_task(self._every(self.config.tick_s, self._check_health), name="health"),
            asyncio.create_task(self._every(self.config.refresh_s, self._refresh), name="refresh"),
            asyncio.create_task(self._every(self.config.liveness_s, self._liveness_all), name="liveness"),
        ]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # The flag ends the loops even if a client library swallowed the cancellation.
            await asyncio.wait(self._tasks, timeout=2.0)
        with contextlib.suppress(ServiceError):
            await self._flush_all()
        for local in self._local.values():
            # The last second's report and ack times, so other replicas do not see them late.
            with contextlib.suppress(ServiceError):
                await self._write_seen(local)
        for local in self._local.values():
            await local.hub.stop()

    async def _every(self, seconds: float, fn: Callable[[], Awaitable[None]]) -> None:
        while not self._stopping:
            await asyncio.sleep(seconds)
            try:
                await fn()
            except ServiceError as exc:
                log.debug("%s: %s", fn.__name__, exc)
            except Exception:
                log.exception("background task %s failed", fn.__name__)
