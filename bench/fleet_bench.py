"""The fleet run: many v3-decode-144 deployments reporting per node, loads drifting, for minutes.

    python -m eplb_bench.fleet_bench [--deployments 1000] [--instances 4] [--processes 1] [--seconds 600]
        [--report-every 2] [--drift-at 0.4] [--interval 300] [--window 120] [--client-procs 5] [--spread deployment|node]
        [--watchers 1] [--readers 0] [--cpus-redis 0,1,2] [--cpus-service 3-10] [--cpus-readers 10]
        [--cpus-clients 11-15] [--json FILE]

Issue 35's target 4. A private 3-master Redis Cluster (no persistence), ``--instances`` ``eplb
serve`` instances of ``--processes`` serving processes each, and ``--deployments`` deployments of
DeepSeek-V3 decode shape (58 layers x 256 experts, 288 slots, 144 ranks on 18 nodes; a sliding
window of ``--window`` s, re-planned every ``--interval`` s at a gain of 2 % or more). Every node of
every deployment sends one node report every ``--report-every`` seconds, as its ``eplb agent``
does (``ReportLoadRequest.covers``: its 8 ranks' reports summed; each node report a message on
the node's kept-open ``StreamLoad`` stream, the next sent once its ack came, to the instance
that node's agent uses), from ``--client-procs`` client processes. Each deployment's
hot experts move at ``--drift-at`` of the run, so that its placement stops paying and the
trigger re-plans it. Meanwhile ``--watchers`` processes watch every deployment
(``WatchPlacements``, the engines' path) and note when each version arrives, and a probe calls
``GetPlacement`` on the first instance (4 callers, every 5 ms). With ``--readers N``, N more
instances serve reads only (``eplb serve --reads-only``, one process each, on ``--cpus-readers``):
the watchers and the probe read there, as engines given ``EPLB_READ_ADDRESSES`` do, and the
reports go to the ``--instances``.

At the end it checks and prints:

- every acknowledged report counted: per deployment, the reports the clients were told were
  accepted against the store's count of accepted reports (``meta.reports``, which counts each
  covered rank's report);
- every drifted deployment re-planned: the time from the drift to the first version published
  after it, per deployment (p50, p99, max; the issue's bound is the trigger interval + 30 s);
- GetPlacement p50 and p99 under that load;
- no instance restarted (each ``eplb serve`` process still the one started, its serving
  processes too), each instance's RSS (summed over its processes) at the end, Redis's
  ``used_memory`` per deployment, and the CPU each side used (service, Redis per master,
  clients).

On this machine kind (2 cores) run it small (``--deployments 20 --instances 1 --seconds 60
--interval 20 --window 20``): its figures mean nothing there, only that it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import shlex
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import redis

from .harness.cores import cpu_list, own_channel, pin, proc_cpu, serving
from .harness.processes import ServeProcess
from .harness.redis_cluster import ClusterProcesses
from .harness.service import latency_worker, percentile

LAYERS, EXPERTS, SLOTS, RANKS, NODES = 58, 256, 288, 144, 18
PER_NODE = RANKS // NODES
VARIANTS = 4  # count arrays per phase and deployment kind, cycled


def _phase_counts(phase: int, seed: int) -> list[bytes]:
    """``VARIANTS`` int32 ``[58, 256]`` arrays of one node's 8 ranks summed over one report
    interval: skewed, with the hot experts of ``phase`` (they move at the drift)."""
    rng = np.random.default_rng(1000 * phase + seed)
    hot = rng.permutation(EXPERTS)
    weights = np.full(EXPERTS, 1.0)
    weights[hot[:16]] = 12.0  # 16 hot experts take about 43 % of the tokens
    p = weights / weights.sum()
    out = []
    for _ in range(VARIANTS):
        tokens = PER_NODE * 64 * 8  # 8 ranks x 64 tokens a step x 8 steps, top-8 each
        counts = np.stack([rng.multinomial(tokens * 8, p) for _ in range(LAYERS)]).astype(np.int32)
        out.append(counts.tobytes())
    return out


def _client(
    index: int,
    targets: list[str],
    pairs: list[tuple[str, int, int]],
    seconds: float,
    report_every: float,
    drift_at_s: float,
    start,
    out: mp.Queue,
) -> None:
    """Node reports for ``pairs`` (deployment, node, instance index) every ``report_every`` s."""
    import grpc

    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    phases = [
        [
            pb.ReportLoadRequest(
                logical=pb.Array(dtype=pb.DTYPE_INT32, shape=[LAYERS, EXPERTS], data=d)
            ).SerializeToString()
            for d in _phase_counts(phase, seed)
        ]
        for phase in (0, 1)
        for seed in range(2)
    ]
    acked: dict[str, int] = {}
    errors: dict[str, int] = {}
    latencies: list[float] = []

    async def main() -> None:
        chans = [own_channel(t) for t in targets]
        calls = [
            c.stream_stream(
                "/eplb.v1.ExpertLoadBalancerService/StreamLoad",
                request_serializer=None,
                response_deserializer=pb.ReportLoadAck.FromString,
            )
            for c in chans
        ]
        for c in chans:
            await c.channel_ready()
        await asyncio.get_running_loop().run_in_executor(None, start.wait, 600)
        t0 = time.perf_counter()
        seq0 = time.time_ns() // 1000

        async def node(k: int, name: str, node_index: int, target: int) -> None:
            ranks = range(node_index * PER_NODE, (node_index + 1) * PER_NODE)
            nxt = t0 + report_every * k / max(1, len(pairs))  # spread evenly over an interval
            n = 0
            stream = None  # the node agent's kept-open StreamLoad stream
            while True:
                await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
                if time.perf_counter() - t0 > seconds:
                    if stream is not None:
                        await stream.done_writing()
                        with contextlib.suppress(grpc.aio.AioRpcError):
                            await stream.code()
                    return
                nxt += report_every
                n += 1
                phase = 1 if time.perf_counter() - t0 >= drift_at_s else 0
                head = pb.ReportLoadRequest(
                    deployment=name, covers=[pb.ReportCover(rank=r, seq=seq0 + n) for r in ranks], steps=8 * PER_NODE
                ).SerializeToString()
                body = phases[2 * phase + k % 2][n % VARIANTS]
                t = time.perf_counter()
                try:
                    if stream is None:
                        stream = calls[target]()
                    await stream.write(head + body)
                    ack = await asyncio.wait_for(stream.read(), 30)
                    if ack is grpc.aio.EOF:
                        raise ConnectionError("the stream ended before its ack")
                except Exception as exc:  # noqa: BLE001  (counted and named, the run goes on)
                    code = exc.code().name if hasattr(exc, "code") else type(exc).__name__
                    errors[code] = errors.get(code, 0) + 1
                    if stream is not None:
                        stream.cancel()
                    stream = None  # a new one for the next report, as the agent does
                    continue
                latencies.append(time.perf_counter() - t)
                if ack.accepted:
                    acked[name] = acked.get(name, 0) + PER_NODE

        cpu0 = time.process_time()
        await asyncio.gather(*(node(k, *pair) for k, pair in enumerate(pairs)))
        cpu = time.process_time() - cpu0
        for c in chans:
            await c.close()
        out.put(("client", index, acked, errors, latencies, cpu))

    asyncio.run(main())


def _watcher(target: str, names: list[str], seconds: float, start, out: mp.Queue) -> None:
    """Watches ``names`` (one stream each) and notes when each version arrives (since the start)."""
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
    from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

    arrivals: dict[str, list[tuple[int, float]]] = {n: [] for n in names}

    async def main() -> None:
        chan = own_channel(target)
        stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
        await chan.channel_ready()
        await asyncio.get_running_loop().run_in_executor(None, start.wait, 600)
        t0 = time.perf_counter()

        async def watch(name: str) -> None:
            call = stub.WatchPlacements(pb.WatchPlacementsRequest(deployment=name))
            try:
                async for resp in call:
                    arrivals[name].append((resp.placement.version, time.perf_counter() - t0))
            except Exception:  # noqa: BLE001  (cancelled at the end)
                return

        tasks = [asyncio.create_task(watch(n)) for n in names]
        await asyncio.sleep(seconds + 5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await chan.close()
        out.put(("watcher", arrivals))

    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deployments", type=int, default=1000)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--processes", type=int, default=1, help="serving processes per instance")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--report-every", type=float, default=2.0)
    ap.add_argument("--drift-at", type=float, default=0.4, help="when the hot experts move, a share of --seconds")
    ap.add_argument("--interval", type=float, default=300.0, help="the deployments' trigger interval, s")
    ap.add_argument("--window", type=float, default=120.0, help="the deployments' sliding window, s")
    ap.add_argument("--client-procs", type=int, default=5)
    ap.add_argument("--watchers", type=int, default=1)
    ap.add_argument("--readers", type=int, default=0, help="reads-only instances the watchers and the probe read from")
    ap.add_argument(
        "--spread",
        choices=("deployment", "node"),
        default="deployment",
        help="deployment: a deployment's node agents all report to the instance its name picks (as eplb agent "
        "does); node: each deployment's nodes spread over every instance (each instance then keeps every window)",
    )
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--cpus-redis", type=cpu_list)
    ap.add_argument("--cpus-service", type=cpu_list)
    ap.add_argument("--cpus-readers", type=cpu_list, help="cores for the --readers (default: the service's)")
    ap.add_argument("--cpus-clients", type=cpu_list)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if min(args.deployments, args.instances, args.processes, args.client_procs, args.watchers) < 1:
        ap.error("--deployments, --instances, --processes, --client-procs and --watchers must be at least 1")
    if args.deployments > 1000:
        ap.error("--deployments: at most 1000 (the service's limit per key prefix)")

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "cluster").mkdir()
        pin(args.cpus_redis)
        cluster = ClusterProcesses(workdir / "cluster", appendfsync=None)
        cluster.start()
        pin(args.cpus_service)
        flags = ("--processes", str(args.processes), "--flush-seconds", "1", *shlex.split(args.serve_args))
        serves = [ServeProcess(cluster.url, "fleet", workdir / f"serve-{i}.log", flags) for i in range(args.instances)]
        reading = ("--flush-seconds", "1", *shlex.split(args.serve_args), "--reads-only", "--processes", "1")
        serves += [
            ServeProcess(cluster.url, "fleet", workdir / f"reader-{i}.log", reading) for i in range(args.readers)
        ]
        try:
            for i, s in enumerate(serves):
                pin(args.cpus_readers if i >= args.instances and args.cpus_readers else args.cpus_service)
                s.start()
            for s in serves:
                s.wait_listening(120)
            pin(args.cpus_clients)
            return _run(args, cluster, serves)
        finally:
            for s in serves:
                s.stop()
            cluster.stop()


def _run(args: argparse.Namespace, cluster: ClusterProcesses, serves: list[ServeProcess]) -> int:
    import grpc

    import eplb
    from eplb_engine import wire
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
    from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

    topo = eplb.Topology(LAYERS, EXPERTS, SLOTS, RANKS, NODES, 8)
    names = [f"fleet-{i}" for i in range(args.deployments)]
    targets = [s.target for s in serves[: args.instances]]
    # Where reads go: the reads-only instances, else the instances that take reports.
    readers = [s.target for s in serves[args.instances :]] or targets
    t = time.monotonic()
    with grpc.insecure_channel(targets[0]) as ch:
        stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
        for name in names:
            deployment = wire.deployment_pb(
                name, topo, window_s=args.window, interval_s=args.interval, min_gain_percent=2.0
            )
            stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=deployment), timeout=60)
    print(f"created {len(names)} deployments in {time.monotonic() - t:.1f}s", flush=True)
    pids = {i: sorted(serving(s.proc.pid)) for i, s in enumerate(serves)}

    # (deployment, node, instance): a node's agent uses one instance: the one its deployment's
    # name picks from the address list (Endpoints.prefer, what eplb agent and LoadReporter do),
    # or with --spread node the nodes of each deployment spread over all of them.
    if args.spread == "deployment":
        pairs = [(name, node, zlib.crc32(name.encode()) % len(targets)) for name in names for node in range(NODES)]
    else:
        pairs = [
            (name, node, (d * NODES + node) % len(targets)) for d, name in enumerate(names) for node in range(NODES)
        ]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start = ctx.Barrier(args.client_procs + args.watchers + 1 + 1)
    procs = [
        ctx.Process(
            target=_client,
            args=(
                i,
                targets,
                pairs[i :: args.client_procs],
                args.seconds,
                args.report_every,
                args.drift_at * args.seconds,
                start,
                out,
            ),
        )
        for i in range(args.client_procs)
    ]
    procs += [
        ctx.Process(
            target=_watcher, args=(readers[w % len(readers)], names[w :: args.watchers], args.seconds, start, out)
        )
        for w in range(args.watchers)
    ]
    procs.append(ctx.Process(target=latency_worker, args=(readers[0], names[0], 4, args.seconds, 0.005, out, start)))
    for p in procs:
        p.start()
    start.wait(600)
    ports = cluster.ports
    redis_cpu0 = [_master_cpu(port) for port in ports]
    cpu0 = proc_cpu([s.proc.pid for s in serves])
    t0 = time.monotonic()
    results = [out.get(timeout=args.seconds + 600) for _ in procs]
    elapsed = time.monotonic() - t0
    service_cpu = proc_cpu([s.proc.pid for s in serves]) - cpu0
    redis_cpu = [_master_cpu(port) - c for port, c in zip(ports, redis_cpu0, strict=True)]
    for p in procs:
        p.join(30)
    time.sleep(3.0)  # the last flushes

    acked: dict[str, int] = {}
    errors: dict[str, int] = {}
    report_lat: list[float] = []
    client_cpu = 0.0
    arrivals: dict[str, list[tuple[int, float]]] = {}
    probe: list[float] = []
    for r in results:
        if r[0] == "client":
            for name, n in r[2].items():
                acked[name] = acked.get(name, 0) + n
            for k, n in r[3].items():
                errors[k] = errors.get(k, 0) + n
            report_lat += r[4]
            client_cpu += r[5]
        elif r[0] == "watcher":
            arrivals.update(r[1])
        else:  # latency_worker's (latencies, elapsed, cpu)
            probe = r[0]
    store = redis.RedisCluster(host="127.0.0.1", port=ports[0])
    counted = {name: int(store.hget(f"fleet:{{{name}}}:meta", "reports") or 0) for name in names}
    lost = {n: (acked.get(n, 0), counted[n]) for n in names if acked.get(n, 0) != counted[n]}
    drift_s = args.drift_at * args.seconds
    replan = []
    for name in names:
        after = [at for version, at in arrivals.get(name, []) if at >= drift_s and version > 1]
        replan.append(after[0] - drift_s if after else float("inf"))
    never = sum(1 for x in replan if x == float("inf"))
    finite = sorted(x for x in replan if x != float("inf")) or [float("nan")]
    restarted = [i for i, s in enumerate(serves) if not s.running or sorted(serving(s.proc.pid)) != pids[i]]
    rss = [sum(_rss_mb(p) for p in serving(s.proc.pid)) for s in serves]
    used = sum(redis.Redis(port=port).info("memory")["used_memory"] for port in ports)
    result = dict(
        deployments=args.deployments,
        instances=args.instances,
        processes=args.processes,
        readers=args.readers,
        spread=args.spread,
        seconds=args.seconds,
        # Over the load's own seconds (the elapsed time also holds the watchers' last 5 s).
        reports_per_s=sum(acked.values()) / args.seconds / PER_NODE,
        rank_reports_per_s=sum(acked.values()) / args.seconds,
        acknowledged=sum(acked.values()),
        counted=sum(counted.values()),
        deployments_not_matching=len(lost),
        report_errors=errors,
        report_p99_ms=1e3 * percentile(report_lat, 99) if report_lat else None,
        replan_after_drift_s=dict(p50=statistics.median(finite), p99=percentile(finite, 99), max=finite[-1]),
        never_replanned=never,
        get_placement_ms=dict(p50=1e3 * percentile(probe, 50), p99=1e3 * percentile(probe, 99)) if probe else None,
        restarted_instances=restarted,
        rss_mb=rss,
        redis_mb_per_deployment=used / 2**20 / args.deployments,
        service_cores=service_cpu / elapsed,
        redis_cores_per_master=[c / elapsed for c in redis_cpu],
        client_cores=client_cpu / elapsed,
    )
    print(json.dumps(result, indent=2), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = not lost and not restarted and never == 0
    print(
        "fleet run: "
        + (
            "every acknowledged report counted, every deployment re-planned after the drift, no restart"
            if ok
            else "FAILED a check above"
        )
    )
    return 0 if ok else 1


def _master_cpu(port: int) -> float:
    info = redis.Redis(port=port).info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


if __name__ == "__main__":
    raise SystemExit(main())
