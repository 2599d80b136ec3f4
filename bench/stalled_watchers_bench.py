"""What watchers that do not read cost the service (issue 22, "One tenant must not slow another").

Starts ``eplb serve`` (in-memory store) as a child process on loopback, creates a deployment
whose placement is 1 MiB (64 layers x 4096 slots of int32, 1024 experts; ``--experts`` and
``--slots`` change it, and the message, which carries the window's loads too), then opens ``--watchers``
WatchPlacements streams, each on a connection of its own, that never read, plus one watcher
that reads every message, and publishes ``--versions`` versions by forced re-plans. Prints the
server's RSS (``/proc/<pid>/status``) before the watchers, with them stalled, and after they
cancelled, and its peak from just before the watchers opened to the end (``VmHWM``, reset
through ``/proc/<pid>/clear_refs`` once "before" is read); the reading watcher's versions (every
one, in order, is the guarantee); and the ERROR lines the server logged (cancelling a watch
must log none).

``--load R`` sends R reports/s meanwhile (v3-prefill shaped ``[58, 256]`` int32 counts, to a
deployment of their own, each its own ReportLoad call, from a process of its own started
before "before" is read). ``--runs N`` repeats the whole (a fresh server each time) and prints
the medians of the growths.

    python -m eplb_bench.stalled_watchers_bench --watchers 200 --versions 20 [--runs 3] [--load 0,500]

To measure another tree's service (the one before a change), run this file with that tree's
interpreter: ``/path/to/other/.venv/bin/python bench/stalled_watchers_bench.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import grpc
import numpy as np

from eplb_engine.aio import AsyncServiceClient
from eplb_tools.ports import free_port
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .harness.service import V3, aio_channel, reports

# 64 x 4096 int32: a 1 MiB phy2log (the greedy policy plans it in well under a second); placements
# carry their window's loads too (float32 [64, 1024], 0.25 MiB): a 1.25 MiB message.
TOPOLOGY = pb.Topology(num_layers=64, num_experts=1024, num_slots=4096, num_gpus=512, num_nodes=64, num_groups=1)


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "eplb_tools.cli", "serve", "--port", str(port), "--max-message-bytes", str(8 << 20)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on" in line:
            return proc
        if not line and proc.poll() is not None:
            raise RuntimeError(f"eplb serve exited with {proc.returncode}; see {log_path}")
    raise TimeoutError("eplb serve did not start within 60 s")


async def settle(pid: int, seconds: float) -> float:
    await asyncio.sleep(seconds)
    return rss_mb(pid)


def load_worker(target: str, rate: float, ready: Event, stop: Event) -> None:
    """Creates deployment ``load`` (v3-prefill) and sends ``rate`` reports/s to it until ``stop``."""

    async def main() -> None:
        chan = aio_channel(target)
        stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
        await stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=pb.Deployment(name="load", topology=pb.Topology(**V3)))
        )
        counts = [np.random.default_rng(r).integers(0, 100, size=(58, 256)).astype(np.int32) for r in range(8)]
        ready.set()
        inflight: set[asyncio.Task] = set()
        i = 0
        t0 = time.monotonic()
        while not stop.is_set():
            call = stub.ReportLoad(iter(reports("load", i % 8, [counts[i % 8]])), timeout=10)
            task = asyncio.ensure_future(call)
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        await asyncio.gather(*inflight, return_exceptions=True)
        await chan.close()

    asyncio.run(main())


async def main_async(args: argparse.Namespace, load: float) -> dict:
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="stalled-")) / "serve.log"
    proc = start_server(port, log_path)
    target = f"127.0.0.1:{port}"
    control = aio_channel(target)
    stub = pb_grpc.ExpertLoadBalancerServiceStub(control)
    out: dict = {"load": load}
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    loader = None
    try:
        if load:
            ready = ctx.Event()
            loader = ctx.Process(target=load_worker, args=(target, load, ready, stop))
            loader.start()
            await asyncio.get_running_loop().run_in_executor(None, ready.wait, 60)
        topo = pb.Topology()
        topo.CopyFrom(TOPOLOGY)
        topo.num_experts, topo.num_slots = args.experts, args.slots
        d = pb.Deployment(name="big", topology=topo, policy="deepseek")
        await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
        loads = np.random.default_rng(0).integers(0, 1000, size=(topo.num_layers, topo.num_experts))
        await AsyncServiceClient.over(control).report(reports("big", 0, [loads.astype(np.int32)]))
        await asyncio.sleep(1.5)
        await stub.Rebalance(pb.RebalanceRequest(deployment="big", force=True))  # warms the worker
        out["rss_before_mb"] = await settle(proc.pid, 1.0)
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM from here on
        current = (await stub.GetPlacement(pb.GetPlacementRequest(deployment="big"))).placement
        out["placement_mib"] = len(current.phy2log.data) / (1 << 20)
        out["message_mib"] = pb.WatchPlacementsResponse(placement=current).ByteSize() / (1 << 20)

        # A connection per watcher, as separate engines have (channels with the same target and
        # options would share one otherwise).
        chans = [
            grpc.aio.insecure_channel(
                target, options=[("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", 8 << 20)]
            )
            for _ in range(args.watchers)
        ]
        stalled = [
            pb_grpc.ExpertLoadBalancerServiceStub(c).WatchPlacements(
                pb.WatchPlacementsRequest(deployment="big", max_part_bytes=getattr(args, "part_bytes", 0))
            )
            for c in chans
        ]
        for call in stalled:
            await call.wait_for_connection()
        seen: list[int] = []

        async def read_all() -> None:
            async for placement in AsyncServiceClient.over(control).watch("big", decode=False):
                seen.append(placement.version)

        reader = asyncio.create_task(read_all())
        await asyncio.sleep(0.5)
        first = (await stub.GetPlacement(pb.GetPlacementRequest(deployment="big"))).placement.version
        for _ in range(args.versions):
            await stub.Rebalance(pb.RebalanceRequest(deployment="big", force=True))
        last = first + args.versions
        deadline = time.monotonic() + 30
        while (not seen or seen[-1] < last) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        out["rss_stalled_mb"] = await settle(proc.pid, 2.0)
        out["reader_in_order"] = seen == list(range(first, last + 1))
        out["reader_versions"] = f"{seen[0]}..{seen[-1]} ({len(seen)} messages)" if seen else "none"

        for call in stalled:
            call.cancel()
        reader.cancel()
        for c in chans:
            await c.close()
        out["rss_after_mb"] = await settle(proc.pid, 3.0)
        out["rss_peak_mb"] = rss_mb(proc.pid, "VmHWM")
    finally:
        stop.set()
        if loader is not None:
            loader.join(30)
        await control.close()
        proc.terminate()
        proc.wait(30)
    errors = [line for line in log_path.read_text().splitlines() if "ERROR" in line]
    out["error_lines"] = len(errors)
    out["first_error"] = errors[0] if errors else ""
    out["grown_mb"] = out["rss_stalled_mb"] - out["rss_before_mb"]
    out["peak_grown_mb"] = out["rss_peak_mb"] - out["rss_before_mb"]
    out["after_grown_mb"] = out["rss_after_mb"] - out["rss_before_mb"]
    print(
        f"{args.watchers} stalled watchers, phy2log {out['placement_mib']:.2f} MiB, WatchPlacements message "
        f"{out['message_mib']:.2f} MiB, over {args.versions} versions, {load:g} reports/s: server RSS "
        f"{out['rss_before_mb']:.0f} MB before, {out['rss_stalled_mb']:.0f} MB stalled (+{out['grown_mb']:.0f} MB), "
        f"peak {out['rss_peak_mb']:.0f} MB (+{out['peak_grown_mb']:.0f} MB, target <= +300), "
        f"{out['rss_after_mb']:.0f} MB after they cancelled (+{out['after_grown_mb']:.0f} MB)"
    )
    print(f"reading watcher: versions {out['reader_versions']}, every one in order: {out['reader_in_order']}")
    print(f"ERROR lines in the server's log: {out['error_lines']} {out['first_error'][:200]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--watchers", type=int, default=200)
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument(
        "--experts", type=int, default=1024, help="of 64 layers; the window's float32 loads travel with the placement"
    )
    ap.add_argument("--slots", type=int, default=4096, help="of 64 layers on 512 gpus: 4096 is a 1 MiB phy2log")
    ap.add_argument(
        "--part-bytes",
        type=int,
        default=0,
        help="the stalled watchers ask for placements in parts of this many bytes (0: whole; eplb's "
        "watchers ask for 65536)",
    )
    ap.add_argument("--runs", type=int, default=1, help="runs per load, each with a fresh server")
    ap.add_argument("--load", type=lambda s: [float(x) for x in s.split(",")], default=[0.0], help="reports/s")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    rows = [asyncio.run(main_async(args, load)) for load in args.load for _ in range(args.runs)]
    print(f"\nmedians of {args.runs} runs (each run's figure in brackets), growth over RSS before, MB:")
    for load in args.load:
        mine = [r for r in rows if r["load"] == load]
        cells = []
        for key, what in (("peak_grown_mb", "peak"), ("grown_mb", "stalled"), ("after_grown_mb", "after cancel")):
            got = [r[key] for r in mine]
            cells.append(f"{what} +{statistics.median(got):.0f} [{', '.join(f'{x:+.0f}' for x in got)}]")
        print(f"{load:g} reports/s: " + "; ".join(cells))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
