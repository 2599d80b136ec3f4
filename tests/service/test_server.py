"""Server surface: health, reflection, metrics, ComputePlacement, CLI and graceful SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from svc_helpers import REDIS_URL, free_port, small_deployment

import eplb
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service.server import SERVICE_NAME
from eplb_wire import arrays
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]


async def test_health_reflection_and_metrics(serve, connect, prefix):
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix(), metrics_port=0, token="t")
    c = connect(server, token="t")
    status = await health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert status.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token

    refl = reflection_pb2_grpc.ServerReflectionStub(c.channel)
    replies = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name async for r in replies for s in r.list_services_response.service}
    assert {"eplb.v1.ExpertLoadBalancerService", "grpc.health.v1.Health"} <= names

    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()), metadata=c.metadata)
    await AsyncServiceClient.over(c.channel, token="t").report(reports("d1", 0, [np.ones((4, 16), np.int32)] * 3))
    await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True), metadata=c.metadata)
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read().decode()
    )
    assert 'eplb_reports_total{deployment="d1",outcome="accepted"} 3.0' in text
    assert 'eplb_rebalances_total{deployment="d1",outcome="published",policy="auto"} 1.0' in text
    assert 'eplb_placement_version{deployment="d1"} 2.0' in text
    assert "eplb_rebalance_seconds_bucket" in text


async def test_compute_placement_matches_the_core(serve, connect):
    server = await serve()
    c = connect(server)
    topo = eplb.Topology(4, 16, 24, 8, 2, 4)
    loads = np.random.default_rng(3).lognormal(0, 1, (4, 16))
    out = await c.stub.ComputePlacement(
        pb.ComputePlacementRequest(topology=small_deployment().topology, policy="global", loads=arrays.encode(loads))
    )
    plan = eplb.rebalance(loads, topo, "global")
    assert np.array_equal(arrays.decode(out.phy2log, "phy2log", (4, 24)), plan.phy2log)
    assert np.array_equal(arrays.decode(out.logcnt, "logcnt", (4, 16)), plan.logcnt)
    assert out.stats.imbalance_after == pytest.approx(plan.mean_imbalance)
    assert out.stats.policy_used == "global" and out.stats.moves == 0


async def test_compute_placement_keeps_previous_within_the_migration_bounds(serve, connect):
    server = await serve()
    c = connect(server)
    topo = eplb.Topology(4, 16, 24, 8, 2, 4)
    loads = np.random.default_rng(5).lognormal(0, 1, (4, 16))
    previous = arrays.encode(eplb.Placement.contiguous(topo).phy2log)

    async def plan(**bounds: float) -> pb.ComputePlacementResponse:
        return await c.stub.ComputePlacement(
            pb.ComputePlacementRequest(
                topology=small_deployment().topology,
                policy="global",
                loads=arrays.encode(loads),
                previous_phy2log=previous,
                migration=pb.Migration(**bounds),
            )
        )

    async def moves(**bounds: float) -> int:
        return (await plan(**bounds)).stats.moves

    # Loose bounds keep the current placement; tight ones must move slots to match a fresh plan.
    assert await moves(tolerance=10.0, layer_tolerance=10.0) == 0
    tight = eplb.rebalance(
        loads, topo, "global", previous=eplb.Placement.contiguous(topo), tolerance=0.0, layer_tolerance=0.0
    )
    assert await moves(tolerance=0.0, layer_tolerance=0.0) == tight.total_moves > 0
    # A move budget is a hard limit: the re-plan stays within it and says the budget held it back.
    budget = tight.total_moves // 2
    held = await plan(tolerance=0.0, layer_tolerance=0.0, max_moves=budget)
    assert 0 < held.stats.moves <= budget
    assert held.stats.imbalance_after > tight.mean_imbalance
    assert any(n.startswith(f"move budget (max_moves={budget}") for n in held.stats.notes)
    assert held.stats.budget_limited and not (await plan(tolerance=0.0, layer_tolerance=0.0)).stats.budget_limited
    per_layer = await plan(tolerance=0.0, layer_tolerance=0.0, max_layer_moves=1)
    assert (
        eplb.moves(
            eplb.Placement.contiguous(topo), eplb.Placement(arrays.decode(per_layer.phy2log, "phy2log", (4, 24)), topo)
        )
        <= 1
    ).all()


async def test_deployment_migration_bounds_reach_the_planner(serve, connect):
    server = await serve()
    c = connect(server)
    loose = small_deployment("loose")
    loose.migration.CopyFrom(pb.Migration(tolerance=10.0, layer_tolerance=10.0))
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=loose))
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment("strict")))
    budget = small_deployment("budget")
    budget.migration.CopyFrom(pb.Migration(max_moves=2))
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=budget))
    got = (await c.stub.GetDeployment(pb.GetDeploymentRequest(name="strict"))).deployment
    # Unset bounds are stored as the library's defaults, so a deployment shows what it uses;
    # move budgets default to no limit and stay unset.
    assert (got.migration.tolerance, got.migration.layer_tolerance) == (0.01, 0.05)
    assert not got.migration.HasField("max_moves") and not got.migration.HasField("max_layer_moves")
    got = (await c.stub.GetDeployment(pb.GetDeploymentRequest(name="budget"))).deployment
    assert got.migration.max_moves == 2 and got.migration.tolerance == 0.01
    skewed = (np.random.default_rng(7).lognormal(0, 1.5, (4, 16)) * 100).astype(np.int32)
    out = {}
    for name in ("loose", "strict", "budget"):
        # An ack of version 1 says the engines loaded it: re-plans keep it within the bounds
        # (without one, the first plan from the made-up contiguous version 1 is a fresh plan).
        await AsyncServiceClient.over(c.channel).ack(name, 0, 1)
        await AsyncServiceClient.over(c.channel).report(reports(name, 0, [skewed] * 3))
        out[name] = await c.stub.Rebalance(pb.RebalanceRequest(deployment=name, force=True))
    assert out["loose"].placement.stats.moves == 0
    assert out["strict"].placement.stats.moves > 0
    assert out["strict"].placement.stats.imbalance_after < out["loose"].placement.stats.imbalance_after
    assert 0 < out["budget"].placement.stats.moves <= 2 < out["strict"].placement.stats.moves


@pytest.mark.parametrize("policy", ["auto", "deepseek"])
async def test_the_trigger_move_budget_is_planned_within_or_refused(serve, connect, policy):
    server = await serve()
    c = connect(server)
    d = small_deployment("gated", max_moves=3)
    d.policy = policy
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    skewed = (np.random.default_rng(7).lognormal(0, 1.5, (4, 16)) * 100).astype(np.int32)
    await AsyncServiceClient.over(c.channel).ack("gated", 0, 1)  # the engines run version 1: moves cost
    await AsyncServiceClient.over(c.channel).report(reports("gated", 0, [skewed] * 3))
    out = await c.stub.Rebalance(pb.RebalanceRequest(deployment="gated"))
    if policy == "auto":
        # Planned within the budget: published, with the budget named in the notes.
        assert out.published and 0 < out.placement.stats.moves <= 3 and out.placement.stats.budget_limited
        assert any(n.startswith("move budget (max_moves=3") for n in out.placement.stats.notes)
        assert server.metrics.budget_limited.labels("gated")._value.get() == 1
    else:
        # eplb.py re-plans from scratch: the gate refuses what goes over.
        assert not out.published and out.placement.stats.moves > 3
        assert "over the move budget max_moves 3" in out.reason
    forced = await c.stub.Rebalance(pb.RebalanceRequest(deployment="gated", force=True))
    got = (await c.stub.GetDeployment(pb.GetDeploymentRequest(name="gated"))).deployment
    # One budget: the deprecated Trigger.max_moves became Migration.max_moves, and stays readable.
    assert (got.trigger.max_moves, got.migration.max_moves) == (3, 3)
    if policy == "auto":
        # Every re-plan stays within it, forced or not.
        assert forced.published and 0 < forced.placement.stats.moves <= 3
    else:
        # A from-scratch policy has no budget to plan within: force skips the gate.
        assert forced.published and forced.placement.stats.moves > 3


async def test_decay_window_deployment(serve, connect):
    server = await serve()
    c = connect(server)
    d = small_deployment()
    d.window.decay.half_life.FromMilliseconds(200)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    await AsyncServiceClient.over(c.channel).report(reports("d1", 0, [np.full((4, 16), 100, np.int32)]))
    first = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    await asyncio.sleep(0.4)
    later = await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", dry_run=True))
    # Two half-lives later a quarter is left (give or take the time between the two calls).
    assert 0.15 < later.window_tokens / first.window_tokens < 0.3


def test_sigterm_shuts_down_gracefully(tmp_path):
    port = free_port()
    env = dict(os.environ, EPLB_PORT=str(port), EPLB_HOST="127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eplb_tools.cli", "serve", "--log-level", "WARNING"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert f"listening on 127.0.0.1:{port}" in line
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        assert proc.wait(15) == 0
        assert time.monotonic() - start < 10
    finally:
        if proc.poll() is None:
            proc.kill()


def test_generated_code_is_up_to_date():
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gen_proto.sh"), "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr


async def test_tls(serve, connect, tmp_path):
    if subprocess.run(["which", "openssl"], capture_output=True).returncode:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    server = await serve(tls_cert=cert, tls_key=key)
    c = connect(server, root_certificates=cert.read_bytes())
    out = await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    assert out.placement.version == 1
    plain = connect(server)
    with pytest.raises(grpc.aio.AioRpcError):
        await plain.stub.ListDeployments(pb.ListDeploymentsRequest(), timeout=2)
