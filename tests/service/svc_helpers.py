"""Helpers shared by the service tests (conftest.py holds the fixtures)."""

from __future__ import annotations

import subprocess
import time

import grpc
import numpy as np
import redis

from eplb_service.balancer import BalancerConfig
from eplb_tools.ports import free_port
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

REDIS_URL = "redis://127.0.0.1:6379/0"
# Fast timings so tests see flushes, triggers and lease expiry within a second or two.
FAST = BalancerConfig(lease_s=2.0, flush_s=0.1, tick_s=0.1, refresh_s=0.3)


def small_deployment(name: str = "d1", **trigger: object) -> pb.Deployment:
    """4 layers, 16 experts in 4 groups, 24 slots on 8 gpus in 2 nodes."""
    return pb.Deployment(
        name=name,
        topology=pb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4),
        policy="auto",
        trigger=pb.Trigger(**trigger),
    )


async def report_some_load(
    stub: object, deployment: str = "d1", shape: tuple[int, int] = (4, 16), rank: int = 0, metadata: tuple = ()
) -> None:
    """One skewed ``[L, E]`` report from ``rank``, so a forced Rebalance has load to plan (on an
    empty window it is FAILED_PRECONDITION). ``shape``: the deployment's layers and experts
    (``small_deployment``'s by default)."""
    from eplb_wire.arrays import encode

    counts = np.broadcast_to((np.arange(shape[1], dtype=np.int32) % 7 + 1) * 10, shape).copy()
    seq = time.time_ns() // 1000  # above any seq this rank sent before
    request = pb.ReportLoadRequest(deployment=deployment, rank=rank, seq=seq, logical=encode(counts))
    await stub.ReportLoad(iter([request]), metadata=metadata)


class PrivateRedis:
    """A ``redis-server`` on a spare port that a test may stop and start again (no persistence)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        r = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        r.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


def status_details(exc: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    """The ``google.rpc.BadRequest`` field violations of a failed call."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    status = rpc_status.from_call(exc)
    out = []
    for detail in status.details if status else []:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out += [(v.field, v.description) for v in bad.field_violations]
    return out


async def timed(call: object) -> tuple[grpc.StatusCode, float]:
    """``call``'s status code (OK when it returned) and the seconds it took to answer."""
    start = time.monotonic()
    try:
        await call
        code = grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
    return code, time.monotonic() - start
