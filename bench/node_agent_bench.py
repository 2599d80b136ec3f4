"""Reports one v3-decode-144 deployment sends per second, with and without node agents.

    python -m eplb_bench.node_agent_bench [--seconds 10] [--interval 1] [--step-every 0.1] [--modes ranks,nodes]

A deployment of DeepSeek-V3 decode shape (58 layers x 256 experts, 288 slots on 144 ranks in 18
nodes) on an ``eplb serve`` process (embedded store). Its 144 ranks are ``LoadReporter``
threads of this process, each adding one step's int32 ``[58, 256]`` counts every
``--step-every`` seconds and reporting every ``--interval``: ``ranks`` on their own, ``nodes``
through 18 ``NodeAgent``s (one per node of 8 ranks, also threads here; ``eplb agent`` in
production). Prints the reports the service received per second (ReportLoad messages: a rank's
own, or a node report), the ranks' reports they carried per second, the service's CPU per
second, and whether the window holds every count the ranks added (it must, in both modes).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np

import eplb
from eplb_engine.agent import NodeAgent
from eplb_engine.reporter import LoadReporter
from eplb_tools.ports import free_port
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

from .harness.processes import serve_argv

TOPO = eplb.Topology(num_layers=58, num_experts=256, num_slots=288, num_gpus=144, num_nodes=18, num_groups=8)
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _run(mode: str, args: argparse.Namespace, workdir: str) -> dict:
    port = free_port()
    serve = subprocess.Popen(
        serve_argv(port, "", "nab", *shlex.split(args.serve_args)), stdout=subprocess.PIPE, text=True
    )
    try:
        assert "listening on" in serve.stdout.readline()
        address = f"127.0.0.1:{port}"
        name = f"v3-{mode}"
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
            from eplb_engine import wire

            stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=wire.deployment_pb(name, TOPO)))
        per_node = TOPO.num_gpus // TOPO.num_nodes
        agents = []
        if mode == "nodes":
            agents = [
                NodeAgent(os.path.join(workdir, f"node{n}.sock"), address, interval_s=args.interval).start()
                for n in range(TOPO.num_nodes)
            ]
        reporters = [
            LoadReporter(
                address,
                name,
                rank=r,
                topology=TOPO,
                interval_s=args.interval,
                node_agent=agents[r // per_node].socket_path if agents else None,
                max_pending=4096,
            )
            for r in range(TOPO.num_gpus)
        ]
        rng = np.random.default_rng(0)
        step_counts = rng.integers(0, 8, size=(TOPO.num_layers, TOPO.num_experts), dtype=np.int32)
        time.sleep(args.interval)  # connected to the agents
        cpu0, t0 = _cpu_s(serve.pid), time.monotonic()
        steps = 0
        while time.monotonic() - t0 < args.seconds:
            for rep in reporters:
                rep.add(step_counts)
            steps += 1
            time.sleep(max(0.0, t0 + steps * args.step_every - time.monotonic()))
        flushed = all(rep.flush(60) for rep in reporters)
        elapsed = time.monotonic() - t0
        cpu = _cpu_s(serve.pid) - cpu0
        stats = [rep.stats() for rep in reporters]
        for rep in reporters:
            rep.close()
        messages = sum(a.stats["node_reports"] for a in agents) if agents else sum(s.sent for s in stats)
        for a in agents:
            a.close()
        with grpc.insecure_channel(address) as ch:
            dry = pb_grpc.ExpertLoadBalancerServiceStub(ch).Rebalance(
                pb.RebalanceRequest(deployment=name, dry_run=True), timeout=60
            )
        expected = steps * TOPO.num_gpus * float(step_counts.sum())
        return dict(
            mode=mode,
            messages_per_s=messages / elapsed,
            rank_reports_per_s=sum(s.sent for s in stats) / elapsed,
            service_cpu_per_s=cpu / elapsed,
            exact=flushed and dry.window_tokens == expected,
        )
    finally:
        serve.terminate()
        serve.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=1.0, help="the reporters' and agents' interval (default 1 s)")
    ap.add_argument("--step-every", type=float, default=0.1, help="a step's counts added this often (default 0.1 s)")
    ap.add_argument("--modes", default="ranks,nodes")
    ap.add_argument("--serve-args", default="")
    args = ap.parse_args(argv)
    print(f"{'mode':6} {'reports/s received':>19} {'rank reports/s':>15} {'service cores':>14} {'every count':>12}")
    for mode in args.modes.split(","):
        if mode not in ("ranks", "nodes"):
            ap.error(f"--modes: ranks or nodes, got {mode!r}")
        with tempfile.TemporaryDirectory() as tmp:
            r = _run(mode, args, tmp)
        print(
            f"{mode:6} {r['messages_per_s']:>19.1f} {r['rank_reports_per_s']:>15.1f} "
            f"{r['service_cpu_per_s']:>14.3f} {'yes' if r['exact'] else 'NO':>12}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
