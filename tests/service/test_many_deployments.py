"""130 deployments over 2 instances, then a third joining: every instance serves every deployment
(one announce reader per instance, a bounded connection pool), and the API can still delete."""

from __future__ import annotations

import asyncio
import time

import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_helpers import REDIS_URL, report_some_load, small_deployment

from eplb_service.redis_store.store import POOL_CONNECTIONS
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

N = 130


def seen_version(server, name: str) -> float | None:
    """``eplb_placement_version{deployment=name}`` on ``server``: the version its follower of the
    deployment (or its own create or publish) delivered; None before any."""
    return server.metrics.registry.get_sample_value("eplb_placement_version", {"deployment": name})


async def all_seen(server, names: list[str], version: int = 1, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while any(seen_version(server, n) != version for n in names):
        assert time.monotonic() < deadline, f"the instance never followed every deployment to version {version}"
        await asyncio.sleep(0.1)


def connections_named(name: str) -> int:
    r = redis.Redis.from_url(REDIS_URL)
    try:
        return sum(1 for c in r.client_list() if c.get("name") == name)
    finally:
        r.close()


async def test_130_deployments_on_two_replicas_and_a_third_joining(serve, connect, prefix):
    p = prefix()
    a, b = await serve(redis_url=REDIS_URL, key_prefix=p), await serve(redis_url=REDIS_URL, key_prefix=p)
    ca, cb = connect(a), connect(b)
    names = [f"m{i:03d}" for i in range(N)]
    await asyncio.gather(
        *(ca.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(n))) for n in names)
    )
    await all_seen(a, names)
    await all_seen(b, names)  # b created none: its followers delivered them
    c = await serve(redis_url=REDIS_URL, key_prefix=p)
    cc = connect(c)
    await all_seen(c, names)
    for client in (ca, cb, cc):
        health = await health_pb2_grpc.HealthStub(client.channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        got = await asyncio.gather(*(client.stub.GetPlacement(pb.GetPlacementRequest(deployment=n)) for n in names))
        assert [g.placement.version for g in got] == [1] * N
    # A re-plan through the newcomer reaches the others' followers.
    await report_some_load(cc.stub, "m129")
    out = await cc.stub.Rebalance(pb.RebalanceRequest(deployment="m129", force=True))
    assert out.published and out.placement.version == 2
    await all_seen(a, ["m129"], version=2, timeout=5)  # a and b see it only by following
    await all_seen(b, ["m129"], version=2, timeout=5)
    deadline = time.monotonic() + 5
    while (await cb.stub.GetPlacement(pb.GetPlacementRequest(deployment="m129"))).placement.version != 2:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await cb.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="m000"))
    listed = await cc.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert [d.name for d in listed.deployments] == names[1:]
    # Connections stay bounded whatever the number of deployments (each instance names its
    # connections eplb:<prefix>): at most the pool plus the announce reader per instance.
    assert 3 <= connections_named(f"eplb:{p}") <= 3 * (POOL_CONNECTIONS + 1)


async def test_an_idle_replica_reads_the_index_not_every_deployment(serve, connect):
    """An idle instance's store traffic with 60 deployments: its refresh reads the index (not every
    record each round) and the deletion check one command a deployment, so it sends about 2
    commands a deployment a second (FAST's 0.3 s refresh): 135 a second for 60; it sent 964."""
    from svc_helpers import PrivateRedis

    private = PrivateRedis()
    private.start()
    try:
        server = await serve(redis_url=private.url, key_prefix="idle")
        c = connect(server)
        names = [f"d{i}" for i in range(60)]
        for n in names:
            await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(n)))
        await all_seen(server, names)
        r = redis.Redis(port=private.port)
        await asyncio.sleep(1.0)  # past the creates' own traffic
        before, start = r.info("stats")["total_commands_processed"], time.monotonic()
        await asyncio.sleep(3.0)
        per_s = (r.info("stats")["total_commands_processed"] - before - 1) / (time.monotonic() - start)
        r.close()
        assert per_s < 3 * len(names), f"{per_s:.0f} commands/s for {len(names)} idle deployments"
        # A deployment created elsewhere is still followed.
        other = connect(await serve(redis_url=private.url, key_prefix="idle"))
        await other.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("late")))
        await all_seen(server, ["late"])
    finally:
        private.stop()
