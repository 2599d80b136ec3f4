"""Service benchmark: ingestion rate, GetPlacement latency, watcher fan-out, Redis memory.

    python -m eplb_bench.service_bench [--parts ingest,latency,watch] [--seconds 10] [--json FILE]

Starts ``eplb serve`` processes on the Redis at ``--redis-url`` (own key prefix, deleted at
the end) and drives them from separate client processes, all on this machine:
- ingest: ``--streams`` ReportLoad streams carrying v3-prefill-shaped reports (int32 [58, 256])
  from ``--ranks`` ranks, for ``--seconds``; prints accepted reports/s, then the Redis memory
  of the deployment's keys against the stated bound;
- latency: ``--callers`` concurrent GetPlacement callers, closed loop (each calls again as
  soon as it has an answer) and paced (each calls every ``--pace-ms`` ms); prints p50/p99;
- watch: ``--watchers`` WatchPlacements streams spread over 2 instances; ``--versions`` forced
  rebalances; prints, per version, the time from commit to the last watcher having it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import uuid

import numpy as np

from eplb_tools.ports import free_port

from .harness.processes import serve_argv
from .harness.service import V3, aio_channel, create_v3, latency_worker, percentile, reports


def _start_server(redis_url: str, prefix: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        serve_argv(port, redis_url, prefix, "--log-level", "WARNING"),
        stdout=subprocess.PIPE,
        text=True,
    )
    proc.stdout.readline()  # "listening on …" once serving
    return proc, f"127.0.0.1:{port}"


# ---- client processes (each runs its own event loop) ----


def _ingest_worker(target: str, name: str, streams: int, ranks: int, seconds: float, out: mp.Queue) -> None:
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
    from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 4096, size=(58, 256), dtype=np.int32).tobytes() for _ in range(8)]

    async def main() -> None:
        chan = aio_channel(target)
        stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
        deadline = time.perf_counter() + seconds
        seqs = [time.time_ns() // 1000] * ranks

        async def stream(i: int) -> tuple[int, int]:
            def requests():
                k = 0
                while time.perf_counter() < deadline:
                    rank = (i + k * streams) % ranks
                    seqs[rank] += 1
                    k += 1
                    yield pb.ReportLoadRequest(
                        deployment=name,
                        rank=rank,
                        seq=seqs[rank],
                        logical=pb.Array(dtype=pb.DTYPE_INT32, shape=[58, 256], data=pool[k % len(pool)]),
                    )

            resp = await stub.ReportLoad(requests())
            return resp.accepted, resp.duplicates

        start = time.perf_counter()
        results = await asyncio.gather(*(stream(i) for i in range(streams)))
        elapsed = time.perf_counter() - start
        await chan.close()
        out.put((sum(a for a, _ in results), sum(d for _, d in results), elapsed))

    asyncio.run(main())


def _watch_worker(targets: list[str], name: str, watchers: int, versions: int, ready: mp.Queue, out: mp.Queue) -> None:
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
    from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

    async def main() -> None:
        chans = [aio_channel(t) for t in targets]
        stubs = [pb_grpc.ExpertLoadBalancerServiceStub(c) for c in chans]
        got: dict[int, list[float]] = {}
        first = asyncio.Event()
        started = 0

        async def watch(i: int) -> None:
            nonlocal started
            call = stubs[i % len(stubs)].WatchPlacements(pb.WatchPlacementsRequest(deployment=name))
            base = (await call.read()).placement.version
            started += 1
            if started == watchers:
                first.set()
            while True:
                msg = await call.read()
                now = time.time()
                p = msg.placement
                got.setdefault(p.version, []).append(now - p.create_time.ToNanoseconds() / 1e9)
                if p.version >= base + versions:
                    call.cancel()
                    return

        tasks = [asyncio.create_task(watch(i)) for i in range(watchers)]
        await first.wait()
        ready.put(True)
        await asyncio.gather(*tasks)
        for c in chans:
            await c.close()
        out.put(got)

    asyncio.run(main())


# ---- orchestration ----


def _rebalance(target: str, name: str) -> float:
    import grpc

    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
    from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

    with grpc.insecure_channel(target) as ch:
        t = time.perf_counter()
        pb_grpc.ExpertLoadBalancerServiceStub(ch).Rebalance(pb.RebalanceRequest(deployment=name, force=True))
        return time.perf_counter() - t


async def _fill(targets: list[str], name: str, ranks: int) -> None:
    from eplb_engine.aio import AsyncServiceClient

    counts = np.ones((58, 256), dtype=np.int32)
    for target in targets:
        chan = aio_channel(target)
        client = AsyncServiceClient.over(chan)
        for rank in range(ranks):
            await client.report(reports(name, rank, [counts]))
            await client.ack(name, rank, 1)
        await chan.close()


def _memory(redis_url: str, prefix: str, name: str, instances: int, ranks: int) -> dict:
    import redis

    r = redis.Redis.from_url(redis_url)
    keys = sorted(k.decode() for k in r.scan_iter(match=f"{prefix}:*", count=1000))
    usage = {k.split(":", 1)[1]: int(r.memory_usage(k, samples=0) or 0) for k in keys}
    r.close()
    L, E, P = V3["num_layers"], V3["num_experts"], V3["num_slots"]

    # Bound (see docs/service.md): one [L, E] float64 window blob per instance, 16 placements of
    # [L, P] int32, each rounded up to jemalloc's size class (16 KiB steps in this range);
    # seq and acks hashes at most 64 bytes per rank each; the stream ~64 small entries; 8 KiB rest.
    def jemalloc(n: int) -> int:
        return -(-n // 16384) * 16384

    bound = instances * jemalloc(L * E * 8 + 29) + 16 * jemalloc(L * P * 4 + 64) + 2 * ranks * 64 + 64 * 128 + 8192
    return {"keys": usage, "total_bytes": sum(usage.values()), "bound_bytes": bound}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eplb_bench.service_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default=os.environ.get("EPLB_REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--parts", default="ingest,latency,watch")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=320)
    ap.add_argument("--callers", type=int, default=200)
    ap.add_argument("--pace-ms", default="1000,250,100", help="paced runs: each caller calls every N ms")
    ap.add_argument("--watchers", type=int, default=500)
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    prefix = f"eplb-bench-{uuid.uuid4().hex[:8]}"
    name = "v3-prefill"
    ctx = mp.get_context("spawn")
    servers = [_start_server(args.redis_url, prefix)]
    # Shared machines: the load average says how much else was running during the figures.
    figures: dict = {"cpus": os.cpu_count(), "loadavg_start": os.getloadavg()[0]}
    try:
        target = servers[0][1]
        create_v3(target, name, args.ranks)  # the deployment names every reporting rank
        print(
            f"v3-prefill deployment on 1 service process + Redis, {os.cpu_count()} cpus, "
            f"load average {os.getloadavg()[0]:.1f} at start"
        )
        if "ingest" in parts:
            q = ctx.Queue()
            p = ctx.Process(target=_ingest_worker, args=(target, name, args.streams, args.ranks, args.seconds, q))
            p.start()
            accepted, dup, elapsed = q.get()
            p.join()
            rate = accepted / elapsed
            figures["ingest"] = {
                "accepted": accepted,
                "duplicates": dup,
                "seconds": elapsed,
                "reports_per_s": rate,
                "streams": args.streams,
                "ranks": args.ranks,
            }
            print(
                f"ingest: {accepted} reports [58, 256] int32 from {args.ranks} ranks over {args.streams} streams "
                f"in {elapsed:.1f} s = {rate:,.0f} reports/s ({rate * 58 * 256 * 4 / 1e6:.0f} MB/s), {dup} duplicates"
            )
        if "latency" in parts:
            modes = [("closed loop", 0.0)] + [
                (f"each every {float(ms):g} ms", float(ms) / 1000) for ms in args.pace_ms.split(",")
            ]
            for label, pace in modes:
                q = ctx.Queue()
                p = ctx.Process(target=latency_worker, args=(target, name, args.callers, args.seconds, pace, q))
                p.start()
                lat, elapsed, _ = q.get()
                p.join()
                row = {
                    "calls": len(lat),
                    "calls_per_s": len(lat) / elapsed,
                    "p50_ms": percentile(lat, 50) * 1e3,
                    "p99_ms": percentile(lat, 99) * 1e3,
                }
                figures[f"get_placement_{'closed' if not pace else f'paced_{pace * 1e3:g}ms'}"] = row
                print(
                    f"GetPlacement, {args.callers} callers, {label}: {row['calls_per_s']:,.0f} calls/s, "
                    f"p50 {row['p50_ms']:.2f} ms, p99 {row['p99_ms']:.2f} ms"
                )
        if "watch" in parts:
            servers.append(_start_server(args.redis_url, prefix))
            targets = [s[1] for s in servers[:2]]
            ready, q = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=_watch_worker, args=(targets, name, args.watchers, args.versions, ready, q))
            p.start()
            ready.get()
            for _ in range(args.versions):
                _rebalance(targets[0], name)
                time.sleep(0.3)
            got = q.get()
            p.join()
            all_have = [max(v) for v in got.values() if len(v) == args.watchers]
            each = [x for v in got.values() for x in v]
            row = {
                "versions": len(got),
                "complete_versions": len(all_have),
                "all_have_p50_ms": percentile(all_have, 50) * 1e3,
                "all_have_p99_ms": percentile(all_have, 99) * 1e3,
                "all_have_max_ms": max(all_have) * 1e3 if all_have else float("nan"),
                "per_watcher_p50_ms": percentile(each, 50) * 1e3,
                "per_watcher_p99_ms": percentile(each, 99) * 1e3,
            }
            figures["watch"] = row
            print(
                f"watch: {args.watchers} watchers on 2 instances, {row['complete_versions']}/{args.versions} versions "
                f"reached every watcher; commit -> all have it: p50 {row['all_have_p50_ms']:.0f} ms, "
                f"p99 {row['all_have_p99_ms']:.0f} ms (max {row['all_have_max_ms']:.0f} ms); "
                f"per watcher p50 {row['per_watcher_p50_ms']:.0f} ms, p99 {row['per_watcher_p99_ms']:.0f} ms"
            )
        if "ingest" in parts:
            # Worst case for the bound: every rank reported and acked on every instance, and at
            # least 16 versions published (the watch part publishes --versions).
            asyncio.run(_fill([t for _, t in servers], name, args.ranks))
            time.sleep(1.5)  # let every instance flush its window
            mem = _memory(args.redis_url, prefix, name, instances=len(servers), ranks=args.ranks)
            figures["redis_memory"] = mem
            print(
                f"redis memory of the deployment's keys, {len(servers)} instance(s), {args.ranks} ranks, "
                f"10-minute window: {mem['total_bytes']:,} bytes (stated bound {mem['bound_bytes']:,})"
            )
            for k, v in mem["keys"].items():
                print(f"  {k:40s} {v:>10,}")
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(15)
        import redis

        r = redis.Redis.from_url(args.redis_url)
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()
    figures["loadavg_end"] = os.getloadavg()[0]
    print(f"load average {figures['loadavg_end']:.1f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
