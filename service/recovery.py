"""Recovery: the store's health, and writing back what this replica knows when the store
restarted empty (a Redis restart without persistence: a new ``run_id``), so committed versions
survive and a deployment this replica follows is never NOT_FOUND.
"""

from __future__ import annotations

import logging

from .errors import NotFound, ServiceError

__all__ = ["Recovery"]

log = logging.getLogger(__name__)


class Recovery:
    """Mixin of :class:`.balancer.Balancer`: store health and write-back after an empty restart."""

    async def _check_health(self) -> None:
        try:
            run_id = await self.store.ping()
        except ServiceError:
            self._set_health(False)
            return
        if self._run_id is not None and run_id != self._run_id:
            await self._restore_all(run_id)
        self._run_id = run_id
        self._set_health(True)
        self._set_down(self.store.down(list(self._local)))

    def _set_down(self, down: set[str]) -> None:
        """Deployments whose part of the store is down while the rest answers (a Redis Cluster
        master): health NOT_SERVING for ``<service>/<deployment>`` of those, the rest SERVING."""
        if down != self._down:
            if down:
                log.warning("store partly down: deployments %s unavailable", ", ".join(sorted(down)))
            else:
                log.warning("store whole again")
            if self._on_deployment_health is not None:
                for name in self._down | down | set(self._local):
                    self._on_deployment_health(name, name not in down)
            self._down = down

    def _set_health(self, ok: bool) -> None:
        if ok != self.healthy:
            log.warning("store %s", "reachable again" if ok else "unreachable")
            self.healthy = ok
            if self._on_health is not None:
                self._on_health(ok)

    async def _restore_all(self, run_id: str) -> None:
        """The store restarted empty: write back every deployment's latest placement we know."""
        for name, local in list(self._local.items()):
            latest = self._latest.get(name)
            if latest is not None and await self.store.restore(local.deployment, latest):
                log.warning("restored deployment %s at version %d after a store restart", name, latest.version)
        self._run_id = run_id

    async def _confirm_deleted(self, name: str, gen: int = 0) -> bool:
        """``name`` looked missing: True if it is really gone (deleted, or re-created as another
        generation than ``gen``); False if the store is unreachable, or restarted empty (then
        everything this replica knows is written back first) and the deployment is there."""
        try:
            run_id = await self.store.ping()
        except ServiceError:
            return False
        if self._run_id is not None and run_id != self._run_id:
            await self._restore_all(run_id)
        try:
            record = await self.store.get(name)
        except NotFound:
            return True
        except ServiceError:
            return False
        return bool(gen) and record.deployment.create_time.ToNanoseconds() != gen
