"""Ingestion at scale: reports/s accepted and GetPlacement p99, by Redis kind, instances and
deployments, and what each report costs Redis.

    python -m eplb_bench.ingest_bench [--kinds redis,cluster,bare,memory] [--instances 1,2] [--deployments 1,50]
        [--seconds 6] [--rate 2000 | --rate-of-max 0.8] [--repeats 1] [--json FILE] [--serve-args "FLAGS"]
        [--clients lean|protobuf] [--rpc streamload|reportload] [--streams 8] [--client-procs 2] [--connections 1]
        [--spread report|deployment]
        [--probe-on first|reader] [--reader-args FLAGS] [--probe-callers 4] [--probe-interval-ms 5]
        [--cpus-redis 0,1] [--cpus-service 0,1] [--cpus-reader 7] [--cpus-clients 2-15]

For each Redis kind (a private ``redis-server``, or a private 3-master Redis Cluster; both
without persistence, on free loopback ports in a temp directory) and each count of ``eplb
serve`` instances and of deployments (v3-prefill shaped: int32 ``[58, 256]`` reports), two runs:

- max: two client processes (``--client-procs``) send reports as fast as the instances accept (spread over the
  instances and deployments) for ``--seconds``, each on ``--streams`` streams (8; a rank each).
  As engines send (``--rpc streamload``, the default): each stream a kept-open ``StreamLoad``
  call that sends its next report once the last one's ack came, so a stream's rate is bound by
  the ack's latency, about 1 / (linger + store call), and few streams cannot offer 2,000
  reports/s where each store call carries many deployments' reports (``--rpc reportload``: a
  ``ReportLoad`` stream each, written as fast as the service reads); prints accepted reports/s and the bytes Redis
  read from its clients per accepted report (``INFO stats`` ``total_net_input_bytes``, every
  master summed) against the report's payload (59,392 bytes);
- paced: the same clients send ``--rate`` reports/s in total (or ``--rate-of-max`` times the
  max just measured).

``bare`` (not run by default) puts ``harness.bare_server`` where the instances would be: a
gRPC server of the same service and options that only receives each report and answers
GetPlacement from one pre-built response of a v3 placement's size, with no Redis. Its p99 is the
floor under the service's: what the same clients see when nothing but gRPC's reception of the
reports shares the event loop with GetPlacement.

``memory`` (not run by default) runs ``eplb serve`` on its embedded in-memory store: the
service's own cost without the Redis client's (Redis columns 0).

In all, a third process calls GetPlacement on the first instance every 5 ms (4 callers; set
with ``--probe-callers`` and ``--probe-interval-ms``) and prints its p99; ``--probe-on reader``
calls it on one more instance that takes no reports instead (it shares the store, so only with
``redis`` and ``cluster``): ``eplb serve --reads-only --processes 1`` after the ``--serve-args``
(``--reader-args`` to change), on ``--cpus-reader`` where given, as engines given
``EPLB_READ_ADDRESSES`` read their placements. Every client process starts its load at one barrier once it has
imported, connected and built its reports, and the GetPlacement calls start ``LEAD_S`` into the
load and end ``LEAD_S`` before it, so that no client's start-up lands in the figures; each
client measures its own CPU over the load ("client cores": on a 2-core machine the clients,
which stand for engines on other machines, take a share of the service's cores). ``--clients
lean`` (the default) sends each request as bytes (its small fields, then its counts' field
serialized once per pool entry); ``protobuf`` builds each message. ``--connections N`` gives each client process N connections of its own to each instance
(engines on other hosts each have theirs; channels of one process to one target otherwise share
one), so that an instance's ``--processes`` all get some; the instances' CPU then sums each
instance's serving processes. ``--spread deployment`` makes each stream one rank of one deployment, sent
to the instance the deployment's name picks (``Endpoints.prefer``: a deployment's ranks report to
one instance), rather than each stream's reports going to every deployment in turn (``report``,
the default: every serving process then keeps every deployment's window). ``--serve-args`` adds
flags to every instance, for an A/B of one flag (``--report-linger-seconds 0``). Each figure is
the median over ``--repeats`` runs.

Per shard, for extrapolating to more masters: the CPU seconds each ``redis-server`` spent
(``INFO cpu`` ``used_cpu_sys`` + ``used_cpu_user``) per accepted report, summed over masters
("redis ms/rep") and the busiest master's share of one core ("hot master %"); and the instances'
own CPU (``/proc/PID/stat`` utime + stime, summed over instances) per accepted report ("service
ms/rep"). 1000 / ms-per-report is what one core of that kind takes in reports/s.

``--profile-dir DIR`` runs each instance under cProfile and writes ``DIR/<prefix>-<i>.prof``
when it stops (SIGINT, a graceful stop); read with ``python -m pstats``. It slows the instances:
for where the time goes, not for the table.

Pinning (``--cpus-*``, core lists such as ``0,1`` or ``2-15``; Linux): Redis (every master),
the instances and the client processes (ingest and GetPlacement callers) are started with those
cores as their affinity (``os.sched_setaffinity`` on this process before each is started;
children inherit it), so that a big machine emulates a small one for the service, with the
clients on cores of their own as if they were other machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path

import numpy as np
import redis

from .harness.cores import cpu_list, own_channel, pin, proc_cpu
from .harness.processes import RedisProcess, ServeProcess, serve_argv
from .harness.redis_cluster import ClusterProcesses
from .harness.service import V3, aio_channel, create_v3, latency_worker, percentile

PAYLOAD = V3["num_layers"] * V3["num_experts"] * 4
INGEST_PROCS = 2
STREAMS = 8  # per client process
LEAD_S = 0.5  # the load runs this long before the GetPlacement callers start, and after they end


def _ingest_worker(
    targets: list[str],
    names: list[str],
    worker: int,
    seconds: float,
    rate: float,
    out: mp.Queue,
    lean: bool,
    start,
    streams: int = STREAMS,
    procs: int = INGEST_PROCS,
    connections: int = 1,
    rpc: str = "streamload",
    spread: str = "report",
):
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
    from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

    rng = np.random.default_rng(worker)
    pool = [rng.integers(0, 4096, size=(58, 256), dtype=np.int32).tobytes() for _ in range(8)]
    # Lean clients send each request as bytes: its small fields serialized, then the counts'
    # field serialized once per pool entry (protobuf's wire format is the concatenation of its
    # fields), rather than a message built per report (--clients protobuf).
    counts_fields = [
        pb.ReportLoadRequest(logical=pb.Array(dtype=pb.DTYPE_INT32, shape=[58, 256], data=d)).SerializeToString()
        for d in pool
    ]

    async def main() -> None:
        # ``connections`` per target, each its own (engines on other hosts each have theirs; one
        # process's channels to one target otherwise share one: gRPC's global subchannel pool),
        # so that an instance's serving processes (--processes) all get some.
        # Instance-minor: consecutive streams go to different instances.
        chans = [aio_channel(t) if connections == 1 else own_channel(t) for _ in range(connections) for t in targets]
        if rpc == "streamload":
            methods = [
                c.stream_stream(
                    "/eplb.v1.ExpertLoadBalancerService/StreamLoad",
                    request_serializer=None if lean else pb.ReportLoadRequest.SerializeToString,
                    response_deserializer=pb.ReportLoadAck.FromString,
                )
                for c in chans
            ]
        elif lean:
            methods = [
                c.stream_unary(
                    "/eplb.v1.ExpertLoadBalancerService/ReportLoad",
                    request_serializer=None,
                    response_deserializer=pb.ReportLoadResponse.FromString,
                )
                for c in chans
            ]
        else:
            methods = [pb_grpc.ExpertLoadBalancerServiceStub(c).ReportLoad for c in chans]
        for c in chans:
            await c.channel_ready()
        # Every client starts its load together, after its start-up (imports, the pool).
        await asyncio.get_running_loop().run_in_executor(None, start.wait, 120)
        cpu0 = time.process_time()
        # LEAD_S before and after the GetPlacement callers' ``seconds``: they see the load only.
        deadline = time.perf_counter() + seconds + 2 * LEAD_S
        # Distinct ranks per stream (seqs only grow within a rank): rank = worker * streams + i.
        seq0 = time.time_ns() // 1000

        async def stream(i: int) -> int:
            rank = worker * streams + i
            interval = streams * procs / rate if rate else 0.0

            async def requests():
                k = 0
                # The streams of all workers spread evenly over one interval.
                nxt = time.perf_counter() + interval * (i * procs + worker) / (streams * procs)
                while time.perf_counter() < deadline:
                    if interval:
                        await asyncio.sleep(max(0.0, nxt - time.perf_counter()))
                        nxt += interval
                    k += 1
                    name = own if own is not None else names[(i + k * streams) % len(names)]
                    if lean:
                        head = pb.ReportLoadRequest(deployment=name, rank=rank, seq=seq0 + k).SerializeToString()
                        yield head + counts_fields[k % len(pool)]
                    else:
                        yield pb.ReportLoadRequest(
                            deployment=name,
                            rank=rank,
                            seq=seq0 + k,
                            logical=pb.Array(dtype=pb.DTYPE_INT32, shape=[58, 256], data=pool[k % len(pool)]),
                        )

            own = None
            method = methods[(worker + i) % len(methods)]
            if spread == "deployment":
                # One deployment a rank, on the instance its name picks (Endpoints.prefer).
                own = names[rank % len(names)]
                at = zlib.crc32(own.encode()) % len(targets)
                method = methods[((worker + i) % connections) * len(targets) + at]
            if rpc == "reportload":
                return (await method(requests())).accepted
            # As LoadReporter and eplb agent send: one report on the kept-open StreamLoad
            # stream, the next once its ack came.
            call = method()
            accepted = 0
            async for request in requests():
                await call.write(request)
                accepted += (await call.read()).accepted
            await call.done_writing()
            await call.code()
            return accepted

        t0 = time.perf_counter()
        accepted = sum(await asyncio.gather(*(stream(i) for i in range(streams))))
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        for c in chans:
            await c.close()
        out.put((accepted, elapsed, cpu))

    asyncio.run(main())


def _redis_counters(ports: list[int]) -> list[tuple[int, float]]:
    """Per master: (bytes read from clients, CPU seconds used)."""
    counters = []
    for port in ports:
        with redis.Redis(port=port) as r:
            stats, cpu = r.info("stats"), r.info("cpu")
            counters.append(
                (int(stats["total_net_input_bytes"]), float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]))
            )
    return counters


def _run(targets: list[str], names: list[str], ports: list[int], pids: list[int], rate: float, args) -> dict:
    """``targets``: the instances that take reports, then the one GetPlacement is called on."""
    ctx = mp.get_context("spawn")
    out, lat_out = ctx.Queue(), ctx.Queue()
    seconds, lean = args.seconds, args.clients == "lean"
    clients = args.client_procs
    start = ctx.Barrier(clients + 1 + 1)  # the clients and this process
    procs = [
        ctx.Process(
            target=_ingest_worker,
            args=(
                targets[:-1],
                names,
                w,
                seconds,
                rate,
                out,
                lean,
                start,
                args.streams,
                clients,
                args.connections,
                args.rpc,
                args.spread,
            ),
        )
        for w in range(clients)
    ]
    procs.append(
        ctx.Process(
            target=latency_worker,
            args=(
                targets[-1],  # the probe target: the first instance, or the reader
                names[0],
                args.probe_callers,
                seconds,
                args.probe_interval_ms / 1e3,
                lat_out,
                start,
                LEAD_S,
            ),
        )
    )
    for p in procs:
        p.start()
    # The counters from when the load starts, not from the clients' start-up; a client that
    # failed on its way (its traceback above) breaks the barrier rather than hanging the run.
    wait_s = seconds + 2 * LEAD_S + 120
    try:
        start.wait(timeout=120)
        before, cpu_before = _redis_counters(ports), proc_cpu(pids)
        results = [out.get(timeout=wait_s) for _ in range(clients)]
        lat, _, probe_cpu = lat_out.get(timeout=wait_s)
    except (queue.Empty, threading.BrokenBarrierError):
        for p in procs:
            p.kill()
        raise RuntimeError("a client process failed (its traceback is above)") from None
    for p in procs:
        p.join()
    time.sleep(1.5)  # the instances' last flushes
    after, cpu_after = _redis_counters(ports), proc_cpu(pids)
    clients_cpu = sum(c for _, _, c in results) + probe_cpu
    accepted = sum(a for a, _, _ in results)
    elapsed = max(e for _, e, _ in results)
    n = max(1, accepted)
    redis_cpu = [a[1] - b[1] for a, b in zip(after, before)]
    return {
        "reports_per_s": accepted / elapsed,
        "bytes_per_report": sum(a[0] - b[0] for a, b in zip(after, before)) / n,
        "get_p99_ms": percentile(lat, 99) * 1e3,
        "get_p50_ms": percentile(lat, 50) * 1e3,
        "redis_ms_per_report": sum(redis_cpu) * 1e3 / n,
        # Over the clients' time plus the 1.5 s of last flushes: a lower bound of the busy share.
        "hot_master_pct": max(redis_cpu, default=0.0) * 100 / (elapsed + 1.5),
        "service_ms_per_report": (cpu_after - cpu_before) * 1e3 / n,
        "service_cores": (cpu_after - cpu_before) / (elapsed + 1.5),
        # Every client process (load and GetPlacement callers) over the load: its share of the cores.
        "client_ms_per_report": clients_cpu * 1e3 / n,
        "client_cores": clients_cpu / elapsed,
    }


def _configs(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    return [(k, r, d) for k in args.kinds for r in args.instances for d in args.deployments]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", type=lambda s: s.split(","), default=["redis", "cluster"])
    ap.add_argument("--instances", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--deployments", type=lambda s: [int(x) for x in s.split(",")], default=[1, 50])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--rate-of-max",
        type=float,
        help="pace at this share of the run's measured max instead of --rate (e.g. 0.8: issue 35's "
        "GetPlacement p99 at 80 %% of the maximum)",
    )
    ap.add_argument(
        "--clients",
        choices=("lean", "protobuf"),
        default="lean",
        help="lean: load clients send pre-serialized requests; protobuf: they build each message",
    )
    ap.add_argument(
        "--rpc",
        choices=("streamload", "reportload"),
        default="streamload",
        help="streamload (as LoadReporter and eplb agent send): each report on a kept-open StreamLoad stream, "
        "the next once its ack came; reportload: ReportLoad streams the service reads as fast as it can",
    )
    ap.add_argument(
        "--serve-args", default="", help="extra eplb serve flags, e.g. '--report-linger-seconds 0' (an A/B of one flag)"
    )
    ap.add_argument(
        "--probe-on",
        choices=("first", "reader"),
        default="first",
        help="GetPlacement on the first instance (which takes reports too), or on one more instance that takes none",
    )
    ap.add_argument(
        "--spread",
        choices=("report", "deployment"),
        default="report",
        help="report: each stream's reports go to every deployment in turn (so every serving process keeps "
        "every deployment's window); deployment: a stream is one rank of one deployment, sent to the instance "
        "its name picks, as engines' ranks are (Endpoints.prefer)",
    )
    ap.add_argument(
        "--reader-args",
        default="--reads-only --processes 1",
        help="flags the reader gets after --serve-args (--probe-on reader; default '--reads-only --processes 1')",
    )
    ap.add_argument(
        "--streams",
        type=int,
        default=STREAMS,
        help=f"ReportLoad streams per load client process, one rank each (default {STREAMS})",
    )
    ap.add_argument(
        "--client-procs", type=int, default=INGEST_PROCS, help=f"load client processes (default {INGEST_PROCS})"
    )
    ap.add_argument(
        "--connections",
        type=int,
        default=1,
        help="connections per load client process to each instance, streams spread over them (default 1; "
        "more to spread over an instance's --processes)",
    )
    ap.add_argument("--probe-callers", type=int, default=4, help="GetPlacement callers (default 4)")
    ap.add_argument(
        "--probe-interval-ms", type=float, default=5.0, help="each caller's interval in ms (default 5; 0: back to back)"
    )
    ap.add_argument("--cpus-redis", type=cpu_list, help="cores for every redis-server (e.g. 0,1)")
    ap.add_argument("--cpus-service", type=cpu_list, help="cores for the eplb serve instances (e.g. 0,1)")
    ap.add_argument(
        "--cpus-reader", type=cpu_list, help="cores for the reader (--probe-on reader; default: the service's)"
    )
    ap.add_argument("--cpus-clients", type=cpu_list, help="cores for the load and GetPlacement clients (e.g. 2-15)")
    ap.add_argument("--profile-dir", type=Path, help="run each instance under cProfile; profiles land here")
    args = ap.parse_args(argv)
    if args.client_procs < 1 or args.connections < 1:
        ap.error("--client-procs and --connections must be at least 1")
    if args.streams < 1:
        ap.error(f"--streams must be at least 1, got {args.streams}")
    if args.rate_of_max is not None and not 0 < args.rate_of_max <= 1:
        ap.error(f"--rate-of-max must be in (0, 1], got {args.rate_of_max}")
    if args.probe_on == "reader" and not set(args.kinds) <= {"redis", "cluster"}:
        ap.error("--probe-on reader needs instances that share a store: --kinds redis and/or cluster")
    rows = []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="eplb-ingest-") as tmp:
        workdir = Path(tmp)
        for kind in args.kinds:
            pin(args.cpus_redis)
            if kind in ("bare", "memory"):
                backend, url, ports = None, "", []
            elif kind == "cluster":
                backend = ClusterProcesses(workdir / "cluster", appendfsync=None)
                backend.start()
                url, ports = backend.url, backend.ports
            else:
                backend = RedisProcess(workdir, appendfsync=None)
                backend.start()
                url, ports = backend.url, [backend.port]
            try:
                for _, instances, deployments in [c for c in _configs(args) if c[0] == kind]:
                    rows.append(_measure(kind, url, ports, instances, deployments, args, workdir))
                    _print_row(rows[-1])
            finally:
                if backend is not None:
                    backend.stop()
    print()
    print(
        f"ingestion, int32 [58, 256] reports (payload {PAYLOAD} bytes), medians of {args.repeats} run(s); "
        f"{os.cpu_count()} cores, load average {load:.1f} at start; cores: redis {_cores(args.cpus_redis)}, "
        f"service {_cores(args.cpus_service)}, clients {_cores(args.cpus_clients)}"
    )
    print(_HEADER)
    for row in rows:
        _print_row(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


class _BareServe(ServeProcess):
    """``harness.bare_server`` in place of an instance: the floor (no Redis, no report work)."""

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "eplb_bench.harness.bare_server", "--port", str(self.port)],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )


class _ProfiledServe(ServeProcess):
    """An instance under ``cProfile -o profile``, stopped with SIGINT so that the profile is written."""

    profile: Path | None = None

    def start(self) -> None:
        argv = serve_argv(self.port, self.redis_url, self.prefix, *self.args)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cProfile", "-o", str(self.profile), *argv[1:]],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )

    def stop(self) -> None:
        if self.running:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        super().stop()


def _cores(cores: list[int] | None) -> str:
    return ",".join(map(str, cores)) if cores else "any"


def _measure(kind: str, url: str, ports: list[int], instances: int, deployments: int, args, workdir: Path) -> dict:
    prefix = f"ingest-{uuid.uuid4().hex[:8]}"
    servers = [
        ServeProcess(
            url,
            prefix,
            workdir / f"{prefix}-{i}.log",
            ("--log-level", "WARNING", *args.serve_args.split(), *(args.reader_args.split() if i == instances else ())),
        )
        for i in range(instances + (args.probe_on == "reader"))
    ]
    if kind == "bare":
        servers = [_BareServe(s.redis_url, s.prefix, s.log_path) for s in servers]
    elif args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        servers = [_ProfiledServe(s.redis_url, s.prefix, s.log_path, s.args) for s in servers]
        for i, s in enumerate(servers):
            s.profile = args.profile_dir / f"{prefix}-{i}.prof"
    for i, s in enumerate(servers):
        pin(args.cpus_reader if i == instances and args.cpus_reader else args.cpus_service)
        s.start()
    pin(args.cpus_clients)
    try:
        for s in servers:
            s.wait_listening()
        names = [f"d{i}" for i in range(deployments)]
        for name in names:
            create_v3(servers[0].target, name, ranks=args.client_procs * args.streams)
        # The report streams go to the first ``instances``; GetPlacement to the first, or to the
        # instance after them that takes no reports (--probe-on reader).
        probe = servers[-1] if args.probe_on == "reader" else servers[0]
        targets = [s.target for s in servers[:instances]] + [probe.target]
        pids = [s.proc.pid for s in servers]
        runs_max = [_run(targets, names, ports, pids, 0.0, args) for _ in range(args.repeats)]
        rate = args.rate
        if args.rate_of_max is not None:
            rate = args.rate_of_max * statistics.median(r["reports_per_s"] for r in runs_max)
        runs_paced = [_run(targets, names, ports, pids, rate, args) for _ in range(args.repeats)]
    finally:
        for s in servers:
            s.stop()

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    return {
        "redis": kind,
        "instances": instances,
        "probe_on": args.probe_on,
        "streams": args.streams,
        "rpc": args.rpc,
        "spread": args.spread,
        "client_procs": args.client_procs,
        "connections": args.connections,
        "deployments": deployments,
        "max_reports_per_s": med(runs_max, "reports_per_s"),
        "bytes_per_report": med(runs_max, "bytes_per_report"),
        "max_get_p99_ms": med(runs_max, "get_p99_ms"),
        "paced_reports_per_s": med(runs_paced, "reports_per_s"),
        "paced_bytes_per_report": med(runs_paced, "bytes_per_report"),
        "paced_get_p99_ms": med(runs_paced, "get_p99_ms"),
        "paced_get_p50_ms": med(runs_paced, "get_p50_ms"),
        "redis_ms_per_report": med(runs_max, "redis_ms_per_report"),
        "hot_master_pct": med(runs_max, "hot_master_pct"),
        "service_ms_per_report": med(runs_max, "service_ms_per_report"),
        "service_cores": med(runs_max, "service_cores"),
        "paced_service_cores": med(runs_paced, "service_cores"),
        "paced_client_cores": med(runs_paced, "client_cores"),
        "paced_redis_ms_per_report": med(runs_paced, "redis_ms_per_report"),
        "paced_service_ms_per_report": med(runs_paced, "service_ms_per_report"),
    }


_HEADER = (
    f"{'redis':8} {'instances':>9} {'deploys':>7} {'max rep/s':>10} {'B/report':>9} {'x payload':>9} {'p99 ms':>7} "
    f"{'redis ms/rep':>12} {'hot master %':>12} {'service ms/rep':>14} {'svc cores':>9} | "
    f"{'paced rep/s':>11} {'p50 ms':>7} {'p99 ms':>7} {'svc cores':>9} {'client cores':>12}"
)


def _print_row(r: dict) -> None:
    print(
        f"{r['redis']:8} {r['instances']:>9} {r['deployments']:>7} {r['max_reports_per_s']:>10.0f} "
        f"{r['bytes_per_report']:>9.0f} {r['bytes_per_report'] / PAYLOAD:>9.2f} {r['max_get_p99_ms']:>7.1f} "
        f"{r['redis_ms_per_report']:>12.3f} {r['hot_master_pct']:>12.0f} {r['service_ms_per_report']:>14.3f} "
        f"{r['service_cores']:>9.2f} | "
        f"{r['paced_reports_per_s']:>11.0f} {r['paced_get_p50_ms']:>7.2f} {r['paced_get_p99_ms']:>7.1f} "
        f"{r['paced_service_cores']:>9.2f} {r['paced_client_cores']:>12.2f}",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
