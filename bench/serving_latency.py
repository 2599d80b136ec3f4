"""GetPlacement latency while re-plans run: planning in the serving process vs in worker processes.

Starts a balancer (in-process store) in a child process, creates a v3-sized deployment, feeds
it skewed loads, then for ``--seconds`` keeps forced Rebalance calls running back to back while
one client calls GetPlacement in a loop, and prints the latency percentiles of GetPlacement.
``--workers 0`` plans in a thread of the serving process (the service before plans moved to
worker processes); the default compares 0 and 2, and GetPlacement with no re-plans (the floor),
``--runs`` times each, interleaved. On a shared machine, read the per-run figures too.

    python -m eplb_bench.serving_latency --runs 3 --seconds 8 [--effort high]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import numpy as np

from eplb_tools.ports import free_port
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc
from eplb_wire.arrays import encode

from .harness.service import aio_channel

# DeepSeek-V3 prefill-sized: 58 MoE layers, 256 experts, 288 slots on 32 gpus in 4 nodes.
TOPOLOGY = pb.Topology(num_layers=58, num_experts=256, num_slots=288, num_gpus=32, num_nodes=4, num_groups=8)

_SERVER = """
import asyncio, sys
from eplb_service.balancer import BalancerConfig
from eplb_service.server import ServerConfig, start_server

async def main():
    workers = int(sys.argv[2])
    config = ServerConfig(port=int(sys.argv[1]), balancer=BalancerConfig(plan_workers=workers, compute_workers=workers))
    running = await start_server(config)
    print("ready", flush=True)
    await running.wait()

asyncio.run(main())
"""


async def measure(port: int, seconds: float, effort: str, replans: bool) -> tuple[np.ndarray, int]:
    """GetPlacement latencies in seconds while Rebalance runs back to back (or, without
    ``replans``, alone: the floor), and the plans made."""
    chan = aio_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
    deployment = pb.Deployment(name="v3", topology=TOPOLOGY, planning=pb.Planning(effort=effort))
    await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment))
    rng = np.random.default_rng(0)
    reports = [
        pb.ReportLoadRequest(
            deployment="v3", rank=r, seq=1, logical=encode((rng.lognormal(0, 1.5, (58, 256)) * 100).astype(np.int32))
        )
        for r in range(8)
    ]
    await stub.ReportLoad(iter(reports))
    for _ in range(20):  # warm-up: connection, response cache, the workers' first plan
        await stub.GetPlacement(pb.GetPlacementRequest(deployment="v3"))
    await stub.Rebalance(pb.RebalanceRequest(deployment="v3", force=True))
    stop = time.monotonic() + seconds
    plans = 0

    async def replan() -> None:
        nonlocal plans
        while replans and time.monotonic() < stop:
            await stub.Rebalance(pb.RebalanceRequest(deployment="v3", force=True))
            plans += 1

    task = asyncio.create_task(replan())
    latencies = []
    while time.monotonic() < stop:
        t = time.perf_counter()
        await stub.GetPlacement(pb.GetPlacementRequest(deployment="v3"))
        latencies.append(time.perf_counter() - t)
    await task
    await chan.close()
    return np.array(latencies), plans


def run(workers: int, seconds: float, effort: str, replans: bool = True) -> tuple[np.ndarray, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(workers)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        return asyncio.run(measure(port, seconds, effort, replans))
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="plan workers per variant (0: in-process)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--effort", default="high", help="the deployment's Planning.effort (fast, default, high)")
    args = ap.parse_args(argv)
    variants = [("no re-plans", 2, False)] + [(f"{w} workers" if w else "in-process", w, True) for w in args.workers]
    results: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name, _, _ in variants}
    for _ in range(args.runs):
        for name, w, replans in variants:
            lat, plans = run(w, args.seconds, args.effort, replans)
            results[name].append((np.percentile(lat, 50) * 1e3, np.percentile(lat, 99) * 1e3, lat.size, plans))
    print(
        f"GetPlacement under back-to-back re-plans of a {TOPOLOGY.num_layers}x{TOPOLOGY.num_experts} "
        f"deployment (effort {args.effort}), {args.seconds:g} s per run, medians of {args.runs} runs"
    )
    print("     planning | p50 ms | p99 ms | calls | plans   (per run: p99 ms)")
    for name, rows in results.items():
        p50, p99, calls, plans = (float(np.median([r[i] for r in rows])) for i in range(4))
        per_run = ", ".join(f"{r[1]:.1f}" for r in rows)
        print(f"{name:>13} | {p50:6.2f} | {p99:6.2f} | {calls:5.0f} | {plans:5.0f}   ({per_run})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
