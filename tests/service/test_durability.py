"""Every report an instance accepted stays counted when the instance dies (SIGKILL) or stops (SIGTERM).

An instance runs as its own process (``eplb serve``); eight ranks stream reports to it, and the
ranks whose stream broke re-send that stream's reports, same seqs, to a second instance, as a
client must. Read back through the second instance, the window holds every report exactly once.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess

import grpc
import numpy as np
import pytest
from svc_helpers import REDIS_URL, free_port, small_deployment

from eplb_bench.harness.processes import serve_argv
from eplb_bench.harness.service import aio_channel, reports
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

L, E = 4, 16
# Reports per stream, 10 ms apart: a stream under way at SIGTERM goes on into the grace period.
STREAM = 40


def start_replica(prefix: str, port: int) -> subprocess.Popen:
    """``eplb serve`` on ``port``; windows flushed every 2 s, so most reports are not flushed yet."""
    return subprocess.Popen(
        serve_argv(port, REDIS_URL, prefix, "--flush-seconds", "2", "--grace-seconds", "1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def rank_loop(target: grpc.aio.Channel, fallback: grpc.aio.Channel, rank: int) -> int:
    """Streams reports of ``rank + 1`` tokens per expert in streams of ``STREAM`` until one breaks
    (the instance is gone), then re-sends that stream to ``fallback``. Returns how many distinct
    reports it sent."""
    stub = pb_grpc.ExpertLoadBalancerServiceStub(target)
    counts = np.full((L, E), rank + 1, dtype=np.int32)
    sent = 0
    while True:
        batch = reports("d1", rank, [counts] * STREAM)

        async def paced(batch: list[pb.ReportLoadRequest] = batch):
            for msg in batch:
                yield msg
                await asyncio.sleep(0.01)

        try:
            resp = await stub.ReportLoad(paced())
            assert (resp.accepted, resp.duplicates) == (STREAM, 0)
            sent += STREAM
        except grpc.aio.AioRpcError as exc:
            # A stream cut mid-send surfaces client-side as INTERNAL ("Failed execute_batch").
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL), exc
            resp = await pb_grpc.ExpertLoadBalancerServiceStub(fallback).ReportLoad(iter(batch))
            assert resp.accepted + resp.duplicates == STREAM
            return sent + STREAM


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_accepted_reports_survive_the_replica(sig, serve, connect, prefix):
    p = prefix()
    port = free_port()
    proc = start_replica(p, port)
    try:
        survivor = connect(await serve(redis_url=REDIS_URL, key_prefix=p))
        await survivor.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
        victim = aio_channel(f"127.0.0.1:{port}")
        await asyncio.wait_for(victim.channel_ready(), 30)
        ranks = [asyncio.create_task(rank_loop(victim, survivor.channel, r)) for r in range(8)]
        await asyncio.sleep(1.2)
        proc.send_signal(sig)
        sent = await asyncio.wait_for(asyncio.gather(*ranks), 30)
        await victim.close()
    finally:
        proc.kill()
        proc.wait()
    assert all(n >= STREAM for n in sent), sent  # every rank had reports accepted before the signal
    dry = await survivor.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    assert dry.window_reports == sum(sent)
    assert dry.window_tokens == sum(n * (r + 1) * L * E for r, n in enumerate(sent))
