"""What idle deployments cost: the CPU of ``eplb serve`` instances that follow many deployments
and receive no reports at all.

    python -m eplb_bench.idle_bench [--kinds redis,cluster] [--deployments 100,1000] [--instances 1,2]
        [--seconds 20] [--settle 5] [--repeats 1] [--serve-args "FLAGS"]

For each Redis kind (a private ``redis-server`` or a private 3-master Redis Cluster, without
persistence), each count of deployments (v3-decode-144 shaped: 58 layers, 256 experts, 144
ranks on 18 nodes) and each count of instances: the instances start, the deployments are
created through the first one (every instance follows all of them: they plan, restore and
serve any), the instances get ``--settle`` seconds to adopt them, and then each instance's CPU
(``/proc/PID/stat`` utime + stime) is read over ``--seconds``. Prints each instance's share of
one core and Redis's (every master summed), each instance's RSS and Redis's ``used_memory``
(every master summed) at the end. Issue 35's target: ≤ 5 % of a core for 1,000
deployments, not growing with the number of instances.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import redis

from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .harness.processes import RedisProcess, ServeProcess
from .harness.redis_cluster import ClusterProcesses

TOPOLOGY = dict(num_layers=58, num_experts=256, num_slots=288, num_gpus=144, num_nodes=18, num_groups=8)
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _redis_mb(ports: list[int]) -> float:
    return sum(redis.Redis(port=port).info("memory")["used_memory"] for port in ports) / 2**20


def _redis_cpu_s(ports: list[int]) -> float:
    total = 0.0
    for port in ports:
        info = redis.Redis(port=port).info("cpu")
        total += info["used_cpu_sys"] + info["used_cpu_user"]
    return total


def _create(target: str, count: int) -> float:
    """Creates ``count`` deployments through ``target``; the seconds it took."""
    t0 = time.monotonic()
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
        for i in range(count):
            stub.CreateDeployment(
                pb.CreateDeploymentRequest(
                    deployment=pb.Deployment(
                        name=f"idle-{i}", topology=pb.Topology(**TOPOLOGY), ranks=range(TOPOLOGY["num_gpus"])
                    )
                ),
                timeout=60,
            )
    return time.monotonic() - t0


def _measure(kind: str, deployments: int, instances: int, args: argparse.Namespace, workdir: Path) -> dict:
    if kind == "cluster":
        store = ClusterProcesses(workdir / "cluster", appendfsync=None)
        (workdir / "cluster").mkdir()
        store.start()
        url, ports = store.url, store.ports
    else:
        store = RedisProcess(workdir, appendfsync=None)
        store.start()
        url, ports = store.url, [store.port]
    serves = [
        ServeProcess(url, "idle", workdir / f"serve-{i}.log", tuple(shlex.split(args.serve_args)))
        for i in range(instances)
    ]
    try:
        for s in serves:
            s.start()
        for s in serves:
            s.wait_listening()
        created_s = _create(serves[0].target, deployments)
        time.sleep(args.settle)
        pids = [s.proc.pid for s in serves]
        before = [_cpu_s(p) for p in pids]
        redis_before = _redis_cpu_s(ports)
        t0 = time.monotonic()
        time.sleep(args.seconds)
        elapsed = time.monotonic() - t0
        shares = [(_cpu_s(p) - b) / elapsed for p, b in zip(pids, before, strict=True)]
        redis_share = (_redis_cpu_s(ports) - redis_before) / elapsed
        rss = [_rss_mb(p) for p in pids]
        redis_mb = _redis_mb(ports)
        for s in serves:
            if not s.running:
                raise RuntimeError(f"an instance exited; see {s.log_path}")
        return dict(
            kind=kind,
            deployments=deployments,
            instances=instances,
            create_s=created_s,
            instance_core_percent=[100 * s for s in shares],
            redis_core_percent=100 * redis_share,
            rss_mb=rss,
            redis_mb=redis_mb,
        )
    finally:
        for s in serves:
            s.stop()
        store.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="redis,cluster")
    ap.add_argument("--deployments", default="100,1000")
    ap.add_argument("--instances", default="1,2")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--serve-args", default="")
    args = ap.parse_args(argv)
    print(
        f"{'kind':8} {'deps':>6} {'inst':>4} {'create s':>9} {'instance % of a core (each)':>30} {'redis %':>8} "
        f"{'RSS MB (each)':>16} {'redis MB':>9}"
    )
    for kind in args.kinds.split(","):
        for deployments in (int(x) for x in args.deployments.split(",")):
            for instances in (int(x) for x in args.instances.split(",")):
                runs = []
                for _ in range(args.repeats):
                    with tempfile.TemporaryDirectory() as tmp:
                        runs.append(_measure(kind, deployments, instances, args, Path(tmp)))
                each = [statistics.median(r["instance_core_percent"][i] for r in runs) for i in range(instances)]
                red = statistics.median(r["redis_core_percent"] for r in runs)
                cre = statistics.median(r["create_s"] for r in runs)
                shown = " ".join(f"{x:.1f}" for x in each)
                rss = " ".join(f"{statistics.median(r['rss_mb'][i] for r in runs):.0f}" for i in range(instances))
                mem = statistics.median(r["redis_mb"] for r in runs)
                print(
                    f"{kind:8} {deployments:>6} {instances:>4} {cre:>9.1f} {shown:>30} {red:>8.1f} {rss:>16} {mem:>9.1f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
