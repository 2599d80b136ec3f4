"""One tenant cannot hurt another: capped reports, and a failing deployment never stops the
trigger loop from re-planning the others."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Self

import grpc
import numpy as np
import redis
from svc_helpers import REDIS_URL, small_deployment, status_details

from eplb import limits
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb


def logical(counts: np.ndarray, seq: int, rank: int = 0) -> pb.ReportLoadRequest:
    msg = pb.ReportLoadRequest(deployment="d1", rank=rank, seq=seq)
    msg.logical.CopyFrom(
        pb.Array(dtype=pb.DTYPE_FLOAT64, shape=list(counts.shape), data=counts.astype("<f8").tobytes())
    )
    return msg


async def test_a_report_over_the_cap_is_refused_and_the_window_stays_finite(serve, connect, prefix):
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix())
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    huge = np.full((4, 16), 1e308)
    with grpc_error() as info:
        await c.stub.ReportLoad(iter([logical(huge, 1)]))
    assert info.code == grpc.StatusCode.INVALID_ARGUMENT
    assert [f for f, _ in info.details] == ["logical.data"] and "cap" in info.details[0][1]
    ok = np.full((4, 16), limits.MAX_REPORT_COUNT)
    ok[:, 0] = 0
    assert (await c.stub.ReportLoad(iter([logical(ok, 2), logical(ok, 3)]))).accepted == 2
    dry = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    assert dry.window_reports == 2 and np.isfinite(dry.window_tokens)
    assert server.metrics.reports_rejected.labels("d1", "over_cap")._value.get() == 1


class grpc_error:
    """``with grpc_error() as e:`` expects an AioRpcError; ``e.code`` and ``e.details`` after."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, typ, exc, tb) -> bool:
        assert isinstance(exc, grpc.aio.AioRpcError), f"expected an RPC error, got {exc!r}"
        self.code, self.details = exc.code(), status_details(exc)
        return True


async def test_a_failing_deployment_does_not_stop_the_others_from_re_planning(serve, connect, prefix, caplog):
    p = prefix()
    server = await serve(redis_url=REDIS_URL, key_prefix=p)
    c = connect(server)
    for name in ("a-broken", "b-fine"):
        await c.stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=small_deployment(name, report_count=2, min_gain_percent=1.0))
        )
    # Break "a-broken" behind the service's back: its current placement no longer decodes, so
    # every re-plan of it raises (as a poisoned window did before reports were capped).
    r = redis.Redis.from_url(REDIS_URL)
    broken = pb.Placement.FromString(r.get(f"{p}:{{a-broken}}:placement:1"))
    broken.phy2log.data = b"\0" * 8
    r.set(f"{p}:{{a-broken}}:placement:1", broken.SerializeToString())
    r.close()
    loads = np.ones((4, 16), dtype=np.int32)
    loads[:, 0] = 1000
    caplog.set_level(logging.WARNING, logger="eplb_service.balancer")
    for name in ("a-broken", "b-fine"):
        for rank in range(2):
            await AsyncServiceClient.over(c.channel).report(reports(name, rank, [loads]))
    deadline = time.monotonic() + 10
    while (await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="b-fine"))).placement.version < 2:
        assert time.monotonic() < deadline, "b-fine was never re-planned"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # a few more trigger ticks: a-broken keeps failing
    failures = server.metrics.replan_failures.labels("a-broken")._value.get()
    assert failures >= 2
    assert server.metrics.replan_failures.labels("b-fine")._value.get() == 0
    lines = [rec for rec in caplog.records if "a-broken" in rec.getMessage() and "failed" in rec.getMessage()]
    assert len(lines) == 1  # logged once per state change, not once per tick
