"""Fixtures shared by the engine's tests against a real service."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
import redis
from agent_helpers import TOPO
from svc_thread import REDIS_URL, ServerThread

from eplb_engine.client import ServiceClient


@pytest.fixture
def prefix():
    """A fresh Redis key prefix for the test's replicas; its keys are deleted afterwards."""
    p = f"eplb-engine-test-{uuid.uuid4().hex[:10]}"
    yield p
    r = redis.Redis.from_url(REDIS_URL)
    keys = list(r.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        r.delete(*keys)
    r.close()


@pytest.fixture
def d1_server():
    """A service (embedded store) with deployment d1 of ``agent_helpers.TOPO``."""
    s = ServerThread().start()
    with ServiceClient(s.address) as client:
        client.create_deployment("d1", TOPO)
    yield s
    s.stop()


@pytest.fixture
def sock_path():
    """A path for a node agent's socket, in a directory removed afterwards."""
    with tempfile.TemporaryDirectory() as d:
        yield os.path.join(d, "agent.sock")
