"""Liveness: ranks silent past ``Deployment.liveness.suspect_after`` are shown as suspect (in
GetDeployment and ``eplb_suspect_ranks``), never planned out; real servers on 127.0.0.1, on the
in-process store and on Redis, and two instances sharing one Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
from svc_helpers import FAST, REDIS_URL, small_deployment, status_details

from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service.liveness import suspects
from eplb_service.redis_store import RedisStore
from eplb_service.store import Seen
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

# Replicas write what they saw every 0.2 s here (1 s by default): the margin added to
# suspect_after, so a rank is listed 1.2 s after its last report.
LIVENESS_S = 0.2
AFTER_S = 1.0
LOADS = np.ones((4, 16), dtype=np.int64)


def config() -> object:
    return replace(FAST, replica_id=uuid.uuid4().hex[:8], liveness_s=LIVENESS_S)


def with_liveness(name: str, after_s: float = AFTER_S) -> pb.Deployment:
    d = small_deployment(name)
    d.liveness.suspect_after.FromNanoseconds(int(after_s * 1e9))
    return d


async def suspect_of(stub: object, name: str) -> dict[int, pb.SuspectRank]:
    response = await stub.GetDeployment(pb.GetDeploymentRequest(name=name))
    return {s.rank: s for s in response.status.suspect_ranks}


async def until(check: object, timeout_s: float = 5.0) -> object:
    """Polls the coroutine function ``check`` until it returns something true."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = await check()
        if out or time.monotonic() > deadline:
            return out
        await asyncio.sleep(0.05)


def gauge(server: object, name: str) -> float | None:
    return server.metrics.registry.get_sample_value("eplb_suspect_ranks", {"deployment": name})


async def keep_reporting(channel: object, name: str, ranks: list[int], stop: asyncio.Event) -> None:
    client = AsyncServiceClient.over(channel)
    while not stop.is_set():
        for r in ranks:
            await client.report(reports(name, r, [LOADS]))
        await asyncio.sleep(0.2)


@pytest.fixture(params=["memory", "redis"])
async def store_kw(request: pytest.FixtureRequest, prefix: object) -> dict:
    return {} if request.param == "memory" else {"redis_url": REDIS_URL, "key_prefix": prefix()}


async def test_silent_ranks_are_suspect_down_ones_are_not_and_a_report_clears_it(serve, connect, store_kw):
    server = await serve(balancer=config(), **store_kw)
    c = connect(server)
    name = "live"
    created = await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=with_liveness(name)))
    assert created.deployment.liveness.suspect_after.ToNanoseconds() == int(AFTER_S * 1e9)
    assert await suspect_of(c.stub, name) == {}  # nobody silent for long yet
    # Rank 6 acks once, then goes quiet; rank 7 never sends anything; the others keep reporting.
    await AsyncServiceClient.over(c.channel).ack(name, 6, 1)
    stop = asyncio.Event()
    reporters = asyncio.create_task(keep_reporting(c.channel, name, [0, 1, 2, 3, 4, 5], stop))
    try:
        start = time.monotonic()
        found = await until(lambda: suspect_of(c.stub, name))
        waited = time.monotonic() - start
        # Never before suspect_after + the write margin after the last contact.
        assert waited >= AFTER_S + LIVENESS_S - 0.15, waited
        assert set(found) <= {6, 7}
        found = await until(lambda: _both(c.stub, name))
        assert set(found) == {6, 7}
        assert found[6].ever_seen and not found[7].ever_seen
        assert all(s.seconds_since_seen > AFTER_S + LIVENESS_S for s in found.values()), found
        assert await until(lambda: gauge_is(server, name, 2.0)), gauge(server, name)
        listed = await c.stub.ListDeployments(pb.ListDeploymentsRequest())
        assert [[s.rank for s in status.suspect_ranks] for status in listed.statuses] == [[6, 7]]
        # Shown only: still planned in (no rank down, gpus 6 and 7 hold experts).
        placement = (await c.stub.GetPlacement(pb.GetPlacementRequest(deployment=name))).placement
        assert list(placement.down_ranks) == []
        phy2log = np.frombuffer(placement.phy2log.data, dtype="<i4").reshape(4, 24)
        assert (phy2log[:, 18:24] >= 0).all()
        # Marked down: no longer suspect.
        await c.stub.SetRanksDown(pb.SetRanksDownRequest(deployment=name, down=[7], reason="test"))
        assert set(await suspect_of(c.stub, name)) == {6}
        assert await until(lambda: gauge_is(server, name, 1.0)), gauge(server, name)
        # Rank 6 reports again: not suspect any more, at once on the instance it reported to.
        await AsyncServiceClient.over(c.channel).report(reports(name, 6, [LOADS]))
        assert await suspect_of(c.stub, name) == {}
        assert await until(lambda: gauge_is(server, name, 0.0)), gauge(server, name)
        assert not (await c.stub.ListDeployments(pb.ListDeploymentsRequest())).statuses[0].suspect_ranks
    finally:
        stop.set()
        await reporters
    await c.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name=name))
    await asyncio.sleep(3 * LIVENESS_S)
    assert gauge(server, name) is None  # the series goes with the deployment


async def _both(stub: object, name: str) -> dict[int, pb.SuspectRank] | None:
    found = await suspect_of(stub, name)
    return found if len(found) == 2 else None


async def gauge_is(server: object, name: str, value: float) -> bool:
    return gauge(server, name) == value


async def test_liveness_off_lists_no_rank_and_keeps_no_gauge(serve, connect, store_kw):
    server = await serve(balancer=config(), **store_kw)
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("quiet")))
    await asyncio.sleep(AFTER_S + 3 * LIVENESS_S)
    assert await suspect_of(c.stub, "quiet") == {}
    assert gauge(server, "quiet") is None


async def test_two_replicas_share_what_they_saw(serve, connect, prefix):
    p = prefix()
    a = await serve(balancer=config(), redis_url=REDIS_URL, key_prefix=p)
    b = await serve(balancer=config(), redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    name = "shared"
    await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=with_liveness(name)))
    # Rank 0 reports to A only, rank 1 acks on B only, rank 2 reports once to A and stops.
    await AsyncServiceClient.over(ca.channel).report(reports(name, 2, [LOADS]))
    stop = asyncio.Event()

    async def acks_on_b() -> None:
        client = AsyncServiceClient.over(cb.channel)
        while not stop.is_set():
            await client.ack(name, 1, 1)
            await asyncio.sleep(0.2)

    tasks = [asyncio.create_task(keep_reporting(ca.channel, name, [0], stop)), asyncio.create_task(acks_on_b())]
    try:
        expected = {2, 3, 4, 5, 6, 7}

        async def all_silent(stub: object) -> dict[int, pb.SuspectRank] | None:
            found = await suspect_of(stub, name)
            return found if set(found) == expected else None

        on_b = await until(lambda: all_silent(cb.stub))
        assert on_b and set(on_b) == expected, on_b  # rank 0 reported to A: not suspect on B
        assert on_b[2].ever_seen and not on_b[3].ever_seen  # rank 2's one report, written by A
        on_a = await until(lambda: all_silent(ca.stub))
        assert on_a and set(on_a) == expected, on_a  # rank 1 acked on B: not suspect on A
        assert await until(lambda: gauge_is(b, name, 6.0)), gauge(b, name)
        assert await until(lambda: gauge_is(a, name, 6.0)), gauge(a, name)
        # Rank 2 reports to A again: B sees it live once A wrote it (every LIVENESS_S).
        await AsyncServiceClient.over(ca.channel).report(reports(name, 2, [LOADS]))

        async def cleared() -> bool:
            return 2 not in await suspect_of(cb.stub, name)

        start = time.monotonic()
        assert await until(cleared, 2.0)
        assert time.monotonic() - start < 1.0
    finally:
        stop.set()
        await asyncio.gather(*tasks)


@pytest.mark.parametrize(
    ("seconds", "nanos"),
    [(0, 500_000_000), (-2, 0), (7 * 24 * 3600 + 1, 0)],
    ids=["under 1 s", "negative", "over 7 days"],
)
async def test_a_threshold_out_of_range_is_invalid_argument_and_nothing_is_stored(serve, connect, seconds, nanos):
    c = connect(await serve(balancer=config()))
    d = small_deployment("bad")
    d.liveness.suspect_after.seconds, d.liveness.suspect_after.nanos = seconds, nanos
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [(field, why)] = status_details(err.value)
    assert field == "deployment.liveness.suspect_after" and "1s to 604800s" in why, why
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.GetDeployment(pb.GetDeploymentRequest(name="bad"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_suspects_waits_for_the_margin_counts_never_seen_ranks_from_the_start_and_skips_down_ones():
    seen = Seen(start=100.0, ranks={0: 108.0, 1: 103.0})
    # At 110: rank 0 silent 2 s, rank 1 7 s, ranks 2 and 3 never seen (10 s since the start).
    out = suspects([0, 1, 2, 3], {3}, seen, created=50.0, after_s=5.0, margin_s=1.0, now=110.0)
    assert [(s.rank, s.seconds_since_seen, s.ever_seen) for s in out] == [(1, 7.0, True), (2, 10.0, False)]
    # Silent for suspect_after but not past the margin: not yet.
    assert suspects([1], set(), seen, 50.0, 5.0, 1.0, now=108.5) == []
    # A store without a start (a deployment stored before liveness): the create time.
    assert [s.rank for s in suspects([2], set(), Seen(0.0, {}), 100.0, 5.0, 1.0, now=106.5)] == [2]
    assert suspects([2], set(), Seen(0.0, {}), 100.0, 5.0, 1.0, now=105.5) == []


async def test_redis_keeps_the_latest_time_whatever_the_order_and_delete_drops_it(redis_url, prefix):
    p = prefix()
    store = RedisStore(redis_url, p)
    try:
        d = with_liveness("keys")
        d.create_time.FromNanoseconds(time.time_ns())
        before = time.time()
        await store.create(d, pb.Placement(deployment="keys", version=1))
        first = await store.seen("keys")
        assert first.ranks == {} and before - 0.01 <= first.start <= time.time() + 0.01
        await store.record_seen("keys", {0: 1000.5, 1: 2000.25})
        await store.record_seen("keys", {0: 999.0, 1: 2000.75})  # another replica, older for rank 0
        assert (await store.seen("keys")).ranks == {0: 1000.5, 1: 2000.75}
        # One hash in the deployment's slot ({keys} hash tag; on Redis Cluster the script's two
        # keys would be refused otherwise).
        key = store.keys.of("keys", "seen")
        assert key == f"{p}:{{keys}}:seen"
        stored = await store._r.hgetall(key)
        assert set(stored) == {b"start", b"0", b"1"}
        assert (stored[b"0"], stored[b"1"]) == (b"1000.500", b"2000.750")  # milliseconds
        await store.delete("keys")
        assert await store._r.exists(key) == 0
        # Re-created: a fresh start, no times of the old one.
        await store.create(d, pb.Placement(deployment="keys", version=1))
        again = await store.seen("keys")
        assert again.ranks == {} and again.start >= first.start
    finally:
        await store.close()


async def test_a_write_back_after_redis_lost_everything_restarts_the_count(private_redis, prefix):
    store = RedisStore(private_redis.url, prefix())
    try:
        d = with_liveness("back")
        d.create_time.FromNanoseconds(time.time_ns() - 3600 * 10**9)  # created an hour ago
        await store.create(d, pb.Placement(deployment="back", version=1))
        await store.record_seen("back", {0: time.time()})
        raw = aioredis.from_url(private_redis.url)
        await raw.flushall()
        await raw.aclose()
        before = time.time()
        assert await store.restore(d, pb.Placement(deployment="back", version=3))
        seen = await store.seen("back")
        # Counting from the write-back, not from the create time: no rank is suspect at once.
        assert seen.ranks == {} and seen.start >= before - 0.01
    finally:
        await store.close()
