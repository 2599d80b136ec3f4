"""One instance's live view of a deployment's placements, fanned out to its watchers.

A single task per deployment follows the store (on Redis: tails the announce stream from its
last seen id) and keeps the recent versions in a ring; every watcher of this instance reads
from the ring, so store traffic does not grow with the number of watchers.

A watcher holds no queue of its own: it is handed the next placement only once its stream took
the last one (gRPC completed the write). One that keeps up gets every version in order; one
whose stream has held a placement unsent for ``STALL_S`` (a client that does not read) is
stalled: the versions published meanwhile are not queued for it, and once it reads again it
gets the newest, skipping those in between (latest-wins; the version numbers show the gap).
So a stalled watcher costs at most the one placement its stream holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from .errors import NotFound, ServiceError
from .store import PLACEMENTS_KEPT, Store

__all__ = ["STALL_S", "PlacementHub"]

log = logging.getLogger(__name__)

# A watcher whose stream has not taken its last placement for this long is stalled: versions
# published from then on are coalesced into the newest. Below it, a burst of versions (a
# follower catching up after a store outage) still reaches a watcher mid-write in order.
STALL_S = 1.0


class _Watcher:
    """Where one watcher stands: ``in_order_to``, the newest version published while it kept up
    (it gets every version up to that one in order); ``writing_since``, when its stream was
    handed the placement it has not taken yet (None: it has taken it)."""

    __slots__ = ("in_order_to", "writing_since")

    def __init__(self, in_order_to: int) -> None:
        self.in_order_to = in_order_to
        self.writing_since: float | None = None


class PlacementHub:
    """Latest placements of deployment ``name``; ``ring`` recent versions, newest last."""

    def __init__(
        self,
        store: Store,
        name: str,
        on_version: Callable[[pb.Placement], None] | None = None,
        confirm_deleted: Callable[[], Awaitable[bool]] | None = None,
        gen: int = 0,
    ) -> None:
        self.store = store
        self.name = name
        self.gen = gen
        self.ring: OrderedDict[int, pb.Placement] = OrderedDict()
        self.live = False
        self.deleted = False
        self._on_version = on_version
        self._confirm_deleted = confirm_deleted
        self._changed = asyncio.Condition()
        self._task: asyncio.Task | None = None
        self._closed = False
        self._watchers: set[_Watcher] = set()

    @property
    def latest(self) -> pb.Placement | None:
        return next(reversed(self.ring.values())) if self.ring else None

    @property
    def version(self) -> int:
        return next(reversed(self.ring)) if self.ring else 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"hub-{self.name}")

    async def stop(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            # The flag ends the loop even if a client library swallowed the cancellation.
            await asyncio.wait({self._task}, timeout=2.0)
        await self._wake()

    async def _wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _follow(self) -> None:
        backoff = 0.05
        while not self._closed:
            try:
                async for placement in self.store.follow(self.name, self.version, self.gen):
                    self.live = True
                    backoff = 0.05
                    self._add(placement)
                    await self._wake()
            except NotFound:
                # Gone, unless the store restarted empty and the balancer just wrote it back.
                if self._confirm_deleted is not None and not await self._confirm_deleted():
                    self.live = False
                    await asyncio.sleep(backoff)
                    continue
                self.deleted, self.live = True, False
                await self._wake()
                return
            except ServiceError as exc:
                # Store down: keep what we have and resume from the last version seen.
                if self.live:
                    log.warning("following %s paused: %s", self.name, exc)
                self.live = False
                await self._wake()
                await asyncio.sleep(backoff)
                backoff = min(1.0, backoff * 2)

    def _add(self, placement: pb.Placement) -> None:
        self.ring[placement.version] = placement
        while len(self.ring) > PLACEMENTS_KEPT:
            self.ring.popitem(last=False)
        now = time.monotonic()
        for w in self._watchers:
            if w.writing_since is None or now - w.writing_since < STALL_S:
                w.in_order_to = placement.version
        if self._on_version is not None:
            self._on_version(placement)

    async def ready(self, timeout: float) -> pb.Placement:
        """The latest placement once the follower has one; raises NotFound if deleted."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.ring or self.deleted), timeout)
        if self.deleted:
            raise NotFound(f"deployment {self.name!r} not found")
        return self.latest  # type: ignore[return-value]  # not None: the wait ended with one in the ring

    async def watch(self, since_version: int) -> AsyncIterator[pb.Placement]:
        """The latest version (or, resuming, the one after ``since_version``), then each new one in
        order while the caller keeps up; after a stall (module doc) the newest, skipping.

        The caller takes each placement before asking for the next (an async generator's
        consumer), so this holds no backlog per watcher. A resuming watcher whose next version is
        not in the ring (this instance started after it was published) gets it from the store,
        which keeps ``PLACEMENTS_KEPT`` versions; only one whose next version left the store too
        gets the latest instead of a backlog.
        """
        sent = since_version
        w = _Watcher(self.version if since_version else 0)
        self._watchers.add(w)
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: self.deleted or self.version > sent)
                if self.deleted:
                    raise NotFound(f"deployment {self.name!r} was deleted")
                nxt = None
                if sent and sent < w.in_order_to:
                    nxt = self.ring.get(sent + 1) or await self._from_store(sent + 1)
                nxt = nxt or self.latest
                sent = nxt.version
                w.writing_since = time.monotonic()
                yield nxt
                w.writing_since = None
        finally:
            self._watchers.discard(w)

    async def _from_store(self, version: int) -> pb.Placement | None:
        """``version`` from the store when it is still kept there, else None (then: the latest)."""
        if version > self.version or version <= self.version - PLACEMENTS_KEPT:
            return None
        try:
            placement = await self.store.placement(self.name, version)
        except ServiceError:  # gone from the store, or the store is down: the latest is all we have
            return None
        return placement if placement.version == version else None
