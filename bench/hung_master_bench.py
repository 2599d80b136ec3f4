"""What a hung Redis Cluster master costs the calls of its deployments (issue 32, defect 5).

    python -m eplb_bench.hung_master_bench [--rounds 3] [--load 0,400] [--json FILE]

Starts a private 3-master Redis Cluster (``harness/redis_cluster.py``, no persistence) and one
``eplb serve`` on it (a child process), creates a small deployment on each master (and one more
on the victim master, to delete), reports to them and forces a re-plan of each, then SIGSTOPs
one master: its sockets stay open and nothing answers. Every RPC that touches the victim's
deployments is called at once and then every 0.5 s, for ``--hung-seconds``; each call's time to
its answer (``UNAVAILABLE`` expected; ``GetPlacement`` of the current version is served from
memory) is kept, and so is the slowest call on the other masters' deployments in that time.
Then SIGCONT, and the time until the victim's deployment takes a report again.

``--single`` does the same on one private ``redis-server`` (every deployment on it, so no
other master serves meanwhile).

``--load N`` runs the same rounds while a client process sends N reports/s spread over every
deployment (the victim's included, as engines keep sending), each report its own ReportLoad
call, errors ignored. Prints, per load and RPC, the slowest time to fail over the rounds (and
the median of the rounds' slowest).

To measure another tree's service (the one before a change), run this file with that tree's
interpreter: ``/path/to/other/.venv/bin/python bench/hung_master_bench.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from multiprocessing.synchronize import Event
from pathlib import Path

import grpc
import numpy as np

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .harness.processes import RedisProcess, ServeProcess
from .harness.redis_cluster import ClusterProcesses
from .harness.service import aio_channel, reports

TOPOLOGY = pb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)
LOADS = np.broadcast_to((np.arange(16, dtype=np.int32) % 7 + 1) * 10, (4, 16)).copy()
RPCS = (
    "GetDeployment",
    "GetPlacement",
    "GetPlacement+window",
    "ReportLoad",
    "AckPlacement",
    "Rebalance",
    "SetRanksDown",
    "CreateDeployment",
    "DeleteDeployment",
    "ListDeployments",
)


class SingleRedis(RedisProcess):
    """One ``redis-server`` with the parts of ``ClusterProcesses`` this bench uses."""

    @property
    def ports(self) -> list[int]:
        return [self.port]

    def port_of(self, key: str) -> int:
        return self.port

    def pause(self, port: int) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self, port: int) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


def names_by_master(cluster: ClusterProcesses, prefix: str, per_master: int) -> dict[int, list[str]]:
    """``per_master`` deployment names whose slot each master owns."""
    out: dict[int, list[str]] = {p: [] for p in cluster.ports}
    i = 0
    while any(len(v) < per_master for v in out.values()):
        name = f"d{i}"
        names = out[cluster.port_of(f"{prefix}:{{{name}}}:meta")]
        if len(names) < per_master:
            names.append(name)
        i += 1
    return out


def load_worker(target: str, names: list[str], rate: float, stop: Event) -> None:
    """``rate`` reports/s over ``names`` (round robin), each report its own call; errors ignored."""

    async def main() -> None:
        chan = aio_channel(target)
        stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
        inflight: set[asyncio.Task] = set()
        i = 0
        t0 = time.monotonic()
        while not stop.is_set():
            name = names[i % len(names)]
            task = asyncio.create_task(_quiet(stub.ReportLoad(iter(reports(name, 1 + i % 4, [LOADS])), timeout=10)))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        for task in list(inflight):
            task.cancel()
        await chan.close()

    asyncio.run(main())


async def _quiet(call) -> None:
    try:
        await call
    except grpc.aio.AioRpcError:
        pass


async def timed(call) -> tuple[str, float]:
    start = time.monotonic()
    try:
        await call
        code = "OK"
    except grpc.aio.AioRpcError as exc:
        code = exc.code().name
    return code, time.monotonic() - start


def victim_calls(stub, victim: str, to_delete: str, fresh: str) -> dict[str, object]:
    return {
        "GetDeployment": stub.GetDeployment(pb.GetDeploymentRequest(name=victim), timeout=15),
        "GetPlacement": stub.GetPlacement(pb.GetPlacementRequest(deployment=victim), timeout=15),
        "GetPlacement+window": stub.GetPlacement(
            pb.GetPlacementRequest(deployment=victim, include_window_loads=True), timeout=15
        ),
        "ReportLoad": stub.ReportLoad(iter(reports(victim, 0, [LOADS])), timeout=15),
        "AckPlacement": stub.AckPlacement(pb.AckPlacementRequest(deployment=victim, rank=0, version=2), timeout=15),
        "Rebalance": stub.Rebalance(pb.RebalanceRequest(deployment=victim, force=True), timeout=15),
        "SetRanksDown": stub.SetRanksDown(pb.SetRanksDownRequest(deployment=victim, down=[7]), timeout=15),
        "CreateDeployment": stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=pb.Deployment(name=fresh, topology=TOPOLOGY)), timeout=15
        ),
        "DeleteDeployment": stub.DeleteDeployment(pb.DeleteDeploymentRequest(name=to_delete), timeout=15),
        "ListDeployments": stub.ListDeployments(pb.ListDeploymentsRequest(), timeout=15),
    }


async def one_round(args: argparse.Namespace, load: float, workdir: Path) -> dict:
    if args.single:
        cluster = SingleRedis(workdir / f"redis-{uuid.uuid4().hex[:6]}", appendfsync=None)
        cluster.directory.mkdir()
    else:
        cluster = ClusterProcesses(workdir / f"cluster-{uuid.uuid4().hex[:6]}", appendfsync=None)
    cluster.start()
    prefix = f"hung-{uuid.uuid4().hex[:8]}"
    server = ServeProcess(cluster.url, prefix, workdir / f"{prefix}.log")
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    loader = None
    try:
        server.start()
        server.wait_listening()
        by_master = names_by_master(cluster, prefix, 2 + args.waves)
        victim_port = cluster.ports[-1]
        chan = aio_channel(server.target)
        stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
        used = {p: names[:2] for p, names in by_master.items()}
        for names in used.values():
            for n in names:
                d = pb.Deployment(name=n, topology=TOPOLOGY, ranks=range(8))
                await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
                await stub.ReportLoad(iter(reports(n, 0, [LOADS])))
                await stub.Rebalance(pb.RebalanceRequest(deployment=n, force=True))
        victim, to_delete = used[victim_port]
        fresh = iter(by_master[victim_port][2:])
        others = [n for p, names in used.items() if p != victim_port for n in names]
        if load:
            loader = ctx.Process(
                target=load_worker, args=(server.target, [n for v in used.values() for n in v], load, stop)
            )
            loader.start()
            await asyncio.sleep(2.0)

        slowest: dict[str, tuple[str, float]] = {}
        other_slowest = 0.0
        other_failed = 0

        async def wave() -> None:
            nonlocal other_slowest, other_failed
            calls = victim_calls(stub, victim, to_delete, next(fresh))
            others_calls = [stub.GetDeployment(pb.GetDeploymentRequest(name=n), timeout=15) for n in others] + [
                stub.ReportLoad(iter(reports(n, 0, [LOADS])), timeout=15) for n in others
            ]
            got = await asyncio.gather(*(timed(c) for c in calls.values()), *(timed(c) for c in others_calls))
            for rpc, (code, took) in zip(calls, got[: len(calls)]):
                if rpc not in slowest or took > slowest[rpc][1]:
                    slowest[rpc] = (code, took)
            for code, took in got[len(calls) :]:
                other_slowest = max(other_slowest, took)
                other_failed += code != "OK"

        cluster.pause(victim_port)
        stopped = time.monotonic()
        try:
            waves = []
            for i in range(args.waves):
                await asyncio.sleep(max(0.0, stopped + i * 0.5 - time.monotonic()))
                waves.append(asyncio.create_task(wave()))
            await asyncio.gather(*waves)
        finally:
            cluster.resume(victim_port)
        resumed = time.monotonic()
        while True:
            code, _ = await timed(stub.ReportLoad(iter(reports(victim, 0, [LOADS])), timeout=5))
            if code == "OK" or time.monotonic() - resumed > 30:
                break
            await asyncio.sleep(0.05)
        recovered = time.monotonic() - resumed if code == "OK" else float("nan")
        await chan.close()
    finally:
        stop.set()
        if loader is not None and loader.pid is not None:
            loader.join(15)
        server.stop()
        cluster.stop()
    return {
        "load": load,
        "slowest": slowest,
        "others_slowest_s": other_slowest,
        "others_failed": other_failed,
        "recovered_s": recovered,
    }


async def main_async(args: argparse.Namespace) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="hung-master-"))
    rows = []
    for load in args.load:
        for r in range(args.rounds):
            row = await one_round(args, load, workdir)
            rows.append(row)
            worst = max(row["slowest"].items(), key=lambda kv: kv[1][1])
            print(
                f"load {load:g}/s round {r + 1}: slowest victim call {worst[0]} {worst[1][1]:.2f} s "
                f"({worst[1][0]}); other masters' calls at most {row['others_slowest_s']:.2f} s, "
                f"{row['others_failed']} failed; reports again {row['recovered_s']:.2f} s after SIGCONT",
                flush=True,
            )
    print(f"\nseconds to the answer, slowest of {args.waves} waves (0.5 s apart from the SIGSTOP), over rounds")
    print("| RPC (victim's deployment) | " + " | ".join(f"load {x:g}/s: max (median), code" for x in args.load) + " |")
    print("|---|" + "---|" * len(args.load))
    for rpc in RPCS:
        cells = []
        for load in args.load:
            got = [row["slowest"][rpc] for row in rows if row["load"] == load]
            times = [t for _, t in got]
            codes = "/".join(sorted({c for c, _ in got}))
            cells.append(f"{max(times):.2f} ({statistics.median(times):.2f}), {codes}")
        print(f"| {rpc} | " + " | ".join(cells) + " |")
    for load in args.load:
        mine = [row for row in rows if row["load"] == load]
        print(
            f"load {load:g}/s: other masters' calls at most {max(r['others_slowest_s'] for r in mine):.2f} s "
            f"({sum(r['others_failed'] for r in mine)} failed); reports again after SIGCONT in "
            + ", ".join(f"{r['recovered_s']:.2f}" for r in mine)
            + " s"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per load, each on a fresh cluster and service")
    ap.add_argument("--load", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 400.0])
    ap.add_argument("--waves", type=int, default=8, help="waves of calls, 0.5 s apart from the SIGSTOP")
    ap.add_argument("--single", action="store_true", help="one redis-server instead of a 3-master cluster")
    ap.add_argument("--json", type=Path, help="write the rows here")
    args = ap.parse_args(argv)
    rows = asyncio.run(main_async(args))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
