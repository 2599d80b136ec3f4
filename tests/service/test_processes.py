"""``eplb serve --processes N``: N serving processes on one port (SO_REUSEPORT) under a supervisor.

Real processes, real connections, the real Redis: reports over many connections reach every
process; one killed mid-stream is started again and nothing it acknowledged is lost; SIGTERM
drains them all; a killed supervisor leaves no process serving the port.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import grpc
import numpy as np
import pytest
import redis
from svc_helpers import REDIS_URL, small_deployment

from eplb_bench.harness.processes import serve_argv
from eplb_bench.harness.service import aio_channel, reports
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

L, E = 4, 16


def start(prefix: str, processes: int = 2) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        serve_argv(
            0, REDIS_URL, prefix, "--processes", str(processes), "--flush-seconds", "0.2", "--grace-seconds", "1"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert "listening on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.rsplit(" ", 1)[1].strip()


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return sorted(out)


async def send(target: str, rank: int, n: int, seq0: int = 0) -> int:
    """``n`` reports of rank ``rank`` (``rank + 1`` tokens an expert) on a connection of its own;
    the reports acknowledged (accepted or duplicates), retrying a broken stream with the same seqs."""
    counts = np.full((L, E), rank + 1, dtype=np.int32)
    batch = reports("d1", rank, [counts] * n)
    for i, msg in enumerate(batch):
        msg.seq = seq0 + i + 1
    deadline = time.monotonic() + 30
    while True:
        channel = own_channel(target)
        try:
            resp = await pb_grpc.ExpertLoadBalancerServiceStub(channel).ReportLoad(iter(batch), timeout=10)
            return resp.accepted + resp.duplicates
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
        finally:
            await channel.close()


def own_channel(target: str) -> grpc.aio.Channel:
    """A channel with a connection of its own, as an engine on another host has (channels of one
    process otherwise share one connection per target: gRPC's global subchannel pool)."""
    return grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


async def totals(target: str) -> tuple[int, float]:
    channel = aio_channel(target)
    try:
        dry = await pb_grpc.ExpertLoadBalancerServiceStub(channel).Rebalance(
            pb.RebalanceRequest(deployment="d1", dry_run=True)
        )
        return dry.window_reports, dry.window_tokens
    finally:
        await channel.close()


async def create(target: str, ranks: int = 8) -> None:
    channel = aio_channel(target)
    deployment = small_deployment()
    deployment.ranks.extend(range(ranks))
    try:
        await pb_grpc.ExpertLoadBalancerServiceStub(channel).CreateDeployment(
            pb.CreateDeploymentRequest(deployment=deployment)
        )
    finally:
        await channel.close()


async def test_connections_spread_over_the_processes_and_every_report_counts(prefix):
    p = prefix()
    proc, target = start(p, processes=2)
    try:
        assert len(children(proc.pid)) == 2
        await create(target, ranks=16)
        acked = await asyncio.gather(*(send(target, r, 10) for r in range(16)))  # a connection each
        assert acked == [10] * 16
        # Each process keeps a window of its own in Redis (one field a process): both took reports.
        deadline = time.monotonic() + 10
        r = redis.Redis.from_url(REDIS_URL)
        while r.hlen(f"{p}:{{d1}}:windows") < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert r.hlen(f"{p}:{{d1}}:windows") == 2
        assert await totals(target) == (160, sum(10 * (r + 1) * L * E for r in range(16)))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert children(proc.pid) == []


async def test_a_killed_process_is_started_again_and_what_it_acknowledged_stays(prefix):
    p = prefix()
    proc, target = start(p, processes=2)
    try:
        await create(target)
        first = await asyncio.gather(*(send(target, r, 5) for r in range(8)))
        victim = children(proc.pid)[0]
        os.kill(victim, signal.SIGKILL)
        # The others go on serving meanwhile; the same seqs again are duplicates, never counted twice.
        again = await asyncio.gather(*(send(target, r, 5) for r in range(8)))
        port = int(target.rsplit(":", 1)[1])
        deadline = time.monotonic() + 30
        while (len(listening(port)) < 2 or victim in children(proc.pid)) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert (
            listening(port) == set(children(proc.pid)) and len(listening(port)) == 2 and victim not in listening(port)
        )
        more = await asyncio.gather(*(send(target, r, 5, seq0=100) for r in range(8)))
        assert first == again == more == [5] * 8
        assert await totals(target) == (80, sum(10 * (k + 1) * L * E for k in range(8)))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_a_killed_supervisor_leaves_no_process_serving():
    proc, _ = start(f"eplb-test-sup-{os.getpid()}", processes=2)
    kids = children(proc.pid)
    assert len(kids) == 2
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/proc/{k}") and _alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids)


def listening(port: int) -> set[int]:
    """The pids with a socket listening on ``port`` (/proc/net/tcp*, then each process's fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    pids = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = {os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")}
        except OSError:
            continue
        if links & inodes:
            pids.add(int(entry))
    return pids


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--processes", "2"], "--processes above 1 needs --redis-url"),
        (["--processes", "0"], "--processes: must be a number of processes 1-256"),
    ],
)
def test_processes_are_checked(flags, message):
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "eplb_tools.cli", "serve", *flags], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_sigterm_during_the_restart_backoff_stops_the_instance(prefix):
    proc, _ = start(prefix(), processes=2)
    os.kill(children(proc.pid)[0], signal.SIGKILL)
    time.sleep(0.5)  # the supervisor waits a second before it starts the process again
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    assert children(proc.pid) == []


def test_a_process_killed_again_while_restarting_is_started_again(prefix):
    proc, target = start(prefix(), processes=2)
    try:
        first = children(proc.pid)
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not (new := [k for k in children(proc.pid) if k not in first]) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(new[0], signal.SIGKILL)  # before it listens (the OOM killer, an operator)
        port = int(target.rsplit(":", 1)[1])
        deadline = time.monotonic() + 30
        while len(listening(port)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None and len(listening(port)) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_sighup_without_an_auth_file_stops_the_instance_gracefully(prefix):
    proc, _ = start(prefix(), processes=2)
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(30) == 0
    assert children(proc.pid) == []


def test_the_metrics_ports_of_the_processes_are_checked_first():
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "eplb_tools.cli", "serve", "--redis-url", REDIS_URL, "--processes", "2"]
        + ["--metrics-port", "65535"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "the port must be at most 65534" in out.stderr, out.stderr
