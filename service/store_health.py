"""The store's health as this instance sees it: reachable or not (gRPC health ``SERVING`` or
``NOT_SERVING``), the deployments whose part of the store is down while the rest answers (a
Redis Cluster master), and the store's ``run_id``, which changes when it restarted empty.

It only holds and reports that state; :class:`.registry.Registry` pings the store, notices a
restart and writes back what this instance knows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable

from .errors import ServiceError, StoreUnavailable
from .store import Store

__all__ = ["StoreHealth"]

log = logging.getLogger(__name__)


class StoreHealth:
    """``on_health(ok)``: the whole store's health changed; ``on_deployment_health(name, ok)``:
    one deployment's (its part of the store down or back)."""

    def __init__(
        self,
        store: Store,
        on_health: Callable[[bool], None] | None = None,
        on_deployment_health: Callable[[str, bool], None] | None = None,
    ) -> None:
        self.store = store
        self.healthy = True
        self._on_health = on_health
        self._on_deployment_health = on_deployment_health
        # Deployments whose part of the store is down while the rest answers.
        self.down: set[str] = set()
        # The store's run id when last pinged; None before it first answered (read-only outside).
        self.run_id: str | None = None

    async def start(self) -> None:
        """Learns the store's run id (left None when it does not answer yet)."""
        with contextlib.suppress(ServiceError):
            self.run_id = await self.store.ping()

    async def ping(self) -> str | None:
        """The store's run id now; None when it does not answer."""
        try:
            return await self.store.ping()
        except ServiceError:
            return None

    def restarted(self, run_id: str) -> bool:
        """Whether ``run_id`` says the store restarted (empty) since it was last pinged."""
        return self.run_id is not None and run_id != self.run_id

    def saw_run(self, run_id: str) -> None:
        """The store answered with ``run_id`` (after the write-back, when it had restarted)."""
        self.run_id = run_id

    def check_writable(self) -> None:
        """Fails at once while the store is known to be down, rather than after its timeouts:
        reports, creates, deletes, acks and plans (reads are served from memory where they can)."""
        if not self.healthy:
            raise StoreUnavailable("the store is unreachable (this instance's health is NOT_SERVING); retry later")

    def set_health(self, ok: bool) -> None:
        if ok != self.healthy:
            log.warning("store %s", "reachable again" if ok else "unreachable")
            self.healthy = ok
            if self._on_health is not None:
                self._on_health(ok)

    def set_down(self, down: set[str], followed: Iterable[str]) -> None:
        """Deployments whose part of the store is down while the rest answers (a Redis Cluster
        master): health NOT_SERVING for ``<service>/<deployment>`` of those, the rest of
        ``followed`` SERVING."""
        if down != self.down:
            if down:
                log.warning("store partly down: deployments %s unavailable", ", ".join(sorted(down)))
            else:
                log.warning("store whole again")
            if self._on_deployment_health is not None:
                for name in self.down | down | set(followed):
                    self._on_deployment_health(name, name not in down)
            self.down = down
