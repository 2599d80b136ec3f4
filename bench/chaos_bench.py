"""Chaos run: instances and Redis killed and restarted at random under steady load, then checked.

    python -m eplb_bench.chaos_bench --seconds 300 [--instances 3] [--ranks 16] [--watchers 50]
                                     [--lease-seconds 5] [--seed 0] [--cluster] [--json FILE]

Starts a private ``redis-server`` (free port, temp directory, AOF with ``appendfsync always``,
so every write Redis acknowledged survives a kill of Redis: without persistence a Redis kill
loses the state by design, see docs/service.md) and ``--instances`` ``eplb serve`` processes on
it. One deployment; ``--ranks`` ranks stream a batch of reports every ``--report-period`` seconds
each, retrying a failed batch with the same seqs on another instance until one answers OK;
``--watchers`` ``WatchPlacements`` streams reconnect to any instance with ``since_version`` set
to the last version they saw; a planner forces a ``Rebalance`` through a random instance every
0.5 s. For ``--seconds``, one event at a time at random moments: SIGKILL an instance, SIGTERM an
instance, or SIGKILL Redis, then restart it after a random pause.

``--cluster`` runs on a private 3-master Redis Cluster instead (``bench/harness/redis_cluster.py``: free
ports, each master in its own directory with the same AOF settings, ``cluster-require-full-coverage
no``), and the Redis event is a SIGKILL of the master that owns the deployment's slot, restarted
on its port and directory (its AOF and ``nodes.conf`` bring its data and slots back).

Checks, each printed with its figures (exit code 1 if one fails):
- every report is counted exactly once: the window (a dry-run ``Rebalance``) holds exactly the
  reports sent, and resending every report afterwards finds each one already accepted;
- every watcher saw consecutive versions (no gap, no duplicate) and ends at the last version;
- every instance answers SERVING within one lease (``--lease-seconds``) of its restart, or of
  Redis answering again.

No instance log may hold a traceback; each one found is quoted in the result's ``tracebacks``
by ``traceback_excerpts(text)``, which does the same for any ``eplb serve`` log (the instance
logs stay in ``--workdir`` when given): the log line before each traceback and its last lines,
the exception's included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from eplb_wire import arrays
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .harness.processes import RedisProcess, ServeProcess
from .harness.redis_cluster import ClusterProcesses

__all__ = ["ChaosConfig", "ChaosResult", "main", "run_chaos", "traceback_excerpts"]

SERVICE = "eplb.v1.ExpertLoadBalancerService"
NAME = "chaos"
LAYERS, EXPERTS = 4, 32
BATCH = 5
# Reconnect at once to a restarted instance instead of gRPC's default backoff (1 s, growing).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
RETRYABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "ABORTED", "INTERNAL_client"}
# grpc-python's asyncio client turns a status that arrives while it still writes a stream (a
# instance killed mid-stream) into this INTERNAL (grpc/grpc#36066): a transport failure, retried.
CORE_INTERNAL = "Internal error from Core"


def _code(exc: grpc.aio.AioRpcError) -> str:
    """The status code's name; the client-side INTERNAL above as ``INTERNAL_client``."""
    name = exc.code().name
    return "INTERNAL_client" if name == "INTERNAL" and exc.details() == CORE_INTERNAL else name


@dataclass(frozen=True)
class ChaosConfig:
    seconds: float = 300.0
    instances: int = 3
    ranks: int = 16
    watchers: int = 50
    lease_s: float = 5.0
    report_period_s: float = 0.25
    seed: int = 0
    # A 3-master Redis Cluster instead of one Redis; the Redis event kills the deployment's master.
    cluster: bool = False


@dataclass
class ChaosResult:
    config: ChaosConfig
    events: Counter = field(default_factory=Counter)
    reports_sent: int = 0
    window_reports: float = 0.0
    resent_accepted: int = 0
    report_retries: Counter = field(default_factory=Counter)
    versions: int = 0
    plans: Counter = field(default_factory=Counter)
    watcher_gaps: int = 0
    watcher_duplicates: int = 0
    watcher_reconnects: Counter = field(default_factory=Counter)
    watchers_behind: int = 0
    serving_s: list[tuple[str, float]] = field(default_factory=list)
    tracebacks_in_logs: int = 0
    # The last lines of each traceback in the instances' logs (the exception and where it rose),
    # so a run that saw one says what it was after its logs are deleted.
    tracebacks: list[str] = field(default_factory=list)
    load_average: float = 0.0
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        serving = [s for _, s in self.serving_s]
        out = {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(self).items()}
        out["config"] = asdict(self.config)
        out["serving_s"] = {
            "n": len(serving),
            "max": max(serving, default=0.0),
            "p50": float(np.median(serving)) if serving else 0.0,
            "max_by_event": {
                k: max(s for e, s in self.serving_s if e == k) for k in sorted({e for e, _ in self.serving_s})
            },
        }
        return out


def _deployment(ranks: int) -> pb.Deployment:
    d = pb.Deployment(
        name=NAME,
        policy="global",
        topology=pb.Topology(
            num_layers=LAYERS, num_experts=EXPERTS, num_slots=3 * ranks, num_gpus=ranks, num_nodes=2, num_groups=4
        ),
    )
    # Longer than any run, so the window still holds every report at the end.
    d.window.sliding.duration.FromSeconds(6 * 3600)
    return d


class _Harness:
    def __init__(self, config: ChaosConfig, workdir: Path, log: Callable[[str], None]) -> None:
        self.cfg = config
        self.rng = random.Random(config.seed)
        self.log = log
        self.result = ChaosResult(config)
        self.redis = ClusterProcesses(workdir / "cluster") if config.cluster else RedisProcess(workdir)
        self.counts = arrays.encode(np.ones((LAYERS, EXPERTS), np.int32))
        self.workdir = workdir
        self.instances: list[ServeProcess] = []
        self.stubs: list[pb_grpc.ExpertLoadBalancerServiceStub] = []
        self.channels: list[grpc.aio.Channel] = []
        self.sent: dict[int, list[pb.ReportLoadRequest]] = {}
        self.last_seen: list[int] = []
        self.stop_load = asyncio.Event()
        self.stop_plans = asyncio.Event()

    # processes

    def start_processes(self) -> None:
        self.redis.start()
        flags = (
            "--lease-seconds",
            str(self.cfg.lease_s),
            "--flush-seconds",
            "0.2",
            "--grace-seconds",
            "1",
            "--log-level",
            "WARNING",
        )
        self.prefix = prefix = f"chaos-{uuid.uuid4().hex[:8]}"
        self.instances = [
            ServeProcess(self.redis.url, prefix, self.workdir / f"instance{i}.log", flags)
            for i in range(self.cfg.instances)
        ]
        for r in self.instances:
            r.start()
        for r in self.instances:
            r.wait_listening()

    def stop_processes(self) -> None:
        for r in self.instances:
            r.signal(signal.SIGTERM)
        for r in self.instances:
            # Clean-up: whatever did not stop within 15 s is killed.
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.wait(15)
            r.stop()
        self.redis.stop()

    async def serving_within(self, i: int, since: float, event: str) -> None:
        """Polls instance ``i``'s health until SERVING; records the time from ``since``."""
        async with grpc.aio.insecure_channel(self.instances[i].target, options=CHANNEL_OPTIONS) as chan:
            stub = health_pb2_grpc.HealthStub(chan)
            while True:
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() - since > 60:
                    self.result.failures.append(f"instance {i} not SERVING 60 s after {event}")
                    return
                await asyncio.sleep(0.05)
        took = time.monotonic() - since
        self.result.serving_s.append((event, took))
        if took > self.cfg.lease_s:
            self.result.failures.append(
                f"instance {i} SERVING {took:.2f}s after {event}, over one lease ({self.cfg.lease_s:g}s)"
            )

    # load

    def _stub(self) -> tuple[int, pb_grpc.ExpertLoadBalancerServiceStub]:
        i = self.rng.randrange(len(self.stubs))
        return i, self.stubs[i]

    def _count_failure(self, rpc: str, exc: grpc.aio.AioRpcError, counts: Counter) -> None:
        """Counts ``exc`` in ``counts`` by its code; a code no chaos event explains is a failure."""
        code = _code(exc)
        counts[code] += 1
        if code not in RETRYABLE:
            self.result.failures.append(f"{time.strftime('%X')} {rpc}: unexpected {code}: {exc.details()}")

    async def deliver(self, batch: list[pb.ReportLoadRequest]) -> pb.ReportLoadResponse:
        """Sends ``batch`` until an instance answers OK (the same seqs each time)."""
        attempt = 0
        while True:
            _, stub = self._stub()
            try:
                return await stub.ReportLoad(iter(batch), timeout=5)
            except grpc.aio.AioRpcError as exc:
                self._count_failure("ReportLoad", exc, self.result.report_retries)
                attempt += 1
                await asyncio.sleep(min(0.5, 0.02 * attempt))

    async def rank(self, r: int) -> None:
        sent = self.sent.setdefault(r, [])
        while not self.stop_load.is_set():
            batch = [
                pb.ReportLoadRequest(deployment=NAME, rank=r, seq=len(sent) + i + 1, logical=self.counts)
                for i in range(BATCH)
            ]
            sent.extend(batch)
            await self.deliver(batch)
            await asyncio.sleep(self.cfg.report_period_s * (0.5 + self.rng.random()))

    async def watcher(self, w: int) -> None:
        while True:
            i, stub = self._stub()
            try:
                call = stub.WatchPlacements(pb.WatchPlacementsRequest(deployment=NAME, since_version=self.last_seen[w]))
                async for reply in call:
                    v, last = reply.placement.version, self.last_seen[w]
                    if last and v <= last:
                        self.result.watcher_duplicates += 1
                    elif last and v != last + 1:
                        self.result.watcher_gaps += 1
                        self.log(f"watcher {w}: version {v} after {last} (instance {i})")
                    self.last_seen[w] = max(v, last)
            except grpc.aio.AioRpcError as exc:
                self._count_failure("WatchPlacements", exc, self.result.watcher_reconnects)
            await asyncio.sleep(0.05 + 0.1 * self.rng.random())

    async def planner(self) -> None:
        while not self.stop_plans.is_set():
            _, stub = self._stub()
            try:
                out = await stub.Rebalance(pb.RebalanceRequest(deployment=NAME, force=True), timeout=10)
                self.result.plans["published" if out.published else "skipped"] += 1
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and "load window" in (exc.details() or ""):
                    # Before the first reports were flushed: nothing to plan yet, by design.
                    self.result.plans["empty window"] += 1
                else:
                    self._count_failure("Rebalance", exc, self.result.plans)
            await asyncio.sleep(0.5)

    # chaos

    async def chaos(self, until: float) -> None:
        kinds: list[str] = []
        while True:
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))
            if time.monotonic() >= until:
                return
            if not kinds:  # every kind once per round, in random order, so short runs see each
                kinds = ["sigkill_instance", "sigterm_instance", "sigkill_redis"]
                self.rng.shuffle(kinds)
            kind = kinds.pop()
            self.result.events[kind] += 1
            down_s = self.rng.uniform(0.2, 2.0)
            if kind == "sigkill_redis" and self.cfg.cluster:
                port = await asyncio.to_thread(self.redis.port_of, f"{self.prefix}:{{{NAME}}}:meta")
                self.log(f"{time.strftime('%X')} chaos: SIGKILL the deployment's master {port}, back in {down_s:.1f}s")
                await asyncio.to_thread(self.redis.kill, port)
                await asyncio.sleep(down_s)
                await asyncio.to_thread(self.redis.start_node, port)
                await asyncio.to_thread(self.redis.wait_ok)
                back = time.monotonic()
                await asyncio.gather(*(self.serving_within(i, back, kind) for i in range(len(self.instances))))
            elif kind == "sigkill_redis":
                self.log(f"{time.strftime('%X')} chaos: SIGKILL redis, back in {down_s:.1f}s")
                await asyncio.to_thread(self.redis.kill)
                await asyncio.sleep(down_s)
                await asyncio.to_thread(self.redis.start)
                back = time.monotonic()
                await asyncio.gather(*(self.serving_within(i, back, kind) for i in range(len(self.instances))))
            else:
                i = self.rng.randrange(len(self.instances))
                instance = self.instances[i]
                self.log(f"{time.strftime('%X')} chaos: {kind} instance {i}, back in {down_s:.1f}s")
                instance.signal(signal.SIGKILL if kind == "sigkill_instance" else signal.SIGTERM)
                await asyncio.to_thread(instance.wait, 30)
                await asyncio.sleep(down_s)
                started = time.monotonic()
                instance.start()
                await asyncio.to_thread(instance.wait_listening)
                await self.serving_within(i, started, kind)

    # the run

    async def run(self) -> ChaosResult:
        res = self.result
        self.channels = [grpc.aio.insecure_channel(r.target, options=CHANNEL_OPTIONS) for r in self.instances]
        self.stubs = [pb_grpc.ExpertLoadBalancerServiceStub(c) for c in self.channels]
        try:
            await self.stubs[0].CreateDeployment(pb.CreateDeploymentRequest(deployment=_deployment(self.cfg.ranks)))
            self.last_seen = [0] * self.cfg.watchers
            watchers = [asyncio.create_task(self.watcher(w)) for w in range(self.cfg.watchers)]
            ranks = [asyncio.create_task(self.rank(r)) for r in range(self.cfg.ranks)]
            planner = asyncio.create_task(self.planner())
            start = time.monotonic()
            await self.chaos(start + self.cfg.seconds)
            await asyncio.gather(*(self.serving_within(i, time.monotonic(), "end") for i in range(len(self.instances))))
            self.stop_load.set()
            self.stop_plans.set()
            await asyncio.gather(*ranks, planner)
            res.wall_s = time.monotonic() - start
            res.reports_sent = sum(len(s) for s in self.sent.values())
            # Watchers catch up to the last version.
            final = (
                await self.stubs[0].GetPlacement(pb.GetPlacementRequest(deployment=NAME), timeout=10)
            ).placement.version
            res.versions = final
            for _ in range(200):
                if min(self.last_seen) >= final:
                    break
                await asyncio.sleep(0.05)
            res.watchers_behind = sum(v < final for v in self.last_seen)
            for w in watchers:
                w.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            # Counted exactly once: the window holds every report, and each is known as accepted.
            await asyncio.sleep(1.0)  # every instance's last flush
            window = await self.stubs[0].Rebalance(
                pb.RebalanceRequest(deployment=NAME, dry_run=True, force=True), timeout=30
            )
            res.window_reports = window.window_tokens / (LAYERS * EXPERTS)
            for sent in self.sent.values():
                for k in range(0, len(sent), 500):
                    res.resent_accepted += (await self.deliver(sent[k : k + 500])).accepted
        finally:
            for c in self.channels:
                await c.close()
        self._check()
        return res

    def _check(self) -> None:
        res = self.result
        if res.window_reports != res.reports_sent:
            res.failures.append(
                f"window holds {res.window_reports:g} reports, {res.reports_sent} were sent and acknowledged"
            )
        if res.resent_accepted:
            res.failures.append(f"{res.resent_accepted} reports were accepted again when resent (their seqs were lost)")
        if res.watcher_gaps or res.watcher_duplicates:
            res.failures.append(f"watchers saw {res.watcher_gaps} version gaps and {res.watcher_duplicates} duplicates")
        if res.watchers_behind:
            res.failures.append(f"{res.watchers_behind} watchers did not reach version {res.versions}")
        for path in sorted(self.workdir.glob("instance*.log")):
            text = path.read_text(errors="replace")
            res.tracebacks_in_logs += text.count("Traceback")
            res.tracebacks += [f"{path.name}: {excerpt}" for excerpt in traceback_excerpts(text)]


def traceback_excerpts(text: str, tail: int = 6) -> list[str]:
    """Each traceback in the log ``text``, as one string: the log line before it (which says
    what failed) and its last ``tail`` lines, ending with the exception's line."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("Traceback"):
            continue
        end = i + 1
        while end < len(lines) and (lines[end].startswith((" ", "\t")) or lines[end].startswith("During handling")):
            end += 1
        # The exception line ends the block: the first unindented line after the frames.
        end = min(end + 1, len(lines))
        head = lines[i - 1] if i else ""
        out.append("\n".join([head, *lines[max(i, end - tail) : end]]))
    return out


def run_chaos(config: ChaosConfig, workdir: Path | None = None, log: Callable[[str], None] = print) -> ChaosResult:
    """Runs one chaos run (the module docstring says what it does and checks)."""
    with tempfile.TemporaryDirectory(prefix="eplb-chaos-") as tmp:
        work = Path(workdir) / time.strftime("run-%Y%m%d-%H%M%S") if workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        harness = _Harness(config, work, log)
        load = os.getloadavg()[0]
        harness.start_processes()
        try:
            result = asyncio.run(harness.run())
        finally:
            harness.stop_processes()
        result.load_average = load
        if result.failures and workdir is None:
            log(f"instance logs: {work} (deleted at exit; pass --workdir to keep them)")
            for path in sorted(work.glob("instance*.log")):
                log(f"--- {path.name} (last lines)")
                log("\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eplb_bench.chaos_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--watchers", type=int, default=50)
    ap.add_argument("--lease-seconds", type=float, default=5.0)
    ap.add_argument("--report-period", type=float, default=0.25, help="seconds between a rank's batches of 5 reports")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None, help="keep Redis files and instance logs here")
    ap.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster; SIGKILL the deployment's master")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    config = ChaosConfig(
        seconds=args.seconds,
        instances=args.instances,
        ranks=args.ranks,
        watchers=args.watchers,
        lease_s=args.lease_seconds,
        report_period_s=args.report_period,
        seed=args.seed,
        cluster=args.cluster,
    )
    result = run_chaos(config, args.workdir)
    summary = result.summary()
    print(json.dumps(summary, indent=2, default=dict))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=dict))
    print("PASS" if not result.failures else "FAIL:\n  " + "\n  ".join(result.failures))
    return 0 if not result.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
