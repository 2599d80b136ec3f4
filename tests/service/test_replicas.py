"""Several instances on one Redis: one planner at a time, consecutive versions, every watcher sees all."""

from __future__ import annotations

import asyncio
import time

import pytest
from svc_helpers import REDIS_URL, report_some_load, small_deployment

from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb


async def read_versions(call, n: int) -> list[int]:
    return [(await call.read()).placement.version for _ in range(n)]


async def test_racing_rebalances_give_consecutive_versions(serve, connect, prefix):
    p = prefix()
    replicas = [await serve(redis_url=REDIS_URL, key_prefix=p) for _ in range(3)]
    clients = [connect(r) for r in replicas]
    await clients[0].stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await report_some_load(clients[0].stub)
    watches = [c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1")) for c in clients]
    for w in watches:
        assert (await w.read()).placement.version == 1
    rounds = 4
    results = await asyncio.gather(
        *(c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True)) for c in clients for _ in range(rounds))
    )
    versions = sorted(r.placement.version for r in results)
    assert all(r.published for r in results)
    assert versions == list(range(2, 2 + 3 * rounds))
    seen = await asyncio.wait_for(asyncio.gather(*(read_versions(w, 3 * rounds) for w in watches)), 10)
    assert seen == [versions] * 3
    for w in watches:
        w.cancel()
    got = await clients[2].stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert got.deployment.version == 1 + 3 * rounds


async def test_lease_of_a_crashed_planner_expires(serve, connect, prefix):
    """An instance that died holding the planning lease blocks others for at most one lease."""
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix())
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await report_some_load(c.stub)
    lease_s = server.balancer.config.lease_s
    assert await server.store.acquire_lease("d1", "crashed-replica", lease_s)
    start = time.monotonic()
    out = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    waited = time.monotonic() - start
    assert out.published and out.placement.version == 2
    assert 0.5 * lease_s < waited < lease_s + 1.0


async def test_trigger_plans_once_across_replicas(serve, connect, prefix):
    """Report-count trigger: exactly one instance plans per trigger, and only gainful plans publish."""
    import numpy as np

    p = prefix()
    a, b = await serve(redis_url=REDIS_URL, key_prefix=p), await serve(redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    await ca.stub.CreateDeployment(
        pb.CreateDeploymentRequest(deployment=small_deployment(report_count=4, min_gain_percent=5.0))
    )
    loads = np.ones((4, 16), dtype=np.int32)
    loads[:, 0] = 1000
    for r in range(4):
        await AsyncServiceClient.over(ca.channel if r % 2 else cb.channel).report(reports("d1", r, [loads]))
    deadline = time.monotonic() + 5
    while (await ca.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))).placement.version < 2:
        assert time.monotonic() < deadline, "trigger did not publish"
        await asyncio.sleep(0.05)
    placement = (await cb.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1", version=2))).placement
    assert placement.stats.gain_percent >= 5.0
    # Same skew again: the new placement already balances it, so the gain gate refuses.
    for r in range(4):
        await AsyncServiceClient.over(ca.channel).report(reports("d1", r, [loads]))
    await asyncio.sleep(1.0)
    got = await cb.stub.GetDeployment(pb.GetDeploymentRequest(name="d1"))
    assert got.deployment.version == 2
    published = sum(s.metrics.rebalances.labels("d1", "auto", "published")._value.get() for s in (a, b))
    skipped = sum(s.metrics.rebalances.labels("d1", "auto", "skipped")._value.get() for s in (a, b))
    assert (published, skipped) == (1, 1)
    dry = await ca.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    # The migration-aware re-plan keeps the balanced placement as it is: nothing to publish.
    assert "moves no slot" in dry.reason and dry.placement.stats.moves == 0


@pytest.mark.slow
async def test_watchers_on_two_replicas_see_every_version_under_load(serve, connect, prefix):
    p = prefix()
    a, b = await serve(redis_url=REDIS_URL, key_prefix=p), await serve(redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await report_some_load(ca.stub)
    watches = [c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1")) for c in (ca, cb) for _ in range(25)]
    for w in watches:
        assert (await w.read()).placement.version == 1
    n = 12
    for i in range(n):
        await (ca if i % 2 else cb).stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))
    seen = await asyncio.wait_for(asyncio.gather(*(read_versions(w, n) for w in watches)), 20)
    assert all(s == list(range(2, 2 + n)) for s in seen)
    for w in watches:
        w.cancel()


async def test_a_re_created_deployment_reaches_the_other_replica_within_a_second(serve, connect, prefix):
    import grpc
    import numpy as np

    p = prefix()
    a, b = await serve(redis_url=REDIS_URL, key_prefix=p), await serve(redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    watch = cb.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1"))
    assert (await watch.read()).placement.version == 1
    await AsyncServiceClient.over(cb.channel).report(reports("d1", 0, [np.ones((4, 16), dtype=np.int32)]))
    await ca.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="d1"))
    other = small_deployment()
    other.topology.CopyFrom(pb.Topology(num_layers=2, num_experts=8, num_slots=16, num_gpus=4))
    await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=other))
    start = time.monotonic()
    # B's watcher learns the deployment it watched is gone; B serves the new one.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(watch.read(), 1.0)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    got = await cb.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"))
    assert list(got.placement.phy2log.shape) == [2, 16]
    resp = await AsyncServiceClient.over(cb.channel).report(reports("d1", 3, [np.ones((2, 8), dtype=np.int32)]))
    assert resp.accepted == 1
    assert time.monotonic() - start < 1.0
    fresh = cb.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1"))
    assert list((await fresh.read()).placement.phy2log.shape) == [2, 16]
    fresh.cancel()


@pytest.mark.slow
async def test_a_plan_longer_than_the_lease_keeps_it(serve, connect, prefix):
    """Instance A plans for longer than a lease (2 s here); instance B's Rebalance waits for it
    instead of planning the same version (which would end in ABORTED)."""
    import numpy as np

    from eplb_wire.arrays import encode

    p = prefix()
    a, b = await serve(redis_url=REDIS_URL, key_prefix=p), await serve(redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    d = pb.Deployment(
        name="slow", topology=pb.Topology(num_layers=1, num_experts=64, num_slots=80, num_gpus=16), policy="ilp"
    )
    d.planning.time_limit.FromMilliseconds(3000)  # CP-SAT cannot prove these layers: it uses it all
    await ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    counts = (np.random.default_rng(1).lognormal(0, 1.5, (1, 64)) * 100).astype(np.int32)
    await ca.stub.ReportLoad(iter([pb.ReportLoadRequest(deployment="slow", rank=0, seq=1, logical=encode(counts))]))
    first = asyncio.ensure_future(ca.stub.Rebalance(pb.RebalanceRequest(deployment="slow", force=True)))
    await asyncio.sleep(0.5)
    start = time.monotonic()
    second = await cb.stub.Rebalance(pb.RebalanceRequest(deployment="slow", force=True))
    first = await first
    assert time.monotonic() - start > a.balancer.config.lease_s  # B really waited past one lease
    assert first.published and second.published
    assert sorted([first.placement.version, second.placement.version]) == [2, 3]


async def test_a_watcher_resuming_at_a_replica_started_later_misses_no_version(serve, connect, prefix):
    """An instance that started after versions 2..5 were published has only the latest in its
    ring; a watcher resuming there after version 2 (its old instance died) still gets 3, 4, 5."""
    p = prefix()
    first = connect(await serve(redis_url=REDIS_URL, key_prefix=p))
    await first.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    await report_some_load(first.stub)
    for _ in range(4):
        assert (await first.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))).published
    late = connect(await serve(redis_url=REDIS_URL, key_prefix=p))
    call = late.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1", since_version=2))
    assert await asyncio.wait_for(read_versions(call, 3), 10) == [3, 4, 5]
    assert (await first.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True))).published
    assert await asyncio.wait_for(read_versions(call, 1), 10) == [6]
    call.cancel()
