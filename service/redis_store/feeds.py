"""Following deployments through the feeds: one blocking reader per feed wakes the followers
of the deployments its entries name (:class:`Announcements`), on one Redis and on a Redis
Cluster alike (where each of the 16 feeds has its slot, and checks go per master)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from ..errors import NotFound, StoreUnavailable
from ..store import PLACEMENTS_KEPT
from .failures import unavailable

__all__ = ["FEED_BLOCK_MS", "FEED_MAXLEN", "FEED_TTL_S", "Announcements", "Subscription", "other_generation"]

log = logging.getLogger(__name__)

# Feeds (see Announcements): a reader blocks this long per XREAD; a feed keeps about this many
# entries; a reader checks every follower of its feed this often in any case (a commit whose
# feed entry was lost: the instance died between the two), and this often while its feed's
# master does not answer (then a commit reaches watchers within about this).
FEED_BLOCK_MS = 2000
FEED_MAXLEN = 4096
_FEED_COUNT = 256
FEED_TTL_S = 600
_RECONCILE_S = 15.0
_FALLBACK_S = 0.5


def other_generation(stored: bytes | None, gen: int) -> bool:
    # Deployments written before generations were stored have none: they match any follower.
    return bool(gen) and stored is not None and int(stored) != gen


@dataclass(eq=False)
class Subscription:
    """One follower of one deployment: the newest version it was handed (0: not yet known) and
    the versions announced since."""

    name: str
    meta: str
    gen: int
    version: int = 0
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    async def next(self) -> int:
        """The next announced version; raises NotFound once the deployment is gone (deleted, or
        re-created as a new generation) and StoreUnavailable when Redis stopped answering."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class Announcements:
    """Follows every followed deployment through the feeds, so an idle deployment costs nothing.

    Every commit, create, restore and delete appends the deployment's name to its feed (one
    stream per index bucket, in the bucket's slot; one stream on one Redis). Per feed, one
    blocking ``XREAD`` on a connection of its own wakes on an entry and checks only the
    deployments it names (their ``meta``: version and generation), so the work follows what
    changes, not how many deployments there are. The feed is a hint, written after the commit
    it names: what could slip past it (an instance that died between the two, a feed whose master
    was down, a feed trimmed under a reader far behind) is caught by a full check of the feed's
    followers when its reader starts or resumes, every ``_RECONCILE_S``, and every
    ``_FALLBACK_S`` while the feed does not answer. Checks go per master (``group_of``), so a
    master that is down ends only its own deployments' followers (UNAVAILABLE; they re-follow).
    """

    def __init__(
        self,
        r: redis.Redis | RedisCluster,
        reader: Callable[[str], Awaitable[redis.Redis]],
        drop_reader: Callable[[str, bool], Awaitable[None]],
        group_of: Callable[[str], str],
        feed_down: Callable[[str], bool],
    ) -> None:
        self._r = r
        self._reader = reader
        self._drop_reader = drop_reader
        self._group_of = group_of
        self._feed_down = feed_down
        self._subs: dict[str, set[Subscription]] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._closed = False

    def subscribe(self, name: str, feed: str, meta: str, gen: int) -> Subscription:
        """Follows ``name`` from now on: subscribe before reading its current version, so that
        no commit falls between that read and the subscription."""
        sub = Subscription(name, meta, gen)
        self._subs.setdefault(feed, set()).add(sub)
        task = self._tasks.get(feed)
        if task is None or task.done():
            self._tasks[feed] = asyncio.create_task(self._run(feed), name=f"redis-feed-{feed}")
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        for subs in self._subs.values():
            subs.discard(sub)

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks.values():
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks.values(), timeout=2.0)

    async def _run(self, feed: str) -> None:
        subs = self._subs[feed]
        cursor: bytes | None = None  # None: (re)start, so check everyone once the cursor is set
        checked = 0.0
        while subs and not self._closed:
            try:
                if self._feed_down(feed):
                    # Known down (a missed ping, a timed-out call): no read waits on it.
                    raise StoreUnavailable(f"the master of {feed} is down")
                with unavailable():
                    reader = await self._reader(feed)
                    if cursor is None:
                        last = await self._watched(feed, reader.xrevrange(feed, count=1))
                        cursor = last[0][0] if last else b"0-0"
                        targets = None
                    else:
                        out = await self._watched(
                            feed, reader.xread({feed: cursor}, count=_FEED_COUNT, block=FEED_BLOCK_MS)
                        )
                        names, read = set(), 0
                        for _, items in out or []:
                            for entry_id, fields in items:
                                cursor = entry_id
                                names.add(fields.get(b"name", b"").decode())
                                read += 1
                        # A full batch: the reader may be behind a trimmed feed; check everyone.
                        targets = None if read >= _FEED_COUNT else {s for s in subs if s.name in names}
                if targets is None or time.monotonic() - checked >= _RECONCILE_S:
                    checked = time.monotonic()
                    targets = set(subs)
                await self._check(targets)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  (the feed's task must outlive any error)
                # The feed's master does not answer, or its slot moved (MOVED: the reader is
                # made anew on the slot's new master): its followers are checked directly (each
                # on its own master) every _FALLBACK_S until it answers, then once more in full
                # from a new cursor.
                if not isinstance(exc, StoreUnavailable):
                    log.info("feed %s: %s; following its deployments directly until it answers", feed, exc)
                cursor = None
                await self._drop_reader(feed, isinstance(exc, ResponseError))
                await self._check(set(subs))
                await asyncio.sleep(_FALLBACK_S)

    async def _watched(self, feed: str, call: Awaitable[object]) -> object:
        """``call`` on ``feed``'s reader, given up (StoreUnavailable) as soon as the feed's master
        is found down meanwhile: a hung master would hold a blocking read for its socket timeout."""
        task = asyncio.ensure_future(call)
        # Retrieved whatever becomes of it (a read given up fails later, on its closed connection).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_FALLBACK_S)
                if done:
                    return task.result()
                if self._feed_down(feed):
                    raise StoreUnavailable(f"the master of {feed} is down")
        finally:
            task.cancel()  # given up, or this follower's task was cancelled (the store closing)

    async def _check(self, subs: set[Subscription]) -> None:
        """Reads ``subs``' versions and generations (a pipeline per master) and hands each its
        new versions; a deleted or re-created deployment's follower gets NotFound, and those of
        a master that does not answer get StoreUnavailable (both end the follow)."""
        groups: dict[str, list[Subscription]] = {}
        for sub in subs:
            groups.setdefault(self._group_of(sub.meta), []).append(sub)
        for group in groups.values():
            try:
                with unavailable():
                    async with self._r.pipeline(transaction=False) as p:
                        for sub in group:
                            p.hmget(sub.meta, "gen", "version")
                        out = await p.execute()
            except (RedisError, OSError, StoreUnavailable) as exc:
                for sub in group:
                    self.unsubscribe(sub)
                    sub.queue.put_nowait(StoreUnavailable(f"redis unavailable: {exc}"))
                continue
            for sub, (gen, version) in zip(group, out, strict=True):
                if version is None or other_generation(gen, sub.gen):
                    self.unsubscribe(sub)
                    sub.queue.put_nowait(NotFound(f"deployment {sub.name!r} was deleted"))
                    continue
                v = int(version)
                if v > sub.version:
                    # Every version since the last handed (the follower reads each in order, or
                    # jumps to the latest where one left the store); only the current when new.
                    for x in range(max(sub.version + 1, v - PLACEMENTS_KEPT + 1) if sub.version else v, v + 1):
                        sub.queue.put_nowait(x)
                    sub.version = v
