"""A bare gRPC server of the balancer's service: the floor under ``ingest_bench``'s figures.

    python -m eplb_bench.harness.bare_server --port PORT

ReportLoad and StreamLoad only receive each message (gRPC's receive and protobuf's parse, as ``eplb serve``
gets them) and counts it; GetPlacement returns one pre-built response of a v3-prefill
placement's size (int32 ``[58, 288]`` phy2log and float32 ``[58, 256]`` loads); CreateDeployment
answers without storing. No validation, no Redis, no window: what GetPlacement's tail is with
nothing but the reports' reception on the event loop. Same server options as ``eplb serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc
import numpy as np

from eplb_service.server import ServerConfig, grpc_options
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .service import V3

_ACK = pb.ReportLoadAck(accepted=True)


class BareServicer(pb_grpc.ExpertLoadBalancerServiceServicer):
    """Receives reports and answers GetPlacement from one pre-built response."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        L, E, P = V3["num_layers"], V3["num_experts"], V3["num_slots"]
        phy = rng.integers(0, E, size=(L, P), dtype=np.int32)
        loads = rng.random((L, E), dtype=np.float32)
        self._placement = pb.Placement(
            deployment="bare",
            version=2,
            phy2log=pb.Array(dtype=pb.DTYPE_INT32, shape=[L, P], data=phy.tobytes()),
            loads=pb.Array(dtype=pb.DTYPE_FLOAT32, shape=[L, E], data=loads.tobytes()),
        )
        self._response = pb.GetPlacementResponse(placement=self._placement)
        self.reports = 0

    async def CreateDeployment(self, request, context):
        return pb.CreateDeploymentResponse(deployment=request.deployment, placement=self._placement)

    async def ReportLoad(self, request_iterator, context):
        accepted = 0
        async for _ in request_iterator:
            accepted += 1
        self.reports += accepted
        return pb.ReportLoadResponse(accepted=accepted)

    async def StreamLoad(self, request_iterator, context):
        async for _ in request_iterator:
            self.reports += 1
            yield _ACK

    async def GetPlacement(self, request, context):
        return self._response


async def _serve(port: int) -> None:
    server = grpc.aio.server(options=grpc_options(ServerConfig()))
    pb_grpc.add_ExpertLoadBalancerServiceServicer_to_server(BareServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"listening on 127.0.0.1:{port}", flush=True)
    await stop.wait()
    await server.stop(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    asyncio.run(_serve(args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
