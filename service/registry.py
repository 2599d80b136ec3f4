"""``Registry``: the deployments this instance follows, and their recovery after the store
restarted empty.

Every instance follows every deployment (:meth:`Registry.refresh`), so it can serve, plan and
restore all of them; a deployment's instance-local state is a :class:`.local.LocalDeployment`,
and the latest placement this instance saw of it is kept (:meth:`Registry.seen`). When the
store restarted empty (a Redis restart without persistence: a new ``run_id``), the registry
writes back what it knows, so committed versions survive and a deployment it follows is never
NOT_FOUND (:meth:`Registry.check_health`, :meth:`Registry.confirm_deleted`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from . import codec, validation
from .errors import NotFound, ServiceError, StoreUnavailable
from .hub import PlacementHub
from .local import LocalDeployment
from .metrics import Metrics
from .store import Store
from .store_health import StoreHealth
from .windows import make_window

__all__ = ["Registry"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class Registry:
    """Owns ``local`` (name → :class:`.local.LocalDeployment`; the others read it, only the
    registry adds or removes) and the latest placement seen per deployment."""

    def __init__(self, store: Store, metrics: Metrics, health: StoreHealth) -> None:
        self.store = store
        self.metrics = metrics
        self.health = health
        self.local: dict[str, LocalDeployment] = {}
        self._latest: dict[str, pb.Placement] = {}

    def latest(self, name: str) -> pb.Placement | None:
        """The newest placement of ``name`` this instance saw (published, followed or created)."""
        return self._latest.get(name)

    async def refresh(self) -> None:
        """Follows every deployment, so this instance can plan, restore and serve all of them.
        Reads the index and only the records of names it does not follow yet: re-reading every
        record each round cost an idle instance a core's tenth per hundred deployments."""
        for name in await self.store.names():
            if name in self.local:
                continue
            try:
                record = await self.store.get(name)
            except NotFound:
                continue  # deleted since the index was read
            except StoreUnavailable:
                continue  # its Redis Cluster master is down: adopted once it answers
            if name not in self.local:  # (another call may have adopted it meanwhile)
                self.adopt(record.deployment)

    def adopt(self, deployment: pb.Deployment) -> LocalDeployment:
        """Starts following ``deployment`` (its window, its placement follower)."""
        name = deployment.name
        topo = validation.topology_from(deployment.topology, "deployment.topology")
        spec = codec.window_spec(deployment)
        gen = deployment.create_time.ToNanoseconds()
        hub = PlacementHub(
            self.store, name, on_version=self.seen, gen=gen, confirm_deleted=lambda: self.confirm_deleted(name, gen)
        )
        local = LocalDeployment(
            deployment,
            topo,
            spec,
            codec.trigger_spec(deployment),
            make_window((topo.num_layers, topo.num_experts), spec),
            hub,
            frozenset(codec.deployment_ranks(deployment)),
            suspect_after_s=codec.suspect_after_s(deployment),
        )
        self.local[name] = local
        hub.start()
        return local

    def seen(self, placement: pb.Placement) -> None:
        """``placement`` was published or followed: the latest one if newer, and its gauges."""
        name = placement.deployment
        if name in self.local and placement.version > self._latest.get(name, pb.Placement()).version:
            self._latest[name] = placement
            self.metrics.version.labels(name).set(placement.version)
            self.metrics.imbalance.labels(name).set(placement.stats.imbalance_after or placement.stats.imbalance_before)

    def forget(self, name: str) -> None:
        """Stops following ``name`` (deleted, or about to be re-created) and drops its series."""
        local = self.local.pop(name, None)
        self._latest.pop(name, None)
        if local is not None:
            asyncio.create_task(local.hub.stop())
        self.metrics.forget(name)

    async def get(self, name: str) -> LocalDeployment:
        """``name``'s local state, following it first if this instance does not yet (NOT_FOUND
        when the store does not have it)."""
        local = self.local.get(name)
        if local is not None and local.hub.deleted:
            self.forget(name)
            local = None
        if local is None:
            record = await self.known(name, lambda: self.store.get(name))
            local = self.local.get(name) or self.adopt(record.deployment)
        return local

    async def known(self, name: str, call: Callable[[], Awaitable[_T]]) -> _T:
        """``call()``; if the store says NOT_FOUND for a deployment this instance follows, checks
        whether the store restarted empty (then writes everything back) and asks again."""
        try:
            return await call()
        except NotFound:
            if name not in self.local or await self.confirm_deleted(name):
                raise
            return await call()

    # recovery

    async def check_health(self) -> None:
        """Pings the store: its health, the deployments whose part of it is down, and the
        write-back when it restarted empty."""
        run_id = await self.health.ping()
        if run_id is None:
            self.health.set_health(False)
            return
        if self.health.restarted(run_id):
            await self.restore_all(run_id)
        self.health.saw_run(run_id)
        self.health.set_health(True)
        self.health.set_down(self.store.down(list(self.local)), self.local)

    async def restore_all(self, run_id: str) -> None:
        """The store restarted empty: write back every deployment's latest placement we know."""
        for name, local in list(self.local.items()):
            latest = self._latest.get(name)
            if latest is not None and await self.store.restore(local.deployment, latest):
                log.warning("restored deployment %s at version %d after a store restart", name, latest.version)
        self.health.saw_run(run_id)

    async def confirm_deleted(self, name: str, gen: int = 0) -> bool:
        """``name`` looked missing: True if it is really gone (deleted, or re-created as another
        generation than ``gen``); False if the store is unreachable, or restarted empty (then
        everything this instance knows is written back first) and the deployment is there."""
        run_id = await self.health.ping()
        if run_id is None:
            return False
        if self.health.restarted(run_id):
            await self.restore_all(run_id)
        try:
            record = await self.store.get(name)
        except NotFound:
            return True
        except ServiceError:
            return False
        return bool(gen) and record.deployment.create_time.ToNanoseconds() != gen
