"""The fleet's paths at a 2-core scale: two ``eplb serve`` instances (one of two serving
processes) on a 3-master Redis Cluster, 200 deployments, their ranks reporting through node
agents for a few seconds; every report a rank was told was counted is in its window once."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

import grpc
import numpy as np

import eplb
from eplb_bench.harness.processes import serve_argv
from eplb_engine import wire
from eplb_engine.agent import NodeAgent
from eplb_engine.reporter import LoadReporter
from eplb_tools.ports import free_port
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

DEPLOYMENTS = 200
RANKS = 2  # per deployment
HOSTS = 4  # node agents, each the host of the ranks of 50 deployments
TOPO = eplb.Topology(num_layers=2, num_experts=16, num_slots=16, num_gpus=RANKS, num_nodes=1, num_groups=1)


def test_two_instances_200_deployments_node_agents_every_acknowledged_report_counted(redis_cluster, prefix):
    p = prefix()
    ports = [free_port(), free_port()]
    serves = [
        subprocess.Popen(
            serve_argv(port, redis_cluster.url, p, "--flush-seconds", "0.5", *extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for port, extra in zip(ports, (["--processes", "2"], []), strict=True)
    ]
    addresses = [f"127.0.0.1:{port}" for port in ports]
    reporters: list[LoadReporter] = []
    agents: list[NodeAgent] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for s in serves:
                assert "listening on" in s.stdout.readline()
            with grpc.insecure_channel(addresses[0]) as ch:
                stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
                for d in range(DEPLOYMENTS):
                    stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=wire.deployment_pb(f"f{d}", TOPO)))
            # Each host's agent starts on one instance (half on each), failing over to the other.
            agents = [
                NodeAgent(
                    os.path.join(tmp, f"h{h}.sock"), addresses[h % 2 :] + addresses[: h % 2], interval_s=0.3
                ).start()
                for h in range(HOSTS)
            ]
            for d in range(DEPLOYMENTS):
                for r in range(RANKS):
                    host = d % HOSTS  # a deployment's ranks on one host, as on a node
                    reporters.append(
                        LoadReporter(
                            addresses[host % 2],
                            f"f{d}",
                            rank=r,
                            topology=TOPO,
                            interval_s=0.2,
                            node_agent=agents[host].socket_path,
                        )
                    )
            time.sleep(0.5)
            steps = 0
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3.0:
                for k, rep in enumerate(reporters):
                    assert rep.add(np.full((2, 16), 1 + k % 3, dtype=np.int32))
                steps += 1
                time.sleep(0.2)
            assert all(rep.flush(60) for rep in reporters)
            stats = [rep.stats() for rep in reporters]
            node_reports = sum(a.stats["node_reports"] for a in agents)
            with grpc.insecure_channel(addresses[1]) as ch:
                stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
                windows = [
                    stub.Rebalance(pb.RebalanceRequest(deployment=f"f{d}", dry_run=True), timeout=30)
                    for d in range(DEPLOYMENTS)
                ]
        finally:
            for rep in reporters:
                rep.close(timeout_s=1)
            for a in agents:
                a.close()
            for s in serves:
                s.terminate()
            for s in serves:
                assert s.wait(30) == 0
    assert all(s.dropped_reports == 0 and s.rejected == 0 for s in stats)
    acknowledged = sum(s.accepted for s in stats)
    assert sum(w.window_reports for w in windows) == acknowledged
    for d, w in enumerate(windows):
        want = sum(steps * (1 + k % 3) * 2 * 16 for k in range(d * RANKS, (d + 1) * RANKS))
        assert w.window_tokens == want, (d, w.window_tokens, want)
    # Through the agents: a node report carries both ranks' reports of an interval (or more).
    assert sum(s.via_agent for s in stats) == acknowledged and node_reports * RANKS <= acknowledged
