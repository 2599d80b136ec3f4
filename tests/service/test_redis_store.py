"""The Redis store's own suite, on both kinds of Redis: one server (6379) and a 3-master Redis
Cluster (``redis_url`` is parametrized). Before cluster support every create on the cluster
failed with MovedError (the deployments set lives in another slot) and the announce reader's
multi-stream XREAD failed with CROSSSLOT."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import numpy as np
import pytest
from redis.exceptions import SlotNotCoveredError

from eplb_service.errors import AlreadyExists, NotFound, StoreUnavailable
from eplb_service.redis_store import RedisStore
from eplb_service.store import AcceptCall
from eplb_service.windows import WindowSpec, encode_sums, sum_blobs
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb


def deployment(name: str) -> pb.Deployment:
    d = pb.Deployment(name=name)
    d.create_time.FromNanoseconds(time.time_ns())
    return d


async def one_deployment_a_master(s: RedisStore, cluster) -> dict[int, str]:
    """Creates a deployment on each master of ``cluster``: master port → its name."""
    return {port: names[0] for port, names in (await deployments_a_master(s, cluster, 1)).items()}


async def deployments_a_master(s: RedisStore, cluster, count: int) -> dict[int, list[str]]:
    """Creates ``count`` deployments on each master of ``cluster``: master port → their names."""
    names: dict[int, list[str]] = {port: [] for port in cluster.ports}
    i = 0
    while any(len(n) < count for n in names.values()):
        on = names[cluster.port_of(s.keys.of(f"d{i}", "meta"))]
        if len(on) < count:
            on.append(f"d{i}")
        i += 1
    for n in sum(names.values(), []):
        await s.create(deployment(n), pb.Placement(deployment=n, version=1))
    return names


@pytest.fixture
async def store(redis_url):
    s = RedisStore(redis_url, f"eplb-test-{uuid.uuid4().hex[:10]}")
    yield s
    for record in await s.list():
        await s.delete(record.deployment.name)
    await s.close()


async def test_deployments_are_created_listed_counted_and_deleted(store):
    names = [f"d{i}" for i in range(8)]  # spread over the cluster's masters
    for n in names:
        await store.create(deployment(n), pb.Placement(deployment=n, version=1))
    with pytest.raises(AlreadyExists):
        await store.create(deployment("d3"), pb.Placement(deployment="d3", version=1))
    assert [r.deployment.name for r in await store.list()] == names
    assert await store.count() == 8
    assert (await store.get("d5")).version == 1
    await store.delete("d5")
    with pytest.raises(NotFound):
        await store.get("d5")
    assert await store.count() == 7 and "d5" not in [r.deployment.name for r in await store.list()]


async def test_followers_of_deployments_in_different_slots_see_every_version(store):
    names = ["a", "b", "c", "e"]
    for n in names:
        await store.create(deployment(n), pb.Placement(deployment=n, version=1))
    seen: dict[str, list[int]] = {n: [] for n in names}

    async def follow(n: str) -> None:
        async for p in store.follow(n, 0):
            seen[n].append(p.version)

    tasks = [asyncio.create_task(follow(n)) for n in names]
    await asyncio.sleep(0.3)
    for v in (2, 3):
        for n in names:
            await store.publish(n, pb.Placement(deployment=n, version=v))
    deadline = time.monotonic() + 5
    while any(s != [1, 2, 3] for s in seen.values()) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for t in tasks:
        t.cancel()
    assert seen == {n: [1, 2, 3] for n in names}


async def test_a_follower_ends_with_not_found_when_its_deployment_is_deleted(store):
    await store.create(deployment("gone"), pb.Placement(deployment="gone", version=1))

    async def follow() -> list[int]:
        return [p.version async for p in store.follow("gone", 0)]

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.3)
    await store.delete("gone")
    with pytest.raises(NotFound):
        await asyncio.wait_for(task, 5)


async def test_reports_are_accepted_once_with_their_entry_and_folded_by_a_flush(store):
    await store.create(deployment("w"), pb.Placement(deployment="w", version=1))
    spec = WindowSpec()
    counts = np.arange(12, dtype=np.float64).reshape(3, 4)
    fresh, entry = await store.accept_reports(
        "w", [(0, 1), (1, 1)], lambda f: encode_sums(counts * sum(f), sum(f), time.time(), spec), 60
    )
    assert fresh == [True, True] and entry is not None
    fresh, _ = await store.accept_reports("w", [(0, 1)], lambda f: encode_sums(counts, sum(f), time.time(), spec), 60)
    assert fresh == [False]
    blobs = await store.windows("w")
    assert list(blobs) == [f"wal2:{entry}"]
    sums, reports, stale = sum_blobs(blobs, (3, 4), time.time(), 60)
    assert reports == 2 and stale == [] and np.array_equal(sums, counts * 2)
    await store.put_window("w", "replica-a", encode_sums(counts * 2, 2, time.time(), spec), [entry])
    assert list(await store.windows("w")) == ["replica-a"]
    assert (await store.marks("w")).reports == 2


async def test_accept_many_answers_each_deployment_of_one_pipeline(store):
    # Batches of several deployments (on the cluster, over every master) in one call: each gets
    # its own answer; a duplicate pair is left out of its deployment's entry only, and a
    # deployment that is missing gets NotFound without failing the others.
    names = [f"m{i}" for i in range(6)]
    for n in names:
        await store.create(deployment(n), pb.Placement(deployment=n, version=1))
    spec = WindowSpec()
    base = np.arange(12, dtype=np.float64).reshape(3, 4)

    def call(n: str, pairs: list[tuple[int, int]], scale: float) -> AcceptCall:
        return AcceptCall(n, pairs, lambda f: encode_sums(base * scale * sum(f), sum(f), time.time(), spec), 60)

    first = await store.accept_many([call(n, [(0, 1)], i + 1) for i, n in enumerate(names)])
    assert [a[0] for a in first] == [[True]] * 6 and all(a[1] for a in first)
    # m0: (0, 1) again (a duplicate) and (1, 1) new; m1: only a duplicate; "nope": missing.
    second = await store.accept_many(
        [call("m0", [(0, 1), (1, 1)], 1), call("nope", [(0, 1)], 1), call("m1", [(0, 1)], 1), call("m2", [(0, 2)], 3)]
    )
    assert second[0][0] == [False, True] and second[0][1] is not None
    assert isinstance(second[1], NotFound) and "nope" in str(second[1])
    assert second[2] == ([False], None)
    assert second[3][0] == [True] and second[3][1] is not None
    for n, want, reports in (("m0", base * 2, 2), ("m1", base * 2, 1), ("m2", base * 6, 2)):
        sums, got, _ = sum_blobs(await store.windows(n), (3, 4), time.time(), 60)
        assert got == reports and np.array_equal(sums, want), n
        assert (await store.marks(n)).reports == reports


async def test_accept_many_fails_only_a_down_masters_deployments(redis_cluster):
    # One pipeline a master (two deployments on each, so each is a real pipeline): with one
    # master dead, its deployments' batches get StoreUnavailable while the live masters' are
    # accepted in the same call; before a ping notes it (its pipeline's connection is refused)
    # and after (failed at once, naming it).
    s = RedisStore(redis_cluster.url, f"eplb-test-{uuid.uuid4().hex[:10]}")
    await s.ping()
    names = await deployments_a_master(s, redis_cluster, 2)
    assert len({s.shard(n) for n in sum(names.values(), [])}) == len(names)
    victim = redis_cluster.ports[-1]
    blob = encode_sums(np.ones((3, 4)), 1, time.time(), WindowSpec())
    redis_cluster.kill(victim)
    try:
        for seq in (1, 2):
            if seq == 2:
                await s.ping()
            flat = [(port, n) for port, ns in names.items() for n in ns]
            answers = await s.accept_many([AcceptCall(n, [(0, seq)], lambda f: blob, 60) for _, n in flat])
            for (port, n), answer in zip(flat, answers):
                if port == victim:
                    assert isinstance(answer, StoreUnavailable), answer
                    assert seq == 1 or f"{victim}, which holds deployment {n!r}, is down" in str(answer)
                else:
                    assert answer[0] == [True] and answer[1] is not None, (n, answer)
    finally:
        redis_cluster.start_node(victim)
        redis_cluster.wait_ok()
    await s.ping()
    for port, ns in names.items():
        for n in ns:
            if port != victim:
                await s.delete(n)
            else:
                with pytest.raises(NotFound):  # the master came back empty; this unindexes it
                    await s.delete(n)
    await s.close()


async def test_accept_many_keeps_other_masters_answers_when_one_masters_pipeline_raises(redis_cluster):
    # Not only a down master: any error of one master's pipeline (here the cluster client's
    # SlotNotCoveredError, which is no RedisError) goes to that master's calls alone. Before,
    # it escaped the gather and failed every deployment's batch of the call.
    s = RedisStore(redis_cluster.url, f"eplb-test-{uuid.uuid4().hex[:10]}")
    await s.ping()
    names = await deployments_a_master(s, redis_cluster, 2)
    victim = s.shard(names[redis_cluster.ports[0]][0])
    real = s._accept_pipeline

    async def failing(commands):
        if s.shard(commands[0][0]) == victim:
            raise SlotNotCoveredError("slot not covered by any master")
        return await real(commands)

    s._accept_pipeline = failing
    blob = encode_sums(np.ones((3, 4)), 1, time.time(), WindowSpec())
    flat = [(port, n) for port, ns in names.items() for n in ns]
    answers = await s.accept_many([AcceptCall(n, [(0, 1)], lambda f: blob, 60) for _, n in flat])
    for (port, n), answer in zip(flat, answers):
        if port == redis_cluster.ports[0]:
            assert isinstance(answer, StoreUnavailable) and "slot not covered" in str(answer), answer
        else:
            assert answer[0] == [True] and answer[1] is not None, (n, answer)
    for n in sum(names.values(), []):
        await s.delete(n)
    await s.close()


async def test_accept_many_loads_its_script_where_redis_lost_it(store):
    # A Redis that restarted (or a new master) has no scripts: every EVALSHA of the pipeline
    # gets NOSCRIPT, and each call is sent again with EVAL, which caches the script.
    names = [f"s{i}" for i in range(6)]
    for n in names:
        await store.create(deployment(n), pb.Placement(deployment=n, version=1))
    blob = encode_sums(np.ones((3, 4)), 1, time.time(), WindowSpec())
    if store.cluster:
        for master in store._masters.primaries():
            await store._masters.ping_client(master).script_flush()
    else:
        await store._r.script_flush()
    answers = await store.accept_many([AcceptCall(n, [(0, 1)], lambda f: blob, 60) for n in names])
    assert [a[0] for a in answers] == [[True]] * 6 and all(a[1] for a in answers)
    for n in names:
        assert (await store.marks(n)).reports == 1


async def test_acks_and_leases_work_on_each_deployment(store):
    for n in ("x", "y"):
        await store.create(deployment(n), pb.Placement(deployment=n, version=1))
        rollout = await store.ack(n, 0, 1, 0, 0, [0, 1], 2)
        assert rollout.ranks_acked == 1 and rollout.num_ranks == 2
        assert (await store.acks(n))[0].switched == 1
        assert await store.acquire_lease(n, "me", 5) and not await store.acquire_lease(n, "you", 5)
        assert await store.renew_lease(n, "me", 5)
        await store.release_lease(n, "me")
        assert await store.acquire_lease(n, "you", 5)


async def test_the_writelines_race_of_a_rejoining_master_is_unavailable_not_a_traceback(store, monkeypatch):
    # redis-py's asyncio cluster client, when a master rejoins, can write on a connection that
    # another call just closed; the index read used to let that AttributeError out (a
    # traceback in Registry.refresh). On Cluster the bucket's last known names are listed; on
    # one Redis it is UNAVAILABLE like any broken connection.
    names = [f"d{i}" for i in range(4)]
    for n in names:
        await store.create(deployment(n), pb.Placement(deployment=n, version=1))
    assert [r.deployment.name for r in await store.list()] == names  # the index is cached now
    real = store._r.smembers

    async def racing(key):
        raise AttributeError("'NoneType' object has no attribute 'writelines'")

    monkeypatch.setattr(store._r, "smembers", racing)
    if store.cluster:
        assert await store.count() == 4
    else:
        with pytest.raises(StoreUnavailable, match="connection closed under the call"):
            await store.count()
    monkeypatch.setattr(store._r, "smembers", real)
    assert await store.count() == 4


async def test_calls_on_live_masters_go_on_while_the_default_node_is_dead(redis_cluster):
    # redis-py's cluster client re-initializes after a CLUSTERDOWN or broken connection, and its
    # re-initialization read the command table from its default node, the first master: when
    # that master was the dead one every call on the live masters failed with its 'Connection
    # refused' (seen in CI: a ReportLoad on a live deployment, 1 run in several).
    s = RedisStore(redis_cluster.url, f"eplb-test-{uuid.uuid4().hex[:10]}")
    await s.ping()
    victim = s._r.get_default_node()
    names = await one_deployment_a_master(s, redis_cluster)
    live = [n for port, n in names.items() if port != victim.port]
    redis_cluster.kill(victim.port)
    try:
        await s._r.aclose()  # what the client does itself after a CLUSTERDOWN answer
        for n in live:
            assert (await s.get(n)).deployment.name == n
        with pytest.raises(StoreUnavailable, match=f"{victim.port}"):
            await s.get(names[victim.port])
        for n in live:  # and after a failed call on the dead master
            assert (await s.get(n)).deployment.name == n
    finally:
        redis_cluster.start_node(victim.port)
        redis_cluster.wait_ok()
    for n in live:
        await s.delete(n)
    with pytest.raises(NotFound):  # the master came back empty; this unindexes the name
        await s.delete(names[victim.port])
    assert await s.count() == 0
    await s.close()


def _ports(url: str) -> list[int]:
    return [int(hp.rsplit(":", 1)[1].split("/")[0]) for hp in url.split("://", 1)[1].split(",")]


def _calls(ports: list[int], *commands: str) -> int:
    import redis as sync_redis

    total = 0
    for port in ports:
        stats = sync_redis.Redis(port=port).info("commandstats")
        total += sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in commands)
    return total


async def test_idle_followers_cost_redis_nothing_per_deployment(store, redis_url):
    # Before the feeds, each followed deployment was read every 50 ms (Redis Cluster) or its
    # generation every 0.5 s (one Redis): an idle instance's work grew with its deployments.
    names = [f"idle{i}" for i in range(60)]
    for n in names:
        await store.create(deployment(n), pb.Placement(deployment=n, version=1))
    firsts = {n: asyncio.Event() for n in names}

    async def follow(n: str) -> None:
        async for _ in store.follow(n, 0):
            firsts[n].set()

    tasks = [asyncio.create_task(follow(n)) for n in names]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts.values())), 10)
    await asyncio.sleep(0.5)
    ports = _ports(redis_url)
    before = _calls(ports, "xread", "hmget", "xrevrange", "get")
    await asyncio.sleep(3)
    idle = _calls(ports, "xread", "hmget", "xrevrange", "get") - before
    for t in tasks:
        t.cancel()
    # The feeds' blocking reads (16 on the cluster, one on one Redis) wake every 2 s at most.
    assert idle <= 40, f"{idle} reads in 3 s of 60 idle followed deployments"


async def test_a_commit_reaches_followers_at_once_and_one_whose_feed_entry_was_lost_at_the_next_check(
    store, monkeypatch
):
    from eplb_service.redis_store import feeds

    monkeypatch.setattr(feeds, "_RECONCILE_S", 1.0)
    monkeypatch.setattr(feeds, "FEED_BLOCK_MS", 300)
    await store.create(deployment("fed"), pb.Placement(deployment="fed", version=1))
    seen: asyncio.Queue[tuple[int, float]] = asyncio.Queue()

    async def follow() -> None:
        async for p in store.follow("fed", 0):
            seen.put_nowait((p.version, time.monotonic()))

    task = asyncio.create_task(follow())
    assert (await asyncio.wait_for(seen.get(), 5))[0] == 1
    t0 = time.monotonic()
    await store.publish("fed", pb.Placement(deployment="fed", version=2))
    version, at = await asyncio.wait_for(seen.get(), 5)
    assert version == 2 and at - t0 < 0.25, at - t0  # woken by the feed, not by a poll

    async def lost(name: str) -> None:  # the instance died between the commit and its feed entry
        return None

    monkeypatch.setattr(store, "_announce", lost)
    await store.publish("fed", pb.Placement(deployment="fed", version=3))
    await store.publish("fed", pb.Placement(deployment="fed", version=4))
    got = [await asyncio.wait_for(seen.get(), 5) for _ in range(2)]
    task.cancel()
    assert [v for v, _ in got] == [3, 4]  # every version, in order, from the full check


def _split_name(s: RedisStore, cluster) -> tuple[str, int, int]:
    """A name whose meta lives on another master than its feed: (name, meta port, feed port)."""
    for i in range(1000):
        n = f"split{i}"
        meta, feed = cluster.port_of(s.keys.of(n, "meta")), cluster.port_of(s.keys.feed_of(n))
        if meta != feed:
            return n, meta, feed
    raise AssertionError("no such name")


def _move_slot(cluster, slot: int, src: int, dst: int) -> None:
    import redis as sync_redis

    a, b = sync_redis.Redis(port=src), sync_redis.Redis(port=dst)
    src_id, dst_id = a.execute_command("CLUSTER MYID"), b.execute_command("CLUSTER MYID")
    b.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
    a.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
    while keys := a.execute_command("CLUSTER GETKEYSINSLOT", slot, 100):
        a.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
    for port in cluster.ports:
        sync_redis.Redis(port=port).execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)


async def _follow_into(s: RedisStore, name: str, q: asyncio.Queue) -> None:
    async for p in s.follow(name, 0):
        q.put_nowait((p.version, time.monotonic()))


async def test_followers_keep_their_versions_after_their_feeds_slot_moved(redis_cluster):
    # A reshard (or a failed master back as a replica): the feed's reader gets MOVED. It ended
    # the feed's task, and its followers heard of no version again.
    import redis as sync_redis

    s = RedisStore(redis_cluster.url, f"eplb-test-{uuid.uuid4().hex[:10]}")
    name, _, feed_port = _split_name(s, redis_cluster)
    slot = sync_redis.Redis(port=feed_port).execute_command("CLUSTER KEYSLOT", s.keys.feed_of(name))
    dst = next(p for p in redis_cluster.ports if p != feed_port)
    seen: asyncio.Queue = asyncio.Queue()
    task = None
    try:
        await s.create(deployment(name), pb.Placement(deployment=name, version=1))
        task = asyncio.create_task(_follow_into(s, name, seen))
        assert (await asyncio.wait_for(seen.get(), 5))[0] == 1
        _move_slot(redis_cluster, slot, feed_port, dst)
        await asyncio.sleep(1)
        for v in (2, 3):
            await s.publish(name, pb.Placement(deployment=name, version=v))
            assert (await asyncio.wait_for(seen.get(), 10))[0] == v
    finally:
        if task is not None:
            task.cancel()
        _move_slot(redis_cluster, slot, dst, feed_port)
        await s.delete(name)
        await s.close()


@pytest.mark.parametrize("how", ["pause", "kill"])
async def test_a_live_deployment_is_followed_promptly_while_its_feeds_master_is_down(redis_cluster, how):
    # With its feed's master hung or dead, a deployment on a live master still reaches its
    # followers within about _FALLBACK_S (0.5 s) plus a ping: the service pings every 0.5 s.
    s = RedisStore(redis_cluster.url, f"eplb-test-{uuid.uuid4().hex[:10]}")
    name, _, feed_port = _split_name(s, redis_cluster)

    async def pings() -> None:
        while True:
            with contextlib.suppress(Exception):
                await s.ping()
            await asyncio.sleep(0.5)

    seen: asyncio.Queue = asyncio.Queue()
    tasks = []
    try:
        await s.create(deployment(name), pb.Placement(deployment=name, version=1))
        tasks = [asyncio.create_task(_follow_into(s, name, seen)), asyncio.create_task(pings())]
        assert (await asyncio.wait_for(seen.get(), 5))[0] == 1
        (redis_cluster.pause if how == "pause" else redis_cluster.kill)(feed_port)
        await asyncio.sleep(3)
        for v in (2, 3, 4):
            t0 = time.monotonic()
            await s.publish(name, pb.Placement(deployment=name, version=v))
            got, at = await asyncio.wait_for(seen.get(), 30)
            assert got == v and at - t0 < 1.5, (v, got, at - t0)
            await asyncio.sleep(0.7)
    finally:
        for t in tasks:
            t.cancel()
        if how == "pause":
            redis_cluster.resume(feed_port)
        else:
            redis_cluster.start_node(feed_port)
        redis_cluster.wait_ok()
        with contextlib.suppress(Exception):
            await s.delete(name)
        await s.close()
