"""What the node agent's tests share (their fixtures ``d1_server`` and ``sock_path`` are in
conftest.py): the deployment, the window as a dry run reads it, and ``eplb agent`` as a process
of its own."""

from __future__ import annotations

import subprocess
import sys

import grpc

import eplb
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

TOPO = eplb.Topology(num_layers=2, num_experts=32, num_slots=48, num_gpus=8, num_nodes=1, num_groups=1)


def window(address: str, deployment: str = "d1") -> tuple[int, float]:
    """The deployment's window reports and tokens, as a dry-run Rebalance reads them."""
    with grpc.insecure_channel(address) as ch:
        dry = pb_grpc.ExpertLoadBalancerServiceStub(ch).Rebalance(
            pb.RebalanceRequest(deployment=deployment, dry_run=True)
        )
    return dry.window_reports, dry.window_tokens


def agent_process(sock_path: str, address: str, interval_s: float = 0.3) -> subprocess.Popen:
    """``eplb agent`` on ``sock_path`` for the service at ``address``, once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "eplb_tools.cli", "agent", "--socket", sock_path, "--address", address]
        + ["--interval-seconds", str(interval_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert "listening on" in proc.stdout.readline()
    return proc
