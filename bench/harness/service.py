"""What the service benchmarks share (``service_bench``, ``ingest_bench``): the v3-prefill
deployment, its creation, a GetPlacement latency client process, percentiles."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import numpy as np

V3 = dict(num_layers=58, num_experts=256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def latency_worker(target: str, name: str, callers: int, seconds: float, pace_s: float, out: mp.Queue) -> None:
    from eplb_service.client import EngineClient, channel
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    async def main() -> None:
        chan = channel(target)
        stub = EngineClient(chan, name, 0).stub
        req = pb.GetPlacementRequest(deployment=name)
        await stub.GetPlacement(req)
        lat: list[float] = []
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

        start = time.perf_counter()
        await asyncio.gather(*(caller(i) for i in range(callers)))
        elapsed = time.perf_counter() - start
        await chan.close()
        out.put((lat, elapsed))

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
