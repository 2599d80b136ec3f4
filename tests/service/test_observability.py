"""Metrics scraped from /metrics, JSON log lines from ``eplb serve``, audit lines, CLI defaults."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_helpers import FAST, REDIS_URL, free_port, small_deployment

from eplb_bench.harness.service import aio_channel, reports
from eplb_engine.aio import AsyncServiceClient
from eplb_engine.client import auth_metadata
from eplb_service.cli import parse_args
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire._gen.eplb.v1 import balancer_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


async def _scrape(port: int) -> dict[str, float]:
    """``/metrics`` as {series with labels: value}."""
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    )
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


async def test_metrics_count_calls_by_method_and_code_and_time_the_store(serve, connect, prefix):
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix(), metrics_port=0, token="t")
    c = connect(server, token="t")
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()), metadata=c.metadata)
    await AsyncServiceClient.over(c.channel, token="t").report(reports("d1", 0, [np.ones((4, 16), np.int32)] * 3))
    for _ in range(3):
        await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="d1"), metadata=c.metadata)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.GetPlacement(pb.GetPlacementRequest(deployment="nope"), metadata=c.metadata)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError):
        await c.stub.CreateDeployment(
            pb.CreateDeploymentRequest(deployment=pb.Deployment(name="bad name!")), metadata=c.metadata
        )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.ListDeployments(pb.ListDeploymentsRequest(), metadata=auth_metadata("wrong"))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(service=""))
    with pytest.raises(grpc.aio.AioRpcError):
        await health_pb2_grpc.HealthStub(c.channel).Check(health_pb2.HealthCheckRequest(service="no.such.Service"))

    m = await _scrape(server.metrics_port)
    svc = "ExpertLoadBalancerService"
    assert m[f'eplb_rpc_requests_total{{code="OK",method="{svc}/GetPlacement"}}'] == 3
    assert m[f'eplb_rpc_requests_total{{code="NOT_FOUND",method="{svc}/GetPlacement"}}'] == 1
    assert m[f'eplb_rpc_requests_total{{code="INVALID_ARGUMENT",method="{svc}/CreateDeployment"}}'] == 1
    assert m[f'eplb_rpc_requests_total{{code="OK",method="{svc}/CreateDeployment"}}'] == 1
    assert m[f'eplb_rpc_requests_total{{code="OK",method="{svc}/ReportLoad"}}'] == 1
    assert m[f'eplb_rpc_requests_total{{code="UNAUTHENTICATED",method="{svc}/ListDeployments"}}'] == 1
    assert m['eplb_rpc_requests_total{code="OK",method="Health/Check"}'] == 1
    assert m['eplb_rpc_requests_total{code="NOT_FOUND",method="Health/Check"}'] == 1
    assert m[f'eplb_rpc_latency_seconds_count{{method="{svc}/GetPlacement"}}'] == 4
    assert m[f'eplb_rpc_latency_seconds_bucket{{le="+Inf",method="{svc}/GetPlacement"}}'] == 4
    assert 0 < m[f'eplb_rpc_latency_seconds_sum{{method="{svc}/GetPlacement"}}'] < 4
    assert m["eplb_store_up"] == 1
    assert m['eplb_store_latency_seconds_count{op="accept_many"}'] >= 1
    assert m['eplb_store_latency_seconds_count{op="create"}'] == 1
    # prometheus-client's default collectors: process, platform, GC.
    assert m["process_cpu_seconds_total"] > 0 and m["process_resident_memory_bytes"] > 0
    assert any(k.startswith("python_info{") for k in m) and any(
        k.startswith("python_gc_objects_collected_total") for k in m
    )


async def test_store_up_follows_redis(serve, private_redis, prefix):
    server = await serve(redis_url=private_redis.url, key_prefix=prefix(), metrics_port=0)

    async def up_becomes(value: float) -> None:
        for _ in range(100):
            if (await _scrape(server.metrics_port)).get("eplb_store_up") == value:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"eplb_store_up never became {value}")

    await up_becomes(1)
    private_redis.stop()
    try:
        await up_becomes(0)
        assert (await _scrape(server.metrics_port))['eplb_store_errors_total{op="ping"}'] >= 1
    finally:
        private_redis.start()
    await up_becomes(1)


def _serve(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "eplb_tools.cli", "serve", *args],
        cwd=ROOT,
        env=dict(os.environ, **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _json_lines(stderr: str) -> list[dict]:
    lines = [line for line in stderr.splitlines() if line.strip()]
    # Every line is one JSON object: no plain-text or multi-line tracebacks in between.
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_json_logs_audit_lines_and_no_tracebacks(tmp_path, prefix):
    port = free_port()
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    proc = _serve(
        [
            "--port",
            str(port),
            "--redis-url",
            REDIS_URL,
            "--key-prefix",
            prefix(),
            "--log-format",
            "json",
            "--token-file",
            str(token_file),
            "--grace-seconds",
            "1",
        ]
    )
    try:
        assert "listening on 127.0.0.1" in proc.stdout.readline()

        async def calls() -> None:
            async with aio_channel(f"127.0.0.1:{port}") as chan:
                stub = pb_grpc.ExpertLoadBalancerServiceStub(chan)
                md = auth_metadata("s3cret")
                await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()), metadata=md)
                with pytest.raises(grpc.aio.AioRpcError):  # expected errors: logged without traceback
                    await stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()), metadata=md)
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.ReportLoad(iter([pb.ReportLoadRequest(deployment="d1", rank=0, seq=1)]), metadata=md)
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.GetPlacement(pb.GetPlacementRequest(deployment="missing"), metadata=md)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="d1"), metadata=auth_metadata("guess"))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await stub.DeleteDeployment(pb.DeleteDeploymentRequest(name="d1"), metadata=md)

        asyncio.run(calls())
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    records = _json_lines(stderr)
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert not any("Traceback" in json.dumps(r) for r in records), records
    assert any(r["level"] == "WARNING" and "TLS is off" in r["msg"] for r in records)
    assert "s3cret" not in stderr
    audits = [r for r in records if "audit" in r]
    assert [(r["audit"], r["deployment"], r["code"]) for r in audits if r["audit"] != "auth_failure"] == [
        ("CreateDeployment", "d1", "OK"),
        ("CreateDeployment", "d1", "ALREADY_EXISTS"),
        ("DeleteDeployment", "d1", "OK"),
    ]
    denied = [r for r in audits if r["audit"] == "auth_failure"]
    assert (
        len(denied) == 1 and denied[0]["method"].endswith("/DeleteDeployment") and denied[0]["peer"].startswith("ipv4:")
    )
    assert any(r["msg"] == "stopped" for r in records)


@pytest.mark.slow
def test_an_unreachable_redis_at_start_is_a_warning(tmp_path):
    port = free_port()
    proc = _serve(
        [
            "--port",
            str(port),
            "--redis-url",
            f"redis://127.0.0.1:{free_port()}/0",
            "--log-format",
            "json",
            "--grace-seconds",
            "0",
        ]
    )
    try:
        assert "listening on" in proc.stdout.readline()

        async def check() -> int:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as chan:
                reply = await health_pb2_grpc.HealthStub(chan).Check(health_pb2.HealthCheckRequest(service=""))
                return reply.status

        assert asyncio.run(check()) == health_pb2.HealthCheckResponse.NOT_SERVING
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    records = _json_lines(stderr)
    assert any(r["level"] == "WARNING" and r["msg"].startswith("store unreachable at start") for r in records)
    assert not any("Traceback" in json.dumps(r) for r in records), records


def test_plain_logs_stay_the_default():
    assert parse_args([])[2] == "plain"
    assert re.match(r"\d{4}-\d\d-\d\d", "2026-12-01")  # the plain format starts with asctime


def test_serve_binds_loopback_unless_told(monkeypatch):
    monkeypatch.delenv("EPLB_HOST", raising=False)
    assert parse_args([])[0].host == "127.0.0.1"
    assert parse_args(["--host", "0.0.0.0"])[0].host == "0.0.0.0"
    monkeypatch.setenv("EPLB_HOST", "::")
    assert parse_args([])[0].host == "::"


def test_the_token_comes_from_a_file_the_environment_or_the_flag(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("EPLB_TOKEN", raising=False)
    monkeypatch.delenv("EPLB_TOKEN_FILE", raising=False)
    assert parse_args([])[0].token is None
    monkeypatch.setenv("EPLB_TOKEN", "from-env")
    assert parse_args([])[0].token == "from-env"
    assert parse_args(["--token", "from-flag"])[0].token == "from-flag"
    path = tmp_path / "token"
    path.write_text("  from-file\n")
    assert parse_args(["--token-file", str(path)])[0].token == "from-file"
    monkeypatch.setenv("EPLB_TOKEN_FILE", str(path))
    assert parse_args([])[0].token == "from-file"
    monkeypatch.delenv("EPLB_TOKEN_FILE")
    for bad, says in [
        (["--token-file", str(tmp_path / "missing")], "cannot read it"),
        (["--token", "x", "--token-file", str(path)], "not both"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            parse_args(bad)
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    path.write_text("two words\n")
    with pytest.raises(SystemExit):
        parse_args(["--token-file", str(path)])
    assert "one token" in capsys.readouterr().err


async def test_an_expected_error_is_logged_once_at_debug_without_traceback(serve, connect, prefix, caplog):
    server = await serve(redis_url=REDIS_URL, key_prefix=prefix(), balancer=replace(FAST, lease_s=0.3))
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    # Another instance holds the planning lease for longer than this call may wait (its deadline).
    assert await server.store.acquire_lease("d1", "another-replica", 30)
    with caplog.at_level(logging.DEBUG, logger="eplb_service"), pytest.raises(grpc.aio.AioRpcError) as err:
        await c.stub.Rebalance(pb.RebalanceRequest(deployment="d1", force=True), timeout=1.5)
    assert err.value.code() == grpc.StatusCode.ABORTED
    mine = [r for r in caplog.records if r.name == "eplb_service.errors"]
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in mine] == [
        (logging.DEBUG, "ExpertLoadBalancerService/Rebalance failed")
    ]
    assert "ABORTED" in mine[0].getMessage() and "another instance" in mine[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)


async def test_a_watch_the_client_cancels_is_counted_as_cancelled_and_leaves_the_gauge(serve, connect):
    server = await serve()
    c = connect(server)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=small_deployment()))
    call = c.stub.WatchPlacements(pb.WatchPlacementsRequest(deployment="d1"))
    assert (await call.read()).placement.version == 1
    assert server.metrics.watchers.labels("d1")._value.get() == 1
    call.cancel()
    method = "ExpertLoadBalancerService/WatchPlacements"
    for _ in range(100):
        if server.metrics.rpc_requests.labels(method, "CANCELLED")._value.get() == 1:
            break
        await asyncio.sleep(0.02)
    assert server.metrics.rpc_requests.labels(method, "CANCELLED")._value.get() == 1
    assert server.metrics.watchers.labels("d1")._value.get() == 0
