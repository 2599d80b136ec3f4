"""grpc.health.v1 through real channels: the Watch stream, client-side health checking, shutdown."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from eplb_service.server import SERVICE_NAME
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def _next(stream: object, timeout: float = 5.0) -> int:
    return (await asyncio.wait_for(stream.read(), timeout)).status


async def test_watch_streams_status_until_shutdown_ends_it(serve, connect):
    server = await serve(grace_s=2.0)
    c = connect(server)
    stream = health_pb2_grpc.HealthStub(c.channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert await _next(stream) == SERVING
    await server.health.set(SERVICE_NAME, NOT_SERVING)
    assert await _next(stream) == NOT_SERVING
    await server.health.set(SERVICE_NAME, SERVING)
    assert await _next(stream) == SERVING
    stopping = asyncio.create_task(server.stop())
    # Shutdown: NOT_SERVING reaches the watcher first, then its stream ends and says go elsewhere.
    assert await _next(stream) == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(stream.read(), 5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "another instance" in err.value.details()
    await stopping


async def test_watch_of_an_unknown_service_says_so(serve, connect):
    server = await serve()
    c = connect(server)
    stream = health_pb2_grpc.HealthStub(c.channel).Watch(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert await _next(stream) == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    stream.cancel()


async def test_client_side_health_checking_routes_around_a_not_serving_replica(serve):
    """Round robin over two instances with gRPC's client-side health checking (it watches
    ``Health/Watch``): calls reach both while both serve, only the serving one otherwise."""
    a, b = await serve(), await serve()
    config = {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": SERVICE_NAME}}
    chan = grpc.aio.insecure_channel(
        f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}", options=[("grpc.service_config", json.dumps(config))]
    )
    stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
    method = "ExpertLoadBalancerService/ListDeployments"

    def calls(server: object) -> float:
        return server.metrics.rpc_requests.labels(method, "OK")._value.get()

    try:
        for _ in range(20):
            await stub.ListDeployments(pb.ListDeploymentsRequest(), timeout=5, wait_for_ready=True)
        assert calls(a) > 0 and calls(b) > 0 and calls(a) + calls(b) == 20

        await a.health.set(SERVICE_NAME, NOT_SERVING)
        # The client learns it from its Watch stream; wait until a call no longer reaches a.
        for _ in range(100):
            before = calls(a)
            for _ in range(4):
                await stub.ListDeployments(pb.ListDeploymentsRequest(), timeout=5)
            if calls(a) == before:
                break
            await asyncio.sleep(0.05)
        before_a, before_b = calls(a), calls(b)
        for _ in range(20):
            await stub.ListDeployments(pb.ListDeploymentsRequest(), timeout=5)
        assert calls(a) == before_a and calls(b) == before_b + 20

        # No instance serving: once the client has seen it, calls fail without reaching either.
        await b.health.set(SERVICE_NAME, NOT_SERVING)
        for _ in range(100):
            try:
                await stub.ListDeployments(pb.ListDeploymentsRequest(), timeout=1)
            except grpc.aio.AioRpcError:
                break
            await asyncio.sleep(0.05)
        reached = calls(a) + calls(b)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ListDeployments(pb.ListDeploymentsRequest(), timeout=1)
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert calls(a) + calls(b) == reached
    finally:
        await chan.close()
