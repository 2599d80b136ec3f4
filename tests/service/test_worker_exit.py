"""Planning workers and what they start (layer workers, their forkserver) end with the server:
on SIGTERM the server kills them; on SIGKILL they exit once the server's pipe closes."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from svc_helpers import REDIS_URL

from eplb_bench.harness.processes import ServeProcess
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc
from eplb_wire.arrays import encode


def _descendants(root: int) -> set[int]:
    """Every live process below ``root``, from /proc (parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        pid, ppid = int(text.split(" ", 1)[0]), int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pids: set[int]) -> set[int]:
    return {p for p in pids if Path(f"/proc/{p}").exists() and "(Z)" not in _state(p)}


def _state(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "(Z)"
    return f"({text.rsplit(')', 1)[1].split()[0]})"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_layer_workers_end_with_the_server(sig, prefix, tmp_path):
    server = ServeProcess(REDIS_URL, prefix(), tmp_path / "serve.log", ("--layer-workers", "2", "--grace-seconds", "1"))
    server.start()
    try:
        server.wait_listening()
        with grpc.insecure_channel(server.target) as ch:
            stub = pb_grpc.ExpertLoadBalancerServiceStub(ch)
            topo = pb.Topology(num_layers=40, num_experts=16, num_slots=24, num_gpus=8, num_nodes=2, num_groups=4)
            stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=pb.Deployment(name="w", topology=topo)))
            counts = (np.random.default_rng(1).lognormal(0, 1.5, (40, 16)) * 100).astype(np.int32)
            stub.ReportLoad(iter([pb.ReportLoadRequest(deployment="w", rank=0, seq=1, logical=encode(counts))]))
            time.sleep(0.5)
            assert stub.Rebalance(pb.RebalanceRequest(deployment="w", force=True), timeout=60).published
        # The planning worker, and below it the forkserver and layer workers the re-plan started.
        started = _descendants(server.proc.pid)
        assert len(started) >= 3, started
        server.signal(sig)
        server.proc.wait(30)
        deadline = time.monotonic() + 10
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(started), {p: Path(f"/proc/{p}/cmdline").read_bytes()[:120] for p in _alive(started)}
        if sig == signal.SIGTERM:
            # The idle planning worker left by itself and shut its layer pools down: no
            # "resource_tracker: There appear to be N leaked semaphore objects" at exit.
            assert "leaked semaphore" not in (tmp_path / "serve.log").read_text()
    finally:
        if server.running:
            server.proc.kill()
