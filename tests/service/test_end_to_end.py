"""Create → report from several ranks → rebalance → watchers on two instances → ack."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest
from svc_helpers import REDIS_URL, report_some_load, small_deployment

import eplb
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb


def skewed_loads(seed: int, shape: tuple[int, int] = (4, 16)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    loads = rng.integers(0, 50, size=shape)
    loads[:, 3] += 5000  # one very hot expert per layer: contiguous placement is badly imbalanced
    return loads.astype(np.int32)


async def collect(client: AsyncServiceClient, n: int, out: list[int]) -> None:
    async for placement in client.watch("d1", decode=False):
        out.append(placement.version)
        if len(out) == n:
            return


async def test_two_replicas_report_rebalance_watch_ack(serve, connect, prefix):
    p = prefix()
    a = await serve(redis_url=REDIS_URL, key_prefix=p)
    b = await serve(redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    created = await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    assert created.deployment.version == 1 and created.placement.version == 1
    topo = eplb.Topology(4, 16, 24, 8, 2, 4)
    assert np.array_equal(
        np.frombuffer(created.placement.phy2log.data, "<i4").reshape(4, 24), eplb.Placement.contiguous(topo).phy2log
    )

    seen_a: list[int] = []
    seen_b: list[int] = []
    watchers = [
        asyncio.create_task(collect(AsyncServiceClient.over(ca.channel), 3, seen_a)),
        asyncio.create_task(collect(AsyncServiceClient.over(cb.channel), 3, seen_b)),
    ]
    # Ranks report to both instances: half logical counts, half physical counts under version 1.
    ranks = [AsyncServiceClient.over(ca.channel if r % 2 else cb.channel) for r in range(4)]
    total = np.zeros((4, 16))
    for r, client in enumerate(ranks):
        loads = skewed_loads(r)
        total += loads
        if r < 2:
            resp = await client.report(reports("d1", r, [loads]))
        else:
            # Physical counts [L, P] under the contiguous placement: slot p holds expert p % 16.
            phys = np.zeros((4, 24), dtype=np.int32)
            phys[:, :16] = loads
            resp = await client.report(reports("d1", r, [phys], placement_version=1))
        assert (resp.accepted, resp.duplicates) == (1, 0)

    # Each instance flushes its window every flush_s (0.1 s here); the planner sums the flushed ones.
    await asyncio.sleep(0.3)
    dry = await cb.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    assert not dry.published and dry.placement.version == 0
    assert dry.window_tokens == pytest.approx(total.sum()) and dry.window_reports == 4
    assert dry.placement.stats.imbalance_after < dry.placement.stats.imbalance_before
    assert dry.placement.stats.gain_percent > 10

    first = await ca.stub.Rebalance(pb.RebalanceRequest(deployment="d1"))
    assert first.published and first.placement.version == 2
    assert first.placement.stats.imbalance_after == pytest.approx(dry.placement.stats.imbalance_after)
    # Nobody loaded weights for the made-up contiguous version 1: the first plan is a fresh one.
    expected = eplb.rebalance(total, topo, "auto")
    assert np.array_equal(np.frombuffer(first.placement.phy2log.data, "<i4").reshape(4, 24), expected.phy2log)
    assert first.placement.stats.moves == int(eplb.moves(eplb.Placement.contiguous(topo), expected.placement).sum())
    assert "planned fresh" in first.placement.stats.notes[-1]
    second = await cb.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    assert second.published and second.placement.version == 3

    await asyncio.wait_for(asyncio.gather(*watchers), 10)
    assert seen_a == seen_b == [1, 2, 3]

    got = await cb.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))
    assert got.placement.version == 3 and got.placement.stats.moves == second.placement.stats.moves
    old = await ca.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1", version=2))
    assert old.placement.phy2log.data == first.placement.phy2log.data

    assert (await ranks[0].ack("d1", 0, 3)).ranks_acked == 1
    assert (await ranks[1].ack("d1", 1, 3)).ranks_acked == 2
    assert (await ranks[2].ack("d1", 2, 2)).ranks_acked == 3  # ranks with version 2 or later
    info = await ca.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert info.deployment.version == 3
    assert [(x.rank, x.version) for x in info.acks] == [(0, 3), (1, 3), (2, 2)]
    listed = await cb.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert [d.name for d in listed.deployments] == ["d1"]


async def test_embedded_store_round_trip_and_delete(serve, connect):
    server = await serve()
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("m1")))
    client = AsyncServiceClient.over(c.channel)
    resp = await client.report(reports("m1", 7, [skewed_loads(0), skewed_loads(1)]))
    assert resp.accepted == 2
    out = await c.stub.Rebalance(pb.RebalanceRequest(deployment="m1"))
    assert out.published and out.placement.version == 2 and out.window_reports == 2
    await c.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="m1"))
    listed = await c.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert list(listed.deployments) == []


async def test_resume_watch_from_since_version(serve, connect, prefix):
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix())
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await report_some_load(c.stub)
    for _ in range(3):
        await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    # A resuming watcher gets the versions after the one it had, in order; a new one the latest.
    resumed = c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1", since_version=2))
    assert [(await resumed.read()).placement.version for _ in range(2)] == [3, 4]
    resumed.cancel()
    fresh = c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1"))
    assert (await fresh.read()).placement.version == 4
    fresh.cancel()


async def test_delete_on_one_replica_leaves_no_keys(serve, connect, prefix):
    import redis.asyncio as aredis

    p = prefix()
    a, b = await serve(redis_url=REDIS_URL, key_prefix=p), await serve(redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await AsyncServiceClient.over(cb.channel).report(reports("d1", 0, [skewed_loads(0)]))
    await asyncio.sleep(0.3)  # b has flushed its window
    await ca.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="d1"))
    # b keeps flushing until its follower notices the deletion; none of that may re-create keys.
    await asyncio.sleep(2.5)
    r = aredis.Redis.from_url(REDIS_URL)
    # Only the prefix's feed (P:feed: shared by its deployments), which expires by itself.
    assert [k async for k in r.scan_iter(match=f"{p}:*")] == [f"{p}:feed".encode()]
    assert 0 < await r.ttl(f"{p}:feed") <= 600
    await r.aclose()
    with pytest.raises(Exception) as info:
        await cb.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))
    assert "not found" in str(info.value)


async def test_an_interval_trigger_publishes_once_while_the_load_stays_the_same(serve, connect):
    # The reviewer's case: interval 1 s, default gate; it used to publish a version that moved
    # nothing every second.
    c = connect(await serve())
    deployment = small_deployment()
    deployment.trigger.interval.FromSeconds(1)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment))
    await AsyncServiceClient.over(c.channel).report(reports("d1", 0, [skewed_loads(0)]))
    await asyncio.sleep(4.5)
    got = await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))
    assert got.placement.version == 2 and got.placement.stats.moves > 0
    dry = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    assert dry.placement.stats.moves == 0 and "moves no slot" in dry.reason


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_an_interval_trigger_plans_only_after_new_reports(serve, connect, prefix, caplog, store):
    # An idle deployment re-planned its empty or unchanged window every interval ("plan d1:
    # skipped, imbalance 1.0000 -> 1.0000", a plan's cost each time, nothing published).
    caplog.set_level(logging.INFO, logger="eplb_service.planner")
    c = connect(await serve(**({"redis_url": REDIS_URL, "key_prefix": prefix()} if store == "redis" else {})))
    deployment = small_deployment()
    deployment.trigger.interval.FromSeconds(1)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment))
    engine = AsyncServiceClient.over(c.channel)

    def plans() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("plan d1:")]

    async def wait_for_plans(n: int) -> None:
        deadline = time.monotonic() + 10
        while len(plans()) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    await asyncio.sleep(2.5)  # over two intervals, no report yet
    assert plans() == []
    await engine.report(reports("d1", 0, [skewed_loads(0)]))
    await wait_for_plans(1)
    assert len(plans()) == 1 and plans()[0].startswith("plan d1: published")
    await asyncio.sleep(2.5)  # no report since: the same window, not planned again
    assert len(plans()) == 1
    await engine.report(reports("d1", 0, [skewed_loads(1)]))
    await wait_for_plans(2)  # a new report: re-planned at the next interval, as before
    assert len(plans()) == 2
    await asyncio.sleep(2.5)
    assert len(plans()) == 2
