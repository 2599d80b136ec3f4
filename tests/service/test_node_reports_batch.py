"""A refused node report must not make another report of the same store batch a duplicate: its
pairs are flagged again without it (found by a review: rank 0's own report of the seq a refused
node report covered was answered 'duplicate', its counts lost)."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest
from svc_helpers import REDIS_URL, small_deployment

from eplb_service.memory_store import MemoryStore
from eplb_service.redis_store import RedisStore
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

L, E = 4, 16


def _deployment(name: str) -> pb.Deployment:
    d = pb.Deployment(name=name)
    d.create_time.FromNanoseconds(time.time_ns())
    return d


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        s = MemoryStore()
    else:
        s = RedisStore(REDIS_URL, f"eplb-test-{uuid.uuid4().hex[:10]}")
    await s.create(_deployment("d1"), pb.Placement(deployment="d1", version=1))
    yield s
    await s.delete("d1")
    if hasattr(s, "close"):
        await s.close()


async def test_a_report_after_a_refused_node_report_in_one_batch_is_new(store):
    # Rank 1 counted seq 1 on its own; rank 0 has nothing counted.
    assert (await store.accept_reports("d1", [(1, 1)], lambda f: b"x", 60.0))[0] == [True]
    # One batch: a node report covering (0, 2) and (1, 1) (partly counted: refused), then rank
    # 0's own report of seq 2 (e.g. re-sent after the agent said ON_YOUR_OWN).
    flags, _ = await store.accept_reports("d1", [(0, 2), (1, 1), (0, 2)], lambda f: b"x", 60.0, groups=[0, 0, 1])
    assert flags[:2] == [None, None]
    # Rank 0's seq 2 is above its high-water mark (none) once the node report is refused: new.
    assert flags[2] is True, flags


def own(rank: int, seq: int) -> pb.ReportLoadRequest:
    return pb.ReportLoadRequest(deployment="d1", rank=rank, seq=seq, logical=encode(np.ones((L, E), dtype=np.int32)))


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_concurrent_node_report_and_own_report(serve, connect, prefix, backend):
    """Two ReportLoad calls in one store batch: a node report refused (ABORTED) and rank 0's own
    report of the seq it covered. Rank 0's call is answered 'duplicate' and its counts are lost."""
    server = await (serve() if backend == "memory" else serve(redis_url=REDIS_URL, key_prefix=prefix()))
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    assert (await c.stub.ReportLoad(iter([own(1, 1)]))).accepted == 1
    node = pb.ReportLoadRequest(
        deployment="d1",
        covers=[pb.ReportCover(rank=0, seq=2), pb.ReportCover(rank=1, seq=1)],
        logical=encode(np.full((L, E), 2, dtype=np.int32)),
    )
    ingest = server.balancer.ingest
    node_answer, own_answer = await asyncio.gather(
        ingest.report(node), ingest.report(own(0, 2)), return_exceptions=True
    )
    assert type(node_answer).__name__ == "Aborted", node_answer
    assert own_answer is True, own_answer  # False: 'duplicate', yet rank 0 had nothing counted
    dry = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    assert (dry.window_reports, dry.window_tokens) == (2, 2 * L * E)
