"""A small deployment's forced re-plan while two limit-size ones run (issue 22, "One tenant must
not slow another").

Starts ``eplb serve`` (in-memory store) as a child process on loopback and a small deployment
(4 x 16, 24 slots). Each run creates two deployments at the documented limits (128 layers x
8192 experts, 8192 slots on 4096 gpus: a 4 MiB placement), reports a window of load to each,
starts their forced re-plans (the first plan of a deployment, planned fresh: a re-plan that
repairs a placement of this size needs a 32 GiB array in eplb's aligner today), waits
``--head-start`` seconds so they hold both re-plan workers, and times the small deployment's
forced re-plan. Prints each run and the medians; ``--no-lane`` starts the server with
``--small-plan-workers 0`` (every re-plan queues for the same two workers: the service before
the lane).

    python -m eplb_bench.fair_planning_bench --runs 3            # with the small-plan lane
    python -m eplb_bench.fair_planning_bench --runs 3 --no-lane  # without it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from eplb_engine.aio import AsyncServiceClient
from eplb_tools.ports import free_port
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .harness.service import aio_channel, reports

# The documented limits (docs/service.md, "Limits"): 128 x 8192 int32 is the 4 MiB placement cap.
LARGE = pb.Topology(num_layers=128, num_experts=8192, num_slots=8192, num_gpus=4096, num_nodes=512, num_groups=1)
SMALL = pb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)


def start_server(port: int, lane: bool) -> subprocess.Popen:
    argv = [sys.executable, "-m", "eplb_tools.cli", "serve", "--port", str(port), "--log-level", "WARNING"]
    argv += ["--small-plan-workers", "1" if lane else "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on" in line:
            return proc
        if not line and proc.poll() is not None:
            raise RuntimeError(f"eplb serve exited with {proc.returncode}")
    raise TimeoutError("eplb serve did not start within 60 s")


async def report(chan, name: str, topo: pb.Topology, rng: np.random.Generator) -> None:
    loads = rng.lognormal(0, 1.0, (topo.num_layers, topo.num_experts)) * 1000
    await AsyncServiceClient.over(chan).report(reports(name, 0, [loads.astype(np.int32)]))


async def setup(stub: pb_grpc.ExpertLoadBalancerServiceStub, chan, rng: np.random.Generator) -> None:
    await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=pb.Deployment(name="small", topology=SMALL)))
    await report(chan, "small", SMALL, rng)
    await asyncio.sleep(1.5)  # the window is flushed (every second)
    # Warm: the worker the small re-plan takes is started (a spawn imports numpy and eplb).
    await stub.Rebalance(pb.RebalanceRequest(deployment="small", force=True))


async def one_run(
    stub: pb_grpc.ExpertLoadBalancerServiceStub, chan, rng: np.random.Generator, run: int, head_start: float
) -> dict[str, float]:
    names = [f"large-{run}-a", f"large-{run}-b"]
    for name in names:
        await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=pb.Deployment(name=name, topology=LARGE)))
        await report(chan, name, LARGE, rng)
    await asyncio.sleep(1.5)  # flushed
    t0 = time.perf_counter()
    large = [
        asyncio.ensure_future(stub.Rebalance(pb.RebalanceRequest(deployment=n, force=True), timeout=600)) for n in names
    ]
    finished: list[float] = []
    for fut in large:
        fut.add_done_callback(lambda _: finished.append(time.perf_counter() - t0))
    await asyncio.sleep(head_start)
    t1 = time.perf_counter()
    small = await stub.Rebalance(pb.RebalanceRequest(deployment="small", force=True), timeout=600)
    small_s = time.perf_counter() - t1
    for fut in large:
        resp = await fut
        assert resp.published, resp.reason
    large_s = sorted(finished)
    assert small.published, small.reason
    for name in names:
        await stub.DeleteDeployment(pb.DeleteDeploymentRequest(name=name))
    still = small_s + head_start < min(large_s)
    return {"small_s": small_s, "large_s": max(large_s), "large_still_running": float(still)}


async def main_async(args: argparse.Namespace) -> dict:
    port = free_port()
    proc = start_server(port, lane=not args.no_lane)
    chan = aio_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
        rng = np.random.default_rng(args.seed)
        await setup(stub, chan, rng)
        runs = []
        for i in range(args.runs):
            r = await one_run(stub, chan, rng, i, args.head_start)
            runs.append(r)
            print(
                f"run {i + 1}: small forced re-plan {r['small_s']:.3f} s; both large ones done after "
                f"{r['large_s']:.1f} s; small returned while both ran: {bool(r['large_still_running'])}",
                flush=True,
            )
    finally:
        await chan.close()
        proc.terminate()
        proc.wait(30)
    summary = {
        "lane": not args.no_lane,
        "runs": runs,
        "small_s_median": statistics.median(r["small_s"] for r in runs),
        "large_s_median": statistics.median(r["large_s"] for r in runs),
    }
    print(
        f"small-plan lane {'on (--small-plan-workers 1)' if summary['lane'] else 'off (--small-plan-workers 0)'}: "
        f"small forced re-plan median {summary['small_s_median']:.3f} s over {args.runs} runs, "
        f"two limit-size forced re-plans median {summary['large_s_median']:.1f} s (target: small <= 3 s)"
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-lane", action="store_true", help="serve with --small-plan-workers 0 (before the lane)")
    ap.add_argument("--head-start", type=float, default=1.0, help="seconds the large re-plans start before the small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the runs and medians here")
    args = ap.parse_args(argv)
    summary = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
