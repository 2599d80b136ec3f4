"""Redis ``Store`` (redis-py asyncio), shared by every service instance.

The keys, their types and what they hold are :mod:`.keys`'s table.

On Redis Cluster (``redis+cluster://`` seed nodes, :mod:`eplb_service.cluster`) no command names keys of
two slots: the deployments index is 16 buckets (listed one by one; their sizes are cached, so
the deployment-count limit still holds while a bucket's master is down), each bucket has its
feed (one blocking reader each: see :mod:`.feeds`), and the store's run id
is one per master, so a master that restarted empty gets its deployments written back while
the others are untouched. A master that stops answering fails the calls on the deployments of
its slots at once (``StoreUnavailable``, naming it) until it answers again, from the first call
on it that timed out or the first ping it missed; the others go on.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import (
    ClusterDownError,
    MasterDownError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

from ..cluster import parse_cluster_url
from ..errors import Aborted, AlreadyExists, NotFound, StoreUnavailable
from ..rollout import RankState, Rollout
from ..store import (
    PLACEMENTS_KEPT,
    AcceptCall,
    Accepted,
    DeploymentRecord,
    PlanMarks,
    Seen,
    all_or_nothing,
    created_seconds,
)
from .cluster import CLUSTER_UNREACHABLE, Masters, cluster_client
from .failures import no_retry, retry, timed_out, unavailable
from .feeds import FEED_BLOCK_MS, FEED_MAXLEN, FEED_TTL_S, Announcements, other_generation
from .keys import Keys
from .lua import Script

__all__ = ["RedisStore"]

log = logging.getLogger(__name__)

ANNOUNCE_MAXLEN = 64
# The shard name of one Redis (a Redis Cluster's are its masters' host:port).
_ONE_REDIS = "redis"
POOL_CONNECTIONS = 32


def generation(deployment: pb.Deployment) -> int:
    """A deployment's generation: its create time in nanoseconds (re-creating gives a new one)."""
    return deployment.create_time.ToNanoseconds()


class RedisStore:
    """Implements :class:`.store.Store` on one Redis URL or a Redis Cluster's seed nodes
    (``redis+cluster://``, ``rediss+cluster://``; see :mod:`eplb_service.cluster`)."""

    def __init__(self, url: str, prefix: str = "eplb") -> None:
        self.prefix = prefix
        self.cluster = parse_cluster_url(url) is not None
        self.keys = Keys(prefix, self.cluster)
        # Shards that did not answer the last ping, or a call since (a socket timeout): Redis
        # Cluster masters (host:port), or "redis" for one Redis (a call timed out: its failed
        # pings are the store's health); and each master's run id.
        self._down: set[str] = set()
        # Shard → when a call on it last timed out (loop time): down until a later ping answers.
        self._hung_at: dict[str, float] = {}
        self._run_ids: dict[str, str] = {}
        # Index bucket → its last known names (Redis Cluster: a bucket's master may be down).
        self._index_cache: dict[str, set[str]] = {}
        self._url = url
        if self.cluster:
            self._r: redis.Redis | RedisCluster = cluster_client(url, prefix, POOL_CONNECTIONS)
            masters = Masters(self._r, url, prefix)
            # The cluster's masters: None on one Redis.
            self._masters: Masters | None = masters
            group_of: Callable[[str], str] = masters.of
        else:
            # A bounded pool that makes callers wait for a free connection rather than fail: an
            # instance holds at most POOL_CONNECTIONS + 1 (the feed's reader) connections,
            # however many deployments and calls it serves.
            self._r = redis.Redis.from_pool(
                redis.BlockingConnectionPool.from_url(
                    url,
                    max_connections=POOL_CONNECTIONS,
                    timeout=2.0,
                    client_name=f"eplb:{prefix}",
                    socket_connect_timeout=1.0,
                    # No call on this pool blocks (the feed's reader has its own connection): a
                    # hung Redis costs a call at most about this long.
                    socket_timeout=1.0,
                    retry=retry(),
                    health_check_interval=0,
                )
            )
            group_of = lambda _: _ONE_REDIS  # noqa: E731
            self._masters = None
        # Feed → the connection of its own its reader blocks on (one per feed: the connections
        # an instance holds do not grow with its deployments).
        self._readers: dict[str, redis.Redis] = {}
        self._feed_writes: set[asyncio.Task] = set()
        self._announcements = Announcements(
            self._r, self._feed_reader, self._drop_feed_reader, group_of, self._feed_master_down
        )
        script = functools.partial(Script, self._r)
        self._create = script("create")
        self._publish = script("publish")
        self._accept = script("accept")
        self._ack = script("ack")
        self._release = script("release")
        self._renew = script("renew")
        self._put_window = script("put_window")
        self._seen = script("seen")

    async def _feed_reader(self, feed: str) -> redis.Redis:
        """The connection ``feed``'s reader blocks on: its own, to the feed's master."""
        client = self._readers.get(feed)
        if client is not None:
            return client
        timeout = FEED_BLOCK_MS / 1000 + 3.0
        if not self.cluster:
            client = redis.Redis.from_url(
                self._url,
                socket_connect_timeout=1.0,
                socket_timeout=timeout,
                health_check_interval=0,
                max_connections=1,
                client_name=f"eplb:{self.prefix}",
                # No retries: a failed read falls back to direct checks at once (redis-py's
                # default retried ten times, holding the followers meanwhile).
                retry=no_retry(),
            )
        else:
            client = await self._masters.reader(feed, timeout)
        self._readers[feed] = client
        return client

    async def _drop_feed_reader(self, feed: str, moved: bool = False) -> None:
        """Closes ``feed``'s reader after an error; the next is made anew. ``moved`` (an error
        answer, as MOVED after a reshard or a failover): the slot map is read again first, so
        the next reader goes to the slot's master now."""
        client = self._readers.pop(feed, None)
        if client is not None:
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()
        if moved and self._masters is not None:
            await self._masters.refresh()

    def _feed_master_down(self, feed: str) -> bool:
        """Whether ``feed``'s master is known down (Redis Cluster: a missed ping or a timed-out
        call; one Redis: the store's own health decides, as for every call)."""
        if not self.cluster or not self._down or not self._masters.mapped:
            return False
        return self._masters.of(feed) in self._down

    async def _announce(self, name: str) -> None:
        """Appends ``name`` to its feed after a commit, create, restore or delete, in the
        background: a hint only (:mod:`.feeds`), so the call that committed does not wait
        for it (the feed may live on another master, down or hung), and a failure is caught by
        the readers' checks."""
        feed = self.keys.feed_of(name)
        if self._feed_master_down(feed):
            return  # its readers check every follower every feeds._FALLBACK_S meanwhile
        task = asyncio.create_task(self._xadd_feed(feed, name), name=f"feed-{name}")
        self._feed_writes.add(task)
        task.add_done_callback(self._feed_writes.discard)

    async def _xadd_feed(self, feed: str, name: str) -> None:
        try:
            with unavailable():
                # The feed expires once nothing happened for FEED_TTL_S: a prefix whose
                # deployments were all deleted leaves no key behind for long.
                async with self._r.pipeline(transaction=False) as p:
                    await (
                        p.xadd(feed, {"name": name}, maxlen=FEED_MAXLEN, approximate=True)
                        .expire(feed, FEED_TTL_S)
                        .execute()
                    )
        except (StoreUnavailable, RedisError) as exc:
            log.debug("feed entry of %s not written (%s): readers catch it at their next check", name, exc)

    def down(self, names: list[str]) -> set[str]:
        if not self.cluster or not self._down or not self._masters.mapped:
            return set()
        return {n for n in names if self._masters.of(self.keys.of(n, "meta")) in self._down}

    @property
    def degraded(self) -> str | None:
        """What is down while the rest answers (Redis Cluster: masters that missed the last ping)."""
        if not self.cluster or not self._down:
            return None
        return f"redis cluster master(s) down: {', '.join(sorted(self._down))}"

    def _shard_down(self, shard: str, name: str) -> StoreUnavailable:
        if shard == _ONE_REDIS:
            return StoreUnavailable("redis unavailable: it did not answer a call in time; retry later")
        return StoreUnavailable(f"redis cluster master {shard}, which holds deployment {name!r}, is down; retry later")

    @contextlib.contextmanager
    def _on(self, name: str) -> Iterator[None]:
        """``unavailable`` for a call on deployment ``name``; fails at once while its shard is
        down (on Redis Cluster the master of ``name``'s slot, named: it missed the last ping;
        either kind: a call on it timed out since), and a timeout marks its shard down."""
        shard = _ONE_REDIS
        if self.cluster:
            shard = self._masters.of(self.keys.of(name, "meta")) if self._masters.mapped else None
        if shard in self._down:
            raise self._shard_down(shard, name)
        try:
            with unavailable():
                yield
        except StoreUnavailable as exc:
            if shard is not None:
                self._note_timeout(shard, exc)
            raise

    def _note_timeout(self, shard: str, exc: BaseException) -> None:
        """A call on ``shard`` (a Redis Cluster master, or one Redis) failed with ``exc``: a
        socket timeout marks the shard down until a ping that starts later answers, so that the
        calls after it (the next store call of the same RPC, the reports queued behind it) fail
        at once instead of each waiting its own timeout on a hung Redis."""
        if timed_out(exc):
            self._hung_at[shard] = asyncio.get_running_loop().time()
            self._down.add(shard)

    async def ping(self) -> str:
        if not self.cluster:
            asked_at = asyncio.get_running_loop().time()
            with unavailable():
                info = await self._r.info("server")
            # A call that timed out after this ping asked keeps it down until the next ping.
            if self._hung_at.get(_ONE_REDIS, asked_at - 1) < asked_at:
                self._hung_at.pop(_ONE_REDIS, None)
                self._down.discard(_ONE_REDIS)
            return str(info.get("run_id", ""))
        await self._masters.initialized()
        masters = self._masters.primaries()
        down = set()
        asked: dict[str, float] = {}
        loop = asyncio.get_running_loop()
        for master in masters:  # one at a time, as in _names
            asked[master.name] = loop.time()
            try:
                info = await self._masters.ping_client(master).info("server")
            except (RedisError, OSError):
                down.add(master.name)
            else:
                self._run_ids[master.name] = str(info.get("run_id", ""))
        # A master a call found hung after this ping asked it stays down until the next ping.
        down |= {m for m, at in self._hung_at.items() if m in asked and at >= asked[m]}
        self._hung_at = {m: at for m, at in self._hung_at.items() if m in down}
        self._down = down
        if len(down) == len(masters):
            raise StoreUnavailable(f"redis unavailable: no cluster master answers ({', '.join(sorted(down))})")
        # One id per master, a down one's as last seen: a master that restarted empty changes
        # the id (its deployments are written back; the others' restores find their versions).
        return ",".join(f"{m}={run_id}" for m, run_id in sorted(self._run_ids.items()))

    async def _write(self, deployment: pb.Deployment, placement: pb.Placement, only_if_newer: bool) -> bool:
        name = deployment.name
        if only_if_newer and self.cluster and self._down and self._masters.of(self.keys.of(name, "meta")) in self._down:
            # A restore (after a master restarted empty) skips masters that are down (only
            # Redis Cluster has some down and others up): one that comes back empty has a new
            # run id and triggers its own restore.
            return False
        with self._on(name):
            written = await self._create(
                keys=[
                    self.keys.of(name, "meta"),
                    self.keys.of(name, "deployment"),
                    self.keys.placement(name, placement.version),
                    self.keys.of(name, "announce"),
                    self.keys.of(name, "seen"),
                ],
                args=[
                    placement.version,
                    deployment.SerializeToString(),
                    placement.SerializeToString(),
                    ANNOUNCE_MAXLEN,
                    # A new deployment counts as planned at its creation (the trigger's interval
                    # runs from there), exactly its create_time: a later plan time says it was
                    # planned since (DeploymentStatus.last_plan_time).
                    time.time() if only_if_newer else created_seconds(deployment),
                    int(only_if_newer),
                    generation(deployment),
                ],
            )
        if written or only_if_newer:
            # A restore indexes the name even when the data was there: on Redis Cluster the
            # index bucket may have been on the master that restarted empty.
            try:
                with unavailable():
                    await self._r.sadd(self.keys.index_of(name), name)
            except StoreUnavailable:
                if not only_if_newer:
                    # Not listed, so no other instance would follow it: undo, and let the caller retry.
                    with contextlib.suppress(StoreUnavailable), unavailable():
                        await self._r.delete(*self.keys.fixed(name), self.keys.placement(name, placement.version))
                    raise
        if written:
            await self._announce(name)
        return bool(written)

    async def create(self, deployment: pb.Deployment, placement: pb.Placement) -> None:
        if not await self._write(deployment, placement, only_if_newer=False):
            raise AlreadyExists(f"deployment {deployment.name!r} already exists")

    async def restore(self, deployment: pb.Deployment, placement: pb.Placement) -> bool:
        return await self._write(deployment, placement, only_if_newer=True)

    async def get(self, name: str) -> DeploymentRecord:
        with self._on(name):
            async with self._r.pipeline(transaction=True) as p:
                raw, version = (
                    await p.get(self.keys.of(name, "deployment")).hget(self.keys.of(name, "meta"), "version").execute()
                )
        if raw is None or version is None:
            raise NotFound(f"deployment {name!r} not found")
        return DeploymentRecord(pb.Deployment.FromString(raw), int(version))

    async def _names(self) -> set[str]:
        """Every indexed name; on Redis Cluster a bucket whose master is down gives its last
        known names (``StoreUnavailable`` only if it was never read)."""
        if self.cluster:
            # Concurrent first commands on a cluster client that is not initialized yet race
            # (redis-py: "'NoneType' object has no attribute 'writelines'").
            await self._masters.initialized()
        answers: dict[str, object] = {}
        for key in self.keys.index:
            # Checked per bucket: a bucket whose master timed out marks it down for the rest.
            master = self._masters.of(key) if self.cluster else _ONE_REDIS
            if master in self._down:
                continue
            # One at a time: concurrent commands to a master that just came back raced in
            # redis-py's cluster client ("'NoneType' object has no attribute 'writelines'").
            try:
                # unavailable also maps that race when it still happens (a master rejoining:
                # it failed Registry.refresh in the cluster chaos test under load).
                with unavailable():
                    answers[key] = await self._r.smembers(key)
            except StoreUnavailable as exc:
                answers[key] = exc
                self._note_timeout(master, exc)
        names: set[str] = set()
        for key in self.keys.index:
            members = answers.get(key, StoreUnavailable(f"the master of {key} is down"))
            if isinstance(members, (RedisError, OSError, StoreUnavailable)):
                if not self.cluster or key not in self._index_cache:
                    raise StoreUnavailable(f"redis unavailable: {members}")
                members = self._index_cache[key]
            elif isinstance(members, BaseException):
                raise members
            else:
                members = {n.decode() for n in members}
                self._index_cache[key] = members
            names |= members
        return names

    async def list(self) -> list[DeploymentRecord]:
        out = []
        for name in sorted(await self._names()):
            try:
                out.append(await self.get(name))
            except NotFound:
                continue
            except StoreUnavailable:
                if not self.cluster:
                    raise
                # Its master is down: listed again once it answers.
        return out

    async def names(self) -> builtins.list[str]:
        return sorted(await self._names())

    async def count(self) -> int:
        return len(await self._names())

    async def delete(self, name: str) -> None:
        with self._on(name):
            version = await self._r.hget(self.keys.of(name, "meta"), "version")
            if version is None:
                # A delete that lost its master between its two steps left the name indexed.
                with contextlib.suppress(StoreUnavailable), unavailable():
                    await self._r.srem(self.keys.index_of(name), name)
                raise NotFound(f"deployment {name!r} not found")
            v = int(version)
            placements = [self.keys.placement(name, i) for i in range(max(1, v - PLACEMENTS_KEPT), v + 1)]
            # One DEL of same-slot keys: atomic, and on Cluster still a single-slot command.
            await self._r.delete(*self.keys.fixed(name), *placements)
        with unavailable():
            await self._r.srem(self.keys.index_of(name), name)
        self._index_cache.get(self.keys.index_of(name), set()).discard(name)
        await self._announce(name)

    async def placement(self, name: str, version: int = 0) -> pb.Placement:
        with self._on(name):
            if not version:
                cur = await self._r.hget(self.keys.of(name, "meta"), "version")
                if cur is None:
                    raise NotFound(f"deployment {name!r} not found")
                version = int(cur)
            raw = await self._r.get(self.keys.placement(name, version))
        if raw is None:
            raise NotFound(f"deployment {name!r} has no placement version {version}")
        return pb.Placement.FromString(raw)

    async def publish(self, name: str, placement: pb.Placement) -> None:
        v = placement.version
        with self._on(name):
            before = await self._publish(
                keys=[
                    self.keys.of(name, "meta"),
                    self.keys.placement(name, v),
                    self.keys.of(name, "announce"),
                    self.keys.placement(name, v - PLACEMENTS_KEPT),
                ],
                args=[v, placement.SerializeToString(), ANNOUNCE_MAXLEN],
            )
        if before == -1:
            raise NotFound(f"deployment {name!r} not found")
        if before != v - 1:
            raise Aborted(f"version {v} is not current + 1 (current is {before}); another plan won")
        await self._announce(name)

    async def follow(self, name: str, since_version: int, gen: int = 0) -> AsyncIterator[pb.Placement]:
        # Subscribed first: a commit after the version read below is announced to this follower.
        sub = self._announcements.subscribe(name, self.keys.feed_of(name), self.keys.of(name, "meta"), gen)
        try:
            with self._on(name):
                cur, stored_gen = await self._r.hmget(self.keys.of(name, "meta"), "version", "gen")
            if cur is None or other_generation(stored_gen, gen):
                raise NotFound(f"deployment {name!r} not found")
            sub.version = max(sub.version, int(cur))
            sent = since_version
            # Resuming (a follower that lost Redis for a while): every kept version it missed,
            # in order, so no watcher sees a gap; a fresh follower starts at the current one.
            first = sent + 1 if sent else int(cur)
            for version in range(max(first, int(cur) - PLACEMENTS_KEPT + 1), int(cur) + 1):
                with contextlib.suppress(NotFound):
                    placement = await self.placement(name, version)
                    sent = placement.version
                    yield placement
            while True:
                version = await sub.next()
                if version <= sent:
                    continue
                try:
                    placement = await self.placement(name, version)
                except NotFound:
                    # Trimmed already: this follower fell far behind, so it jumps to the latest.
                    placement = await self.placement(name)
                if placement.version > sent:
                    sent = placement.version
                    yield placement
        finally:
            self._announcements.unsubscribe(sub)

    async def accept_reports(
        self,
        name: str,
        pairs: builtins.list[tuple[int, int]],
        journal: Callable[[builtins.list[bool]], bytes],
        keep_s: float,
        groups: builtins.list[int] | None = None,
    ) -> Accepted:
        (out,) = await self.accept_many([AcceptCall(name, pairs, journal, keep_s, groups)])
        if isinstance(out, Exception):
            raise out
        return out

    async def accept_many(self, calls: Sequence[AcceptCall]) -> builtins.list[Accepted | Exception]:
        results: list[Accepted | Exception | None] = [None] * len(calls)
        fresh: list[list[bool | None]] = [[True] * len(c.pairs) for c in calls]
        # Duplicates are rare (client retries): each batch goes as if all were new, and only
        # those the script finds were not go once more, with the sums of the new ones (a report
        # of several pairs only if all of them are: AcceptCall.groups).
        todo = list(range(len(calls)))
        while todo:
            now_ms = time.time() * 1000
            commands = []
            for i in todo:
                c = calls[i]
                args: list[object] = [c.journal(fresh[i]), int(now_ms - c.keep_s * 1000)]
                for (rank, seq), f in zip(c.pairs, fresh[i]):
                    if f:
                        args += [rank, seq]
                commands.append(
                    (
                        c.name,
                        [self.keys.of(c.name, "seq"), self.keys.of(c.name, "meta"), self.keys.of(c.name, "wal2")],
                        args,
                    )
                )
            answers = await self._accept_commands(commands)
            again = []
            for i, out in zip(todo, answers):
                if isinstance(out, Exception):
                    # StoreUnavailable (its master down), or a ResponseError: a bug (in a
                    # script), INTERNAL for this call's reports as from any other call.
                    results[i] = out
                elif isinstance(out, bytes):
                    results[i] = (fresh[i], out.decode())
                elif out == -1:
                    results[i] = NotFound(f"deployment {calls[i].name!r} not found")
                else:
                    flags = iter(out[1])
                    sent = fresh[i]
                    now_new = all_or_nothing([bool(f) and bool(next(flags)) for f in sent], calls[i].groups)
                    if any(n is None and f is not None for f, n in zip(sent, now_new)):
                        # A report refused now: its pairs may have made later pairs of their
                        # ranks look counted, so every pair not refused is flagged again.
                        fresh[i] = [None if n is None or f is None else True for f, n in zip(sent, now_new)]
                    else:
                        fresh[i] = [None if f is None else n for f, n in zip(sent, now_new)]
                    if any(fresh[i]):
                        again.append(i)
                    else:
                        results[i] = (fresh[i], None)
            todo = again
        return results  # type: ignore[return-value]  # every slot is set above

    def shard(self, name: str) -> str:
        if not self.cluster or not self._masters.mapped:
            return _ONE_REDIS
        return self._masters.of(self.keys.of(name, "meta"))

    async def _accept_commands(
        self, commands: builtins.list[tuple[str, builtins.list[str], builtins.list[object]]]
    ) -> builtins.list[object]:
        """``(deployment, keys, args)`` of ``accept.lua`` calls → each one's answer or exception: one
        pipeline a master (a lone call as itself). On Redis Cluster whatever fails one master's
        pipeline (down, unreachable, a slot not covered) goes to its own calls alone, the other
        masters' answers stand; on one Redis a store that does not answer raises."""
        if not self.cluster:
            if _ONE_REDIS in self._down:
                raise self._shard_down(_ONE_REDIS, commands[0][0])
            try:
                return await self._accept_pipeline(commands)
            except StoreUnavailable as exc:
                self._note_timeout(_ONE_REDIS, exc)
                raise
        answers: list[object] = [None] * len(commands)
        groups: dict[str, list[int]] = {}
        for i, (name, _, _) in enumerate(commands):
            try:
                groups.setdefault(self.shard(name), []).append(i)
            except (RedisError, RedisClusterException) as exc:  # no slot map to route it by
                answers[i] = StoreUnavailable(f"redis cluster: no master known for {name!r}'s slot ({exc})")

        async def group(master: str, idx: list[int]) -> None:
            outs: list[object]
            if master in self._down:
                outs = [
                    StoreUnavailable(
                        f"redis cluster master {master}, which holds deployment {commands[i][0]!r}, is down; retry later"
                    )
                    for i in idx
                ]
            else:
                try:
                    outs = await self._accept_pipeline([commands[i] for i in idx])
                except CLUSTER_UNREACHABLE as exc:
                    outs = [StoreUnavailable(f"redis cluster unavailable: {exc}")] * len(idx)
                except Exception as exc:  # noqa: BLE001  (this master's calls fail with it, no others)
                    outs = [exc] * len(idx)
                for out in outs:
                    if isinstance(out, BaseException):
                        self._note_timeout(master, out)
            for i, out in zip(idx, outs):
                answers[i] = out

        await asyncio.gather(*(group(m, idx) for m, idx in groups.items()))
        return answers

    async def _accept_pipeline(
        self, commands: builtins.list[tuple[str, builtins.list[str], builtins.list[object]]]
    ) -> builtins.list[object]:
        """The calls in one pipeline (one connection's round trip); each answer or its error."""
        if len(commands) == 1:
            ((_, keys, args),) = commands
            try:
                with unavailable():
                    return [await self._accept(keys=keys, args=args)]
            except ResponseError as exc:  # a bug, in a script: this call's (INTERNAL), as in a pipeline
                return [exc]
        with unavailable():
            pipe = self._r.pipeline(transaction=False) if not self.cluster else self._r.pipeline()
            async with pipe as p:
                for _, keys, args in commands:
                    p.evalsha(self._accept.sha, len(keys), *keys, *args)
                outs = await p.execute(raise_on_error=False)
        answers: list[object] = []
        for (_, keys, args), out in zip(commands, outs):
            if isinstance(out, NoScriptError):
                # A Redis that restarted (or a new master) lacks the script: EVAL caches it.
                try:
                    with unavailable():
                        out = await self._accept(keys=keys, args=args)
                except (StoreUnavailable, ResponseError) as exc:
                    out = exc
            elif isinstance(out, (ClusterDownError, TryAgainError, MasterDownError)):
                out = StoreUnavailable(f"redis cluster unavailable: {out}")
            elif isinstance(out, (RedisError, OSError)) and not isinstance(out, ResponseError):
                cause, out = out, StoreUnavailable(f"redis unavailable: {out}")
                out.__cause__ = cause
            answers.append(out)
        return answers

    async def marks(self, name: str) -> PlanMarks:
        with self._on(name):
            reports, planned, at = await self._r.hmget(
                self.keys.of(name, "meta"), "reports", "planned_reports", "planned_at"
            )
        if reports is None:
            raise NotFound(f"deployment {name!r} not found")
        return PlanMarks(int(reports), int(planned or 0), float(at or 0.0))

    async def mark_planned(self, name: str, reports: int, at: float) -> None:
        with self._on(name):
            await self._r.hset(self.keys.of(name, "meta"), mapping={"planned_reports": reports, "planned_at": at})

    async def put_window(self, name: str, instance: str, blob: bytes, folded: builtins.list[str]) -> None:
        with self._on(name):
            out = await self._put_window(
                keys=[self.keys.of(name, "windows"), self.keys.of(name, "meta"), self.keys.of(name, "wal2")],
                args=[instance, blob, *folded],
            )
        if out == -1:
            raise NotFound(f"deployment {name!r} not found")

    async def windows(self, name: str) -> dict[str, bytes]:
        with self._on(name):
            async with self._r.pipeline(transaction=True) as p:
                raw, entries = (
                    await p.hgetall(self.keys.of(name, "windows")).xrange(self.keys.of(name, "wal2")).execute()
                )
        out = {k.decode(): v for k, v in raw.items()}
        out.update((f"wal2:{entry_id.decode()}", fields[b"b"]) for entry_id, fields in entries)
        return out

    async def drop_windows(self, name: str, keys: builtins.list[str]) -> None:
        instances = [k for k in keys if not k.startswith("wal2:")]
        ids = [k.removeprefix("wal2:") for k in keys if k.startswith("wal2:")]
        with self._on(name):
            if instances:
                await self._r.hdel(self.keys.of(name, "windows"), *instances)
            if ids:
                await self._r.xdel(self.keys.of(name, "wal2"), *ids)

    async def ack(
        self, name: str, rank: int, version: int, state: int, step: int, ranks: builtins.list[int], margin: int
    ) -> Rollout:
        with self._on(name):
            out = await self._ack(
                keys=[self.keys.of(name, "acks"), self.keys.of(name, "rollout"), self.keys.of(name, "meta")],
                args=[rank, version, state, step, margin, PLACEMENTS_KEPT, *ranks],
            )
        if out == -1:
            raise NotFound(f"deployment {name!r} not found")
        acked, prepared, failed, n, switch, aborted, b_prep, b_sw, b_fail = (int(x) for x in out)
        return Rollout(acked, prepared, failed, n, switch, bool(aborted), bool(b_prep), bool(b_sw), bool(b_fail))

    async def acks(self, name: str) -> dict[int, RankState]:
        with self._on(name):
            raw = await self._r.hgetall(self.keys.of(name, "acks"))
        fields: dict[int, dict[str, int]] = {}
        for k, v in raw.items():
            rank, _, kind = k.decode().partition(":")
            fields.setdefault(int(rank), {})[kind or "s"] = int(v)
        return {r: RankState(f.get("s", 0), f.get("p", 0), f.get("f", 0)) for r, f in fields.items()}

    async def record_seen(self, name: str, seen: dict[int, float]) -> None:
        if not seen:
            return
        args: list[object] = []
        for rank, at in seen.items():
            args += [rank, f"{at:.3f}"]
        with self._on(name):
            out = await self._seen(keys=[self.keys.of(name, "seen"), self.keys.of(name, "meta")], args=args)
        if out == -1:
            raise NotFound(f"deployment {name!r} not found")

    async def seen(self, name: str) -> Seen:
        with self._on(name):
            async with self._r.pipeline(transaction=True) as p:
                raw, exists = await p.hgetall(self.keys.of(name, "seen")).exists(self.keys.of(name, "meta")).execute()
        if not exists:
            raise NotFound(f"deployment {name!r} not found")
        start = float(raw.pop(b"start", b"0"))
        return Seen(start, {int(k): float(v) for k, v in raw.items()})

    async def acquire_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        key = self.keys.of(name, "lease")
        with self._on(name):
            return bool(await self._r.set(key, owner, nx=True, px=max(1, int(ttl_s * 1000))))

    async def renew_lease(self, name: str, owner: str, ttl_s: float) -> bool:
        with self._on(name):
            return bool(await self._renew(keys=[self.keys.of(name, "lease")], args=[owner, max(1, int(ttl_s * 1000))]))

    async def release_lease(self, name: str, owner: str) -> None:
        with self._on(name):
            await self._release(keys=[self.keys.of(name, "lease")], args=[owner])

    async def close(self) -> None:
        if self._feed_writes:
            await asyncio.wait(list(self._feed_writes), timeout=1.0)
        await self._announcements.close()
        for feed in list(self._readers):
            await self._drop_feed_reader(feed)
        if self._masters is not None:
            await self._masters.close()
        await self._r.aclose()
