"""What the service benchmarks and tests share: the v3-prefill deployment, its creation, a
GetPlacement latency client process, percentiles, a ``grpc.aio`` channel with the engine
client's options (``aio_channel``) and rank reports with growing seqs (``reports``)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import grpc

    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

V3 = dict(num_layers=58, num_experts=256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)

# The last seq ``reports`` gave, in this process (for any deployment and rank).
_last_seq = 0


def aio_channel(
    target: str, root_certificates: bytes | None = None, max_message_bytes: int = 16 * 1024 * 1024
) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target`` with the engine client's options (message limit,
    keepalive, quick reconnects): TLS with ``root_certificates``, plaintext without. The caller
    closes it; ``eplb_engine.AsyncServiceClient.over(channel)`` runs calls on it."""
    from eplb_engine.client import channel_options, open_channel

    return open_channel(target, root_certificates, channel_options(max_message_bytes), aio=True)


def reports(
    deployment: str, rank: int, batches: Sequence[np.ndarray], placement_version: int | None = None
) -> list[pb.ReportLoadRequest]:
    """One ``ReportLoadRequest`` per item of ``batches``: ``[L, E]`` logical counts, or ``[L, P]``
    physical ones recorded under ``placement_version``.

    Each seq is ``max(last + 1, now in µs)``: above every seq this process gave before and, as a
    restarted rank's, above those an earlier process gave (the service drops a report whose
    seq is not above the last it accepted from the rank)."""
    from eplb_engine.client import report_request

    global _last_seq
    out = []
    for counts in batches:
        _last_seq = max(_last_seq + 1, time.time_ns() // 1000)
        out.append(report_request(deployment, rank, _last_seq, counts, placement_version))
    return out


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def latency_worker(
    target: str, name: str, callers: int, seconds: float, pace_s: float, out: mp.Queue, start=None, lead_s: float = 0.0
) -> None:
    """``callers`` GetPlacement callers (each every ``pace_s``; 0: back to back) for ``seconds``;
    puts ``(latencies, elapsed, cpu_s)`` on ``out``: cpu_s is this process's CPU over the calls.
    ``start``: a barrier passed once connected (and one call made), so that the calls begin
    with the other clients' load rather than during their start-up; the calls start ``lead_s``
    after it, once the load is under way."""
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
    from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

    async def main() -> None:
        chan = aio_channel(target)
        stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
        req = pb.GetPlacementRequest(deployment=name)
        await stub.GetPlacement(req)
        if start is not None:
            await asyncio.get_running_loop().run_in_executor(None, start.wait, 120)
        await asyncio.sleep(lead_s)
        lat: list[float] = []
        cpu0 = time.process_time()
        deadline = time.perf_counter() + seconds

        async def caller(i: int) -> None:
            nxt = time.perf_counter() + pace_s * i / callers  # spread paced callers evenly
            while True:
                if pace_s:
                    await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
                    nxt += pace_s
                t = time.perf_counter()
                if t > deadline:
                    return
                await stub.GetPlacement(req)
                lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        await chan.close()
        out.put((lat, elapsed, cpu))

    asyncio.run(main())


def create_v3(target: str, name: str, ranks: int = 0) -> None:
    """Creates the v3-prefill deployment with ranks 0 .. max(ranks, num_gpus) - 1."""
    import grpc

    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
    from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as ch:
        pb_grpc.ExpertLoadBalancerServiceStub(ch).CreateDeployment(
            pb.CreateDeploymentRequest(
                deployment=pb.Deployment(name=name, topology=pb.Topology(**V3), ranks=range(max(ranks, V3["num_gpus"])))
            )
        )
