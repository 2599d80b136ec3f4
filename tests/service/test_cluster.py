"""The service on a real local Redis Cluster (3 masters, ``cluster-require-full-coverage no``).

Before: every CreateDeployment on a cluster failed with ``INTERNAL: MovedError`` (the
deployments set lives in another slot), the announce reader's multi-stream XREAD failed with
CROSSSLOT, and after one master was SIGKILLed every call on the other masters' deployments
failed while health stayed SERVING."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_helpers import report_some_load, small_deployment, timed

from eplb import limits
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service.cluster import ClusterUrl, parse_cluster_url
from eplb_service.server import SERVICE_NAME
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_cluster_urls_name_seed_nodes_tls_credentials_and_options():
    assert parse_cluster_url("redis://127.0.0.1:6379/0") is None
    assert parse_cluster_url("redis+cluster://127.0.0.1:7000,[::1]:7001/") == ClusterUrl(
        (("127.0.0.1", 7000), ("::1", 7001)), False, None, None
    )
    url = parse_cluster_url("rediss+cluster://eplb:p%40ss@h1:7000?ssl_ca_certs=/ca.pem")
    assert url == ClusterUrl((("h1", 7000),), True, "eplb", "p@ss", (("ssl_ca_certs", "/ca.pem"),))
    with pytest.raises(ValueError, match="HOST:PORT seed nodes"):
        parse_cluster_url("redis+cluster://h1:7000,h2")
    with pytest.raises(ValueError, match="unknown option 'db'"):
        parse_cluster_url("redis+cluster://h1:7000?db=1")


async def health(c, service: str) -> int:
    return (await health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(service=service))).status


async def eventually(fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if await fn():
                return
        except grpc.aio.AioRpcError:
            pass
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_two_replicas_serve_deployments_spread_over_the_masters(serve, connect, redis_url):
    p = f"eplb-test-{uuid.uuid4().hex[:10]}"
    a, b = (
        connect(await serve(redis_url=redis_url, key_prefix=p)),
        connect(await serve(redis_url=redis_url, key_prefix=p)),
    )
    names = [f"d{i}" for i in range(6)]
    for n in names:
        await a.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(n)))
    listed = await b.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert [d.name for d in listed.deployments] == names
    watches = [b.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment=n)) for n in names]
    assert [(await w.read()).placement.version for w in watches] == [1] * 6
    loads = np.arange(64, dtype=np.int32).reshape(4, 16)
    for n in names:
        assert (await AsyncServiceClient.over(b.channel).report(reports(n, 0, [loads]))).accepted == 1
        out = await a.stub.Rebalance(pb.RebalanceRequest(deployment=n, force=True))
        assert out.published and out.window_reports == 1
    assert [(await w.read()).placement.version for w in watches] == [2] * 6
    await a.stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="d3"))
    listed = await b.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert [d.name for d in listed.deployments] == ["d0", "d1", "d2", "d4", "d5"]


async def test_a_dead_master_takes_down_only_the_deployments_of_its_slots(serve, connect, redis_cluster, monkeypatch):
    p = f"eplb-test-{uuid.uuid4().hex[:10]}"
    by_port: dict[int, str] = {}
    i = 0
    while len(by_port) < len(redis_cluster.ports):
        by_port.setdefault(redis_cluster.port_of(f"{p}:{{d{i}}}:meta"), f"d{i}")
        i += 1
    victim_port = redis_cluster.ports[1]
    victim = by_port[victim_port]
    others = [n for port, n in by_port.items() if port != victim_port]
    a = connect(await serve(redis_url=redis_cluster.url, key_prefix=p))
    b = connect(await serve(redis_url=redis_cluster.url, key_prefix=p))
    for n in by_port.values():
        await a.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(n)))
        await report_some_load(a.stub, n)
        await a.stub.Rebalance(pb.RebalanceRequest(deployment=n, force=True))
    # b follows every deployment (as its refresh makes it do), so it can serve them from memory.
    watches = {n: b.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment=n)) for n in by_port.values()}
    for w in watches.values():
        while (await w.read()).placement.version < 2:
            pass
    watch = watches[others[0]]
    loads = np.ones((4, 16), dtype=np.int32)

    redis_cluster.kill(victim_port)  # no persistence: it comes back empty
    try:
        await eventually(lambda: _is(health(b, f"{SERVICE_NAME}/{victim}"), NOT_SERVING))
        assert await health(b, SERVICE_NAME) == SERVING and await health(b, "") == SERVING
        for n in others:
            assert await health(b, f"{SERVICE_NAME}/{n}") == SERVING
            assert (await AsyncServiceClient.over(b.channel).report(reports(n, 0, [loads]))).accepted == 1
            assert (await a.stub.Rebalance(pb.RebalanceRequest(deployment=n, force=True))).published
        assert (await watch.read()).placement.version == 3
        # The dead master's deployment: its placement from memory, its writes refused at once.
        got = await b.stub.GetPlacement(pb.GetPlacementRequest(deployment=victim))
        assert got.placement.version == 2
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await AsyncServiceClient.over(b.channel).report(reports(victim, 0, [loads]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"127.0.0.1:{victim_port}" in info.value.details() and time.monotonic() - started < 0.5
        # The deployment-count limit still holds (the index bucket sizes are remembered).
        monkeypatch.setattr(limits, "MAX_DEPLOYMENTS", len(by_port))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await a.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("one-too-many")))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        redis_cluster.start_node(victim_port)
        redis_cluster.wait_ok()
    # Back empty: the instances write its deployment back (that master only) and it serves again.
    await eventually(lambda: _is(health(b, f"{SERVICE_NAME}/{victim}"), SERVING))
    await eventually(lambda: _reports(b, victim, loads), timeout=15)
    got = await a.stub.GetDeployment(pb.GetDeploymentRequest(name=victim))
    assert got.deployment.version == 2
    listed = await a.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert sorted(d.name for d in listed.deployments) == sorted(by_port.values())


async def _is(coro, want) -> bool:
    return await coro == want


async def _reports(c, name: str, loads: np.ndarray) -> bool:
    return (await AsyncServiceClient.over(c.channel).report(reports(name, 1, [loads]))).accepted == 1


async def test_a_hung_master_fails_every_call_of_its_deployments_within_one_socket_timeout(
    serve, connect, redis_cluster
):
    # SIGSTOP: the master's sockets stay open and nothing answers. The cluster client retried a
    # timed-out call on the same master three times (4.1 s), and each store call of an RPC, each
    # index bucket of a list and each report batch queued behind another waited its own timeout.
    p = f"eplb-test-{uuid.uuid4().hex[:10]}"
    victim_port = redis_cluster.ports[2]
    on_victim: list[str] = []
    others: list[str] = []
    i = 0
    while len(on_victim) < 4 or len(others) < 2:
        name = f"d{i}"
        (on_victim if redis_cluster.port_of(f"{p}:{{{name}}}:meta") == victim_port else others).append(name)
        i += 1
    victim, to_delete, fresh, fresh2 = on_victim[:4]
    others = others[:2]
    c = connect(await serve(redis_url=redis_cluster.url, key_prefix=p))
    loads = np.ones((4, 16), dtype=np.int32)
    for n in (victim, to_delete, *others):
        await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(n)))
        await report_some_load(c.stub, n)
        await c.stub.Rebalance(pb.RebalanceRequest(deployment=n, force=True))

    def victim_calls(new_name: str) -> dict[str, object]:
        s = c.stub
        return {
            "GetDeployment": s.GetDeployment(pb.GetDeploymentRequest(name=victim)),
            "GetPlacement(window)": s.GetPlacement(
                pb.GetPlacementRequest(deployment=victim, include_window_loads=True)
            ),
            "AckPlacement": s.AckPlacement(pb.AckPlacementRequest(deployment=victim, rank=0, version=2)),
            "Rebalance": s.Rebalance(pb.RebalanceRequest(deployment=victim, force=True)),
            "SetRanksDown": s.SetRanksDown(pb.SetRanksDownRequest(deployment=victim, down=[7])),
            "CreateDeployment": s.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment(new_name))),
            "DeleteDeployment": s.DeleteDeployment(pb.DeleteDeploymentRequest(name=to_delete)),
            **{
                f"ReportLoad(rank {r})": AsyncServiceClient.over(c.channel).report(reports(victim, r, [loads]))
                for r in range(4)
            },
        }

    redis_cluster.pause(victim_port)
    try:
        for wave, new_name in enumerate((fresh, fresh2)):
            # The second wave 0.5 s in: reports queue behind the first wave's batch in flight.
            if wave:
                await asyncio.sleep(0.5)
            calls = victim_calls(new_name)
            served = {
                "GetPlacement": c.stub.GetPlacement(pb.GetPlacementRequest(deployment=victim)),  # from memory
                "ListDeployments": c.stub.ListDeployments(pb.ListDeploymentsRequest()),  # the others
            }
            tasks = {what: asyncio.create_task(timed(call)) for what, call in {**calls, **served}.items()}
            if wave:
                # Deployments on the other masters keep serving meanwhile.
                for n in others:
                    code, took = await timed(AsyncServiceClient.over(c.channel).report(reports(n, 0, [loads])))
                    assert code == grpc.StatusCode.OK and took < 0.5, (n, code, took)
                    code, took = await timed(c.stub.Rebalance(pb.RebalanceRequest(deployment=n, force=True)))
                    assert code == grpc.StatusCode.OK and took < 1.0, (n, code, took)
            got = {what: await task for what, task in tasks.items()}
            for what in calls:
                code, took = got[what]
                assert code == grpc.StatusCode.UNAVAILABLE and took <= 1.5, (wave, what, code.name, f"{took:.2f}s")
            for what in served:
                code, took = got[what]
                assert code == grpc.StatusCode.OK and took <= 1.5, (wave, what, code.name, f"{took:.2f}s")
    finally:
        redis_cluster.resume(victim_port)
    # Back: its deployment takes reports again, as it was.
    await eventually(lambda: _reports(c, victim, loads), timeout=15)
    got = await c.stub.GetDeployment(pb.GetDeploymentRequest(name=victim))
    assert got.deployment.version == 2
    listed = await c.stub.ListDeployments(pb.ListDeploymentsRequest())
    assert sorted(d.name for d in listed.deployments) == sorted((victim, to_delete, *others))
