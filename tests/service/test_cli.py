"""``eplb serve`` as a user runs it: a real process, its exit status, stdout and stderr."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from svc_helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPLB_")}
    return env | extra


def run_serve(*args: str, **env: str) -> subprocess.CompletedProcess:
    """``eplb serve args`` that is expected to exit by itself (a start-up error)."""
    return subprocess.run(
        [sys.executable, "-m", "eplb_tools.cli", "serve", *args],
        cwd=ROOT,
        env=_env(**env),
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )


@contextmanager
def serving(*args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A running ``eplb serve args`` and the first line it wrote to stdout; SIGTERM at exit, after
    which ``proc.stderr_text`` holds what it wrote to stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "eplb_tools.cli", "serve", *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc, proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stderr_text = proc.stderr.read()
            proc.stdout.close()
            proc.stderr.close()


def assert_one_line_error(out: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit 2, nothing on stdout, one line on stderr holding every fragment, no traceback."""
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("eplb serve: error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def health_status(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_a_second_server_on_a_taken_port_fails_and_the_first_keeps_serving():
    port = free_port()
    with serving("--port", str(port)) as (first, line):
        assert f"listening on 127.0.0.1:{port}" in line
        second = run_serve("--port", str(port))
        assert_one_line_error(second, "--port", f"127.0.0.1:{port}", "in use")
        assert first.poll() is None
        assert health_status(port) == health_pb2.HealthCheckResponse.SERVING


def test_a_taken_metrics_port_fails_cleanly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        out = run_serve("--port", "0", "--metrics-port", str(taken.getsockname()[1]))
    # Before the fix: OSError, then "Event loop is closed" and "coroutine ... was never awaited".
    assert_one_line_error(out, "--metrics-port", "in use")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--port", "70000"], ["--port", "0-65535", "'70000'"]),  # used to listen on 70000 - 65536
        (["--port", "-5"], ["--port", "0-65535", "'-5'"]),  # used to listen on 65531
        (["--metrics-port", "65536"], ["--metrics-port", "-1 (off) or a port 0-65535"]),
        (["--grace-seconds", "-1"], ["--grace-seconds", ">= 0", "'-1'"]),
        (["--lease-seconds", "0"], ["--lease-seconds", "> 0", "'0'"]),
        (["--flush-seconds", "0"], ["--flush-seconds", "> 0", "'0'"]),
        (["--flush-seconds", "inf"], ["--flush-seconds", "> 0", "'inf'"]),
        (["--max-message-bytes", "0"], ["--max-message-bytes", "4096-2147483647", "'0'"]),
        (["--layer-workers", "0"], ["--layer-workers", "1-256", "'0'"]),
        (["--plan-workers", "many"], ["--plan-workers", "1-256", "'many'"]),
        (["--compute-workers", "300"], ["--compute-workers", "1-256", "'300'"]),
        (["--log-level", "BOGUS"], ["--log-level", "DEBUG, INFO, WARNING, ERROR, CRITICAL", "'BOGUS'"]),
        (
            ["--redis-url", "http://x"],
            ["--redis-url", "redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://", "'http://x'"],
        ),  # used to be a ValueError traceback
        (
            ["--redis-url", "redis+cluster://127.0.0.1:7000,127.0.0.1"],
            ["--redis-url", "HOST:PORT seed nodes", "'127.0.0.1'"],
        ),
        (["--redis-url", "rediss+cluster://h:7000?ssl_bogus=1"], ["--redis-url", "unknown option 'ssl_bogus'"]),
        (["--redis-url", "redis://127.0.0.1:notaport/0"], ["--redis-url", "port"]),
        (["--host", "10.255.255.1"], ["--host", "10.255.255.1", "Cannot assign requested address"]),
        (
            ["--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"],
            ["--tls-key", "cannot read /nonexistent/key.pem", "No such file"],
        ),
        (["--tls-cert", __file__, "--tls-key", __file__], ["--tls-cert", "not a PEM certificate chain"]),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_and_what_is_allowed(args, fragments):
    assert_one_line_error(run_serve("--port", "0", *args), *fragments)


@pytest.mark.parametrize(
    ("var", "value", "fragments"),
    [
        ("EPLB_PORT", "abc", ["EPLB_PORT", "0-65535", "'abc'"]),  # used to crash while building the parser
        ("EPLB_LOG_FORMAT", "xml", ["EPLB_LOG_FORMAT", "plain, json", "'xml'"]),
        ("EPLB_LEASE_SECONDS", "-3", ["EPLB_LEASE_SECONDS", "> 0"]),
    ],
)
def test_a_bad_variable_is_one_line_naming_it(var, value, fragments):
    assert_one_line_error(run_serve(**{var: value}), *fragments)


def test_an_empty_variable_is_unset(monkeypatch):
    # A compose file's `EPLB_LAYER_WORKERS=` used to exit 2 as a bad number; now it is the default.
    from eplb_service.cli import parse_args

    for var in ("EPLB_PORT", "EPLB_LAYER_WORKERS", "EPLB_LEASE_SECONDS", "EPLB_LOG_LEVEL", "EPLB_METRICS_PORT"):
        monkeypatch.setenv(var, " " if var.endswith("PORT") else "")
    config, level, _ = parse_args([])
    assert (config.port, config.metrics_port, level) == (50051, None, "INFO")
    assert (config.balancer.layer_workers, config.balancer.lease_s) == (1, 10.0)
    monkeypatch.setenv("EPLB_LAYER_WORKERS", "3")
    assert parse_args([])[0].balancer.layer_workers == 3


def test_a_variable_that_fails_at_start_is_named_as_the_variable():
    # An address that does not resolve is found only when binding: it used to say --host.
    out = run_serve("--port", "0", EPLB_HOST="no-such-host.invalid")
    assert_one_line_error(out, "EPLB_HOST", "cannot resolve")
    assert "--host" not in out.stderr
    assert_one_line_error(run_serve("--port", "0", "--host", "no-such-host.invalid"), "--host", "cannot resolve")


def test_a_flag_wins_over_a_bad_variable():
    # Only a value that is used is checked: --port given, EPLB_PORT is not read.
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "eplb_tools.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=_env(EPLB_PORT="abc"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert f"listening on 127.0.0.1:{port}" in proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        proc.stdout.close()


def test_json_log_format_writes_json_to_stdout_too():
    with serving("--port", "0", "--log-format", "json") as (proc, line):
        record = json.loads(line)
        assert record["level"] == "INFO" and record["logger"] == "eplb_service.cli"
        assert record["host"] == "127.0.0.1" and record["port"] > 0
        assert record["msg"] == f"listening on 127.0.0.1:{record['port']}"
        assert health_status(record["port"]) == health_pb2.HealthCheckResponse.SERVING
    # Everything it logged on stderr is JSON as well, the shutdown lines included.
    assert proc.returncode == 0
    records = [json.loads(text) for text in proc.stderr_text.splitlines()]
    assert any(r["msg"] == "stopped" for r in records), proc.stderr_text


def test_an_ipv6_host_serves():
    # "::" used to reach gRPC as ":::50051", a malformed name: docs/service.md offers it for all hosts.
    with serving("--host", "::", "--port", "0") as (_, line):
        assert line.startswith("eplb serve: listening on [::]:"), line
        port = int(line.rsplit(":", 1)[1])
        assert health_status(port) == health_pb2.HealthCheckResponse.SERVING  # via 127.0.0.1, dual stack
