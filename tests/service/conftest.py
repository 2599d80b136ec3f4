"""Fixtures: real servers on 127.0.0.1:0, real channels, real Redis with a per-test key prefix,
and a real local Redis Cluster (3 masters on free ports, started once per session)."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from svc_helpers import FAST, REDIS_URL, PrivateRedis, small_deployment

from eplb_bench.harness.redis_cluster import ClusterProcesses
from eplb_bench.harness.service import aio_channel
from eplb_engine.client import auth_metadata
from eplb_service.server import RunningServer, ServerConfig, start_server
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc


@pytest.fixture
def prefix() -> Callable[[], str]:
    """A fresh key prefix per test; every key under it is deleted afterwards."""
    made: list[str] = []

    def make() -> str:
        made.append(f"eplb-test-{uuid.uuid4().hex[:10]}")
        return made[-1]

    yield make
    r = redis.Redis.from_url(REDIS_URL)
    for p in made:
        keys = list(r.scan_iter(match=f"{p}:*", count=1000))
        if keys:
            r.delete(*keys)
    r.close()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., RunningServer]]:
    """``await serve(**ServerConfig fields)`` starts a server on a free port; all stop at teardown."""
    running: list[RunningServer] = []

    async def start(**overrides: object) -> RunningServer:
        config = replace(ServerConfig(port=0, balancer=replace(FAST, replica_id=uuid.uuid4().hex[:8])), **overrides)
        server = await start_server(config)
        running.append(server)
        return server

    yield start
    for server in running:
        await server.stop(0)


class Client:
    """A stub plus the channel and metadata to use with it."""

    def __init__(self, server: RunningServer, token: str | None = None, **kw: object) -> None:
        self.channel = aio_channel(server.target, **kw)
        self.stub = pb_grpc.ExpertLoadBalancerServiceStub(self.channel)
        self.metadata = auth_metadata(token)


@pytest.fixture
async def connect() -> AsyncIterator[Callable[..., Client]]:
    made: list[Client] = []

    def make(server: RunningServer, token: str | None = None, **kw: object) -> Client:
        made.append(Client(server, token, **kw))
        return made[-1]

    yield make
    for c in made:
        await c.channel.close()


@pytest.fixture(scope="session")
def private_redis() -> PrivateRedis:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not on PATH")
    server = PrivateRedis()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> ClusterProcesses:
    """3 cluster-enabled masters (``cluster-require-full-coverage no``, no persistence) in a
    temp directory; never on 6379. Tests that kill a master start it again and wait for ok."""
    if os.environ.get("EPLB_TEST_CLUSTER_PORTS"):
        # Started by .ci/run (which removes it at exit).
        ports = [int(p) for p in os.environ["EPLB_TEST_CLUSTER_PORTS"].split(",")]
        cluster = ClusterProcesses.attach(Path(os.environ["EPLB_TEST_CLUSTER_DIR"]), ports)
        yield cluster
        cluster.stop()  # the masters a test restarted; .ci/run stops the rest
        return
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not on PATH")
    with tempfile.TemporaryDirectory(prefix="eplb-cluster-") as directory:
        cluster = ClusterProcesses(Path(directory), appendfsync=None)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(params=["redis", "cluster"])
def redis_url(request: pytest.FixtureRequest) -> str:
    """The store's tests run on both kinds: one Redis (6379) and the local Redis Cluster."""
    if request.param == "redis":
        return REDIS_URL
    return request.getfixturevalue("redis_cluster").url


@pytest.fixture(params=["memory", "redis", "cluster"])
async def d1_client(request, serve, connect, prefix) -> Client:
    """A client of a server on the embedded store, one Redis or the 3-master cluster, with
    ``small_deployment()`` (``d1``) created."""
    if request.param == "memory":
        server = await serve()
    else:
        url = REDIS_URL if request.param == "redis" else request.getfixturevalue("redis_cluster").url
        server = await serve(redis_url=url, key_prefix=prefix())
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    return c
