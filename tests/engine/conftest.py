"""Fixtures shared by the engine's tests against a real service."""

from __future__ import annotations

import uuid

import pytest
import redis
from svc_thread import REDIS_URL


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
