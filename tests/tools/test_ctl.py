"""eplb ctl against a real server on 127.0.0.1 (its own event loop in a thread, so the CLI's sync
calls run in-process: ``main(argv)`` with capsys), and the wire fields it reads."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pytest

import eplb
import eplb_engine.wire as wire
from eplb import formats
from eplb_engine.client import ServiceClient
from eplb_service.balancer import BalancerConfig
from eplb_service.server import RunningServer, ServerConfig, start_server
from eplb_tools import cli, ctl
from eplb_tools import io as eio
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

# As tests/service's FAST: flushes, triggers and refreshes within a fraction of a second.
FAST = BalancerConfig(lease_s=2.0, flush_s=0.1, tick_s=0.1, refresh_s=0.3)
TOPO = eplb.Topology(4, 16, 24, 8, 2, 4)


class Served:
    """A server on its own loop in a thread; ``client`` is the engine side's sync client."""

    def __init__(self, **overrides: object) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = replace(ServerConfig(port=0, balancer=replace(FAST, replica_id=uuid.uuid4().hex[:8])), **overrides)
        self.server: RunningServer = self._run(start_server(config))
        self.address = self.server.target
        self.client = ServiceClient(self.address, token=overrides.get("token"), timeout_s=5)

    def _run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.client.close()
        self._run(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    def report(self, name: str, loads: np.ndarray, ranks: range) -> None:
        seq = time.time_ns() // 1000
        requests = [
            pb.ReportLoadRequest(deployment=name, rank=r, seq=seq + r, logical=wire.encode_array(loads / len(ranks)))
            for r in ranks
        ]
        assert self.client.endpoints.stub().ReportLoad(iter(requests), metadata=self.client.endpoints.metadata).accepted
        deadline = time.monotonic() + 5  # until a flush put the window in the store
        while time.monotonic() < deadline:
            r = self.client.call("GetPlacement", pb.GetPlacementRequest(deployment=name, include_window_loads=True))
            if r.window_reports >= len(ranks):
                return
            time.sleep(0.05)
        raise AssertionError("the reports never reached the window")


@pytest.fixture
def served() -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def make(**overrides: object) -> Served:
        made.append(Served(**overrides))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = ctl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _loads() -> np.ndarray:
    return np.random.default_rng(0).lognormal(0, 1.5, (TOPO.num_layers, TOPO.num_experts)) * 100


def test_wire_status_fills_ranks_acked_last_plan_and_stats(served: Callable[..., Served]) -> None:
    s = served()
    c = s.client
    c.create_deployment("d1", TOPO, expert_bytes=1 << 20)
    c.create_deployment("d2", TOPO)
    listed = c.call("ListDeployments", pb.ListDeploymentsRequest())
    assert [d.name for d in listed.deployments] == ["d1", "d2"]
    first = listed.statuses[0]
    assert (first.version, first.ranks_acked, first.num_ranks) == (1, 0, 8)
    assert not first.HasField("last_plan_time")  # never planned
    assert first.stats.policy == "initial"
    s.report("d1", _loads(), range(8))
    published = c.rebalance("d1")
    assert published.published and published.placement.version == 2
    for rank in range(6):
        c.ack("d1", rank, 2, "prepared", step=10)
    for rank in range(5):
        c.ack("d1", rank, 2, "switched")
    c.ack("d1", 7, 2, "failed", error="out of memory")
    got = c.call("GetDeployment", pb.GetDeploymentRequest(name="d1")).status
    listed = c.call("ListDeployments", pb.ListDeploymentsRequest()).statuses[0]
    for status in (got, listed):
        assert (status.version, status.ranks_acked, status.ranks_prepared, status.ranks_failed) == (2, 5, 6, 1)
        assert status.HasField("last_plan_time")
        assert abs(status.last_plan_time.ToNanoseconds() / 1e9 - time.time()) < 30
        assert status.stats == published.placement.stats
        assert status.version_time == published.placement.create_time
    # The window as a plan reads it: the reports' sum.
    r = c.call("GetPlacement", pb.GetPlacementRequest(deployment="d1", include_window_loads=True))
    assert np.allclose(wire.decode_array(r.window_loads), _loads()) and r.window_reports == 8
    assert not c.call("GetPlacement", pb.GetPlacementRequest(deployment="d1")).HasField("window_loads")


def test_list_and_show(served: Callable[..., Served], capsys: pytest.CaptureFixture) -> None:
    s = served()
    s.client.create_deployment("d1", TOPO, window_s=600, interval_s=30, min_gain_percent=1.0, expert_bytes=1 << 20)
    code, out, _ = run(capsys, "--address", s.address, "list")
    assert code == 0
    header, row = out.splitlines()
    assert header.split()[:4] == ["NAME", "VERSION", "RANKS", "ACKED"]
    assert row.split()[:3] == ["d1", "1", "0/8"] and "never" in row
    s.report("d1", _loads(), range(8))
    code, out, _ = run(capsys, "--address", s.address, "rebalance", "d1")
    assert code == 0 and out.startswith("published d1 version 2 (window of 8 reports")
    for rank in range(6):
        s.client.ack("d1", rank, 2, "prepared", step=3)
    for rank in range(4):
        s.client.ack("d1", rank, 2, "switched")
    code, out, _ = run(capsys, "--address", s.address, "list")
    row = out.splitlines()[1]
    assert row.split()[:5] == ["d1", "2", "4/8", "(6", "prepared)"] and "never" not in row
    code, out, err = run(capsys, "--address", s.address, "show", "d1")
    assert code == 0 and err == ""
    stats = s.client.get_placement("d1").stats
    lines = out.splitlines()
    assert "topology:   4 layers, 16 experts, 24 slots on 8 gpus, 2 nodes, 4 groups" in lines
    assert "window:     sliding, last 600 s, 10 buckets" in lines
    assert "trigger:    every 30 s, publish at >= 1 % gain" in lines
    stats_line = next(line for line in lines if line.startswith("stats:"))
    assert f"imbalance {stats.imbalance_before:.4f} -> {stats.imbalance_after:.4f}" in stats_line
    assert f"{stats.moves} slots moved" in stats_line
    assert f"predicted stall {stats.transfer.predicted_seconds:.3f} s" in stats_line
    assert "rollout of version 2: 4 of 8 ranks switched, 6 prepared, 0 failed" in lines
    assert "  switched (4): 0-3" in lines and "  prepared (2): 4-5" in lines and "  never acked (2): 6-7" in lines
    code, out, _ = run(capsys, "--address", s.address, "show", "d1", "--ranks")
    assert "5     2         2         -       switched" not in out and out.splitlines()[-1].split() == [
        "7",
        "-",
        "-",
        "-",
        "never",
        "acked",
    ]


def test_placement_formats_out_and_plot(
    served: Callable[..., Served], capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    s = served()
    s.client.create_deployment("d1", TOPO)
    code, _, err = run(capsys, "--address", s.address, "placement", "d1", "--plot", str(tmp_path / "h.png"))
    assert code == 2 and "the load window of 'd1' is empty" in err and len(err.splitlines()) == 1
    s.report("d1", _loads(), range(8))
    s.client.rebalance("d1")
    current = s.client.get_placement("d1", topology=TOPO)
    code, out, _ = run(capsys, "--address", s.address, "placement", "d1", "--format", "native")
    assert code == 0 and np.array_equal(np.array(json.loads(out)["phy2log"]), current.placement.phy2log)
    code, _, err = run(
        capsys, "--address", s.address, "placement", "d1", "--version", "1", "--out", str(tmp_path / "v1.json")
    )
    assert code == 0 and err == f"wrote native placement of d1 version 1 to {tmp_path / 'v1.json'}\n"
    v1 = json.loads((tmp_path / "v1.json").read_text())
    assert np.array_equal(np.array(v1["phy2log"]), eplb.Placement.contiguous(TOPO).phy2log)
    code, out, err = run(capsys, "--address", s.address, "placement", "d1", "--plot", str(tmp_path / "h.png"))
    assert code == 0 and out == "" and "wrote plot of d1 version 2" in err
    assert mpimg.imread(tmp_path / "h.png").shape[1] >= 600
    code, out, _ = run(capsys, "--address", s.address, "placement", "d1")
    first, second = out.splitlines()[:2]
    assert first.startswith("# eplb placement listing, format 1: layers=4 experts=16 slots=24 gpus=8")
    assert second.startswith("# deployment d1, placement version 2, published 20") and second.endswith(" UTC")
    assert eio.placement_text(current.placement, "listing") == out.replace(second + "\n", "")
    assert formats.from_listing(out) == current.placement  # it reads back as a listing
    code, _, err = run(capsys, "--address", s.address, "placement", "d1", "--version", "9")
    assert code == 2 and err == (
        "eplb ctl placement: error: deployment 'd1' has no placement version 9 (current 2) (NOT_FOUND)\n"
    )


def test_rebalance_dry_run_and_force(served: Callable[..., Served], capsys: pytest.CaptureFixture) -> None:
    s = served()
    s.client.create_deployment("d1", TOPO)
    # No load yet: every kind of rebalance says the window is empty and fails (it printed a
    # candidate planned from zero loads, "N slots moved", with rc 0), and show notes no plan.
    for flags in ((), ("--dry-run",), ("--force",)):
        code, out, err = run(capsys, "--address", s.address, "rebalance", "d1", *flags)
        assert code != 0 and out == "" and "the load window of 'd1' is empty" in err, flags
    code, out, _ = run(capsys, "--address", s.address, "show", "d1")
    assert code == 0 and "last plan:  never" in out, out
    s.report("d1", _loads(), range(8))
    code, out, _ = run(capsys, "--address", s.address, "rebalance", "d1", "--dry-run")
    assert code == 0 and out.startswith("dry run of d1, nothing published")
    assert s.client.get_deployment("d1").version == 1
    assert run(capsys, "--address", s.address, "rebalance", "d1")[0] == 0
    code, out, _ = run(capsys, "--address", s.address, "rebalance", "d1")
    assert code == 0 and out.startswith("not published: ")  # the same window: nothing to gain
    code, out, _ = run(capsys, "--address", s.address, "rebalance", "d1", "--force")
    assert code == 0 and out.startswith("published d1 version 3")


def test_watch_prints_a_line_per_version(served: Callable[..., Served], capsys: pytest.CaptureFixture) -> None:
    s = served()
    s.client.create_deployment("d1", TOPO)
    s.report("d1", _loads(), range(8))

    def publish() -> None:
        while s.server.metrics.watchers.labels("d1")._value.get() < 1:
            time.sleep(0.02)
        s.client.rebalance("d1", force=True)
        s.client.rebalance("d1", force=True)

    t = threading.Thread(target=publish)
    t.start()
    code, out, _ = run(capsys, "--address", s.address, "watch", "d1", "--count", "3")
    t.join()
    lines = out.splitlines()
    assert code == 0 and [line.split()[5] for line in lines] == ["1:", "2:", "3:"]
    assert "the initial placement" in lines[0] and "slots moved" in lines[1]


def test_watch_ctrl_c_exits_130_with_one_line(served: Callable[..., Served], capsys: pytest.CaptureFixture) -> None:
    s = served()
    s.client.create_deployment("d1", TOPO)

    def interrupt() -> None:
        while s.server.metrics.watchers.labels("d1")._value.get() < 1:
            time.sleep(0.02)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: KeyboardInterrupt in the main thread

    # Ctrl-C as a terminal delivers it: Python's own handler, whatever this process inherited (a
    # shell's background job starts with SIGINT ignored, and then Python installs none).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t = threading.Thread(target=interrupt)
    t.start()
    try:
        code, out, err = run(capsys, "--address", s.address, "watch", "d1")
    finally:
        t.join()
        signal.signal(signal.SIGINT, previous)
    assert code == 130 and err == "\neplb ctl watch: interrupted\n" and len(out.splitlines()) == 1


def test_health_and_an_unreachable_service(
    served: Callable[..., Served], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ctl._PROXY_VARIABLES:  # a proxy skips the connection check
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    s = served()
    assert run(capsys, "--address", s.address, "health") == (0, f"{s.address}: SERVING\n", "")
    s.stop()
    code, out, _ = run(capsys, "--address", s.address, "--timeout", "0.5", "health")
    assert code == 1 and out == f"{s.address}: NOT SERVING (or unreachable)\n"
    # A refused connection fails at once, not after --timeout of retries (5.5 s before).
    for command in ("list", "watch"):
        began = time.monotonic()
        code, out, err = run(capsys, "--address", s.address, command, *(["d1"] if command == "watch" else []))
        assert time.monotonic() - began < 1.5
        assert (code, out) == (2, "")
        assert err == (
            f"eplb ctl {command}: error: nothing answers at {s.address}: connection refused; is eplb serve "
            "running there? (--address HOST:PORT or EPLB_ADDRESS names another)\n"
        )
    # One address that answers is enough: the client fails over to it.
    live = served()
    assert run(capsys, "--address", f"{s.address},{live.address}", "list") == (0, "no deployments\n", "")
    s.thread.join()  # stopped above: the fixture's stop must not run twice
    s.stop = lambda: None


def test_token_from_file_and_environment(
    served: Callable[..., Served], capsys: pytest.CaptureFixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPLB_TOKEN", raising=False)
    monkeypatch.delenv("EPLB_TOKEN_FILE", raising=False)
    s = served(token="s3cret")
    code, _, err = run(capsys, "--address", s.address, "list")
    assert code == 2 and "refused the call: missing or wrong bearer token" in err
    assert "give the service's token with --token-file F or EPLB_TOKEN" in err
    (tmp_path / "t").write_text("s3cret\n")
    assert run(capsys, "--address", s.address, "--token-file", str(tmp_path / "t"), "list") == (
        0,
        "no deployments\n",
        "",
    )
    monkeypatch.setenv("EPLB_TOKEN", "s3cret")
    assert run(capsys, "--address", s.address, "list")[0] == 0
    monkeypatch.setenv("EPLB_TOKEN_FILE", str(tmp_path / "missing"))
    code, _, err = run(capsys, "--address", s.address, "list")
    assert code == 2 and "EPLB_TOKEN_FILE " in err and "cannot read it (No such file or directory)" in err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--address", "localhost", "list"],
            "list: error: --address localhost: 'localhost' is not HOST:PORT (port 1-65535)",
        ),
        (
            ["--address", "h:1", "--timeout", "0", "list"],
            "list: error: --timeout must be a number of seconds > 0, got 0.0",
        ),
        (["--address", "h:1", "watch", "d", "--count", "-1"], "watch: error: --count must be >= 0, got -1"),
    ],
)
def test_bad_flags_get_one_line(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch, argv: list[str], said: str
) -> None:
    monkeypatch.delenv("EPLB_ADDRESS", raising=False)
    assert run(capsys, *argv) == (2, "", f"eplb ctl {said}\n")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["watch", "d", "--count", "x"], "eplb ctl watch: error: argument --count: invalid int value: 'x'"),
        (["create", "d", "--gpus", "-8"], "eplb ctl create: error: argument --gpus: must be an integer >= 0, got '-8'"),
        (["create", "d", "--window", "inf"], "eplb ctl create: error: argument --window: must be a finite number >= 0"),
        (["list", "-o", "yaml"], "eplb ctl list: error: argument -o/--output: invalid choice: 'yaml' (choose from"),
        (["lst"], "eplb ctl: error: argument COMMAND: invalid choice: 'lst' (choose from 'create', 'delete',"),
    ],
)
def test_a_bad_flag_value_is_one_line_with_a_hint_to_help(
    capsys: pytest.CaptureFixture, argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit) as exc:  # argparse's own: before any connection
        ctl.main(argv)
    out, err = capsys.readouterr()
    assert (exc.value.code, out) == (2, "")
    (line,) = err.splitlines()  # argparse printed its usage first: 8 lines for create
    assert line.startswith(said) and line.endswith(f" (see {said.split(': error')[0]} --help)"), line


def test_the_address_defaults_to_where_eplb_serve_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    from eplb_service import cli as serve_cli

    monkeypatch.delenv("EPLB_ADDRESS", raising=False)
    assert ctl.build_parser().parse_args(["list"]).address == "127.0.0.1:50051"
    host, port = (serve_cli._OPTIONS[name][2] for name in ("host", "port"))
    assert ctl.DEFAULT_ADDRESS == f"{host}:{port}"  # the two defaults agree
    monkeypatch.setenv("EPLB_ADDRESS", "10.0.0.1:7000")
    assert ctl.build_parser().parse_args(["list"]).address == "10.0.0.1:7000"
    assert ctl.build_parser().parse_args(["--address", "h:1", "list"]).address == "h:1"


def test_unknown_deployment_and_the_eplb_entry_point(
    served: Callable[..., Served], capsys: pytest.CaptureFixture
) -> None:
    s = served()
    assert cli.main(["ctl", "--address", s.address, "show", "nope"]) == 2
    assert capsys.readouterr().err == (
        "eplb ctl show: error: deployment 'nope' not found (NOT_FOUND; eplb ctl list shows the deployments)\n"
    )


def test_tls_with_the_service_certificate(
    served: Callable[..., Served], capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    s = served(tls_cert=cert, tls_key=key)
    assert run(capsys, "--address", s.address, "--tls-ca", str(cert), "list") == (0, "no deployments\n", "")
    assert run(capsys, "--address", s.address, "--tls-ca", str(cert), "health") == (0, f"{s.address}: SERVING\n", "")
    code, _, err = run(capsys, "--address", s.address, "--timeout", "0.5", "list")  # plaintext to a TLS port
    assert code == 2 and err.startswith("eplb ctl list: error: cannot reach the service at")
    code, _, err = run(capsys, "--address", s.address, "--tls-ca", str(tmp_path / "nope.pem"), "list")
    assert (
        code == 2
        and err
        == f"eplb ctl list: error: --tls-ca {tmp_path / 'nope.pem'}: cannot read it (No such file or directory)\n"
    )


def test_watch_reconnects_after_the_service_restarts(
    served: Callable[..., Served], capsys: pytest.CaptureFixture
) -> None:
    import redis

    prefix = f"eplb-test-{uuid.uuid4().hex[:10]}"
    url = "redis://127.0.0.1:6379/0"
    first = served(redis_url=url, key_prefix=prefix)
    try:
        first.client.create_deployment("d1", TOPO)
        first.report("d1", _loads(), range(8))
        port = first.server.port
        second: list[Served] = []

        def restart() -> None:
            while first.server.metrics.watchers.labels("d1")._value.get() < 1:
                time.sleep(0.02)
            first.stop()
            first.stop = lambda: None
            second.append(served(redis_url=url, key_prefix=prefix, port=port))
            second[0].client.rebalance("d1", force=True)

        t = threading.Thread(target=restart)
        t.start()
        code, out, err = run(capsys, "--address", first.address, "watch", "d1", "--count", "2")
        t.join()
        assert code == 0 and [line.split()[5] for line in out.splitlines()] == ["1:", "2:"]
        said = err.splitlines()
        assert len(said) == 2 and said[0].startswith("eplb ctl watch: lost the service (")
        assert said[1] == f"eplb ctl watch: reconnected to {first.address}"
    finally:
        r = redis.Redis.from_url(url)
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            r.delete(*keys)
        r.close()


def test_show_names_down_and_suspect_ranks(served: Callable[..., Served], capsys: pytest.CaptureFixture) -> None:
    """A rank down (SetRanksDown) is shown as down, not as a rank that never acked, and a silent
    rank (liveness) as suspect."""
    s = served()
    d = pb.Deployment(name="d1", topology=wire.topology_to_pb(TOPO))
    d.liveness.suspect_after.FromSeconds(1)
    s.client.call("CreateDeployment", pb.CreateDeploymentRequest(deployment=d))
    for rank in range(6):
        s.client.ack("d1", rank, 1, "switched")
    s.client.call("SetRanksDown", pb.SetRanksDownRequest(deployment="d1", down=[7], reason="test"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        code, out, _ = run(capsys, "--address", s.address, "show", "d1")
        if "suspect:    rank 6" in out:
            break
        time.sleep(0.2)
    assert code == 0
    lines = out.splitlines()
    assert "down:       ranks 7 (SetRanksDown; not in the rollout)" in lines
    assert "suspect:    rank 6, never heard from (no report or ack; still planned for)" in lines
    assert "  down (1): 7" in lines


SPEC_TOML = """\
name = "from-toml"
policy = "global"
expert_bytes = 1048576

[topology]
num_layers = 4
num_experts = 16
num_slots = 24
num_gpus = 8
num_nodes = 2
num_groups = 4

[window.decay]
half_life = "60s"

[trigger]
interval = "30s"
min_gain_percent = 2.5
"""


def test_create_from_flags_then_list_shows_it(served: Callable[..., Served], capsys: pytest.CaptureFixture) -> None:
    s = served()
    code, out, err = run(
        capsys, "--address", s.address, "create", "d1", "--layers", "4", "--experts", "16", "--slots", "24"
    )
    assert (code, out) == (2, "")
    assert err == "eplb ctl create: error: deployment.topology.num_gpus: must be >= 1 (INVALID_ARGUMENT)\n"
    code, out, err = run(capsys, "--address", s.address, "create", "d1")
    assert err == (
        "eplb ctl create: error: give the topology: --layers L --experts E --slots P --gpus G [--nodes N --groups K] "
        "(or a [topology] table in the spec file)\n"
    )
    argv = ["create", "d1", "--layers", "4", "--experts", "16", "--slots", "24", "--gpus", "8", "--nodes", "2"]
    code, out, err = run(capsys, "--address", s.address, *argv, "--groups", "4", "--window", "120", "--max-moves", "5")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "created deployment d1, version 1: 4 layers, 16 experts, 24 slots on 8 gpus, 2 nodes, 4 groups",
        "policy auto; window sliding, last 120 s, 10 buckets; trigger off (plans only on Rebalance)",
    ]
    stored = s.client.get_deployment("d1")
    assert wire.topology_from_pb(stored.topology) == TOPO and stored.migration.max_moves == 5
    assert list(stored.ranks) == list(range(8))
    code, out, _ = run(capsys, "--address", s.address, "list")
    assert out.splitlines()[1].split()[:3] == ["d1", "1", "0/8"]
    code, out, err = run(capsys, "--address", s.address, *argv, "--groups", "4")
    assert (code, out) == (2, "")
    assert err == (
        "eplb ctl create: error: deployment 'd1' already exists (ALREADY_EXISTS; eplb ctl delete NAME removes it "
        "first)\n"
    )


def test_create_from_a_spec_file_with_flags_over_it(
    served: Callable[..., Served], capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    s = served()
    (tmp_path / "d.toml").write_text(SPEC_TOML)
    assert run(capsys, "--address", s.address, "create", "-f", str(tmp_path / "d.toml"))[0] == 0
    got = s.client.get_deployment("from-toml")
    assert wire.topology_from_pb(got.topology) == TOPO and got.policy == "global" and got.expert_bytes == 1 << 20
    assert got.window.decay.half_life.seconds == 60 and got.trigger.interval.seconds == 30
    assert got.trigger.min_gain_percent == 2.5
    # NAME and flags win over the file; a flag's window replaces the file's decay one.
    code, out, _ = run(
        capsys, "--address", s.address, "create", "other", "-f", str(tmp_path / "d.toml"), "--window", "90"
    )
    assert code == 0 and out.splitlines()[1] == (
        "policy global; window sliding, last 90 s, 10 buckets; trigger every 30 s, publish at >= 2.5 % gain"
    )
    # JSON, in the mapping show -o json prints (camelCase names too, as protobuf's JSON parser reads them).
    spec = {"name": "from-json", "topology": {"numLayers": 4, "numExperts": 16, "numSlots": 24, "numGpus": 8}}
    (tmp_path / "d.json").write_text(json.dumps(spec))
    assert run(capsys, "--address", s.address, "create", "-f", str(tmp_path / "d.json"))[0] == 0
    assert s.client.get_deployment("from-json").topology.num_gpus == 8


@pytest.mark.parametrize(
    ("spec_name", "text", "said"),
    [
        ("d.yaml", "name: x", "a spec is .toml or .json, not '.yaml'"),
        ("d.toml", "name = ", "not valid TOML: "),
        ("d.json", "[1]", "must hold one table (the Deployment's fields), not a list"),
        ("d.toml", 'nme = "x"', 'Message type "eplb.v1.Deployment" has no field named "nme"'),
        ("d.toml", "[window.sliding]\nduration = 600\n[topology]\nnum_gpus = 8", "Duration JSON value not a string"),
    ],
)
def test_a_bad_spec_file_is_one_line_before_any_call(
    capsys: pytest.CaptureFixture, tmp_path: Path, spec_name: str, text: str, said: str
) -> None:
    (tmp_path / spec_name).write_text(text)
    # Nothing listens at 127.0.0.1:1: the spec fails first, so no connection is tried.
    code, out, err = run(capsys, "--address", "127.0.0.1:1", "create", "d", "-f", str(tmp_path / spec_name))
    assert (code, out) == (2, "") and len(err.splitlines()) == 1
    assert err.startswith(f"eplb ctl create: error: --file {tmp_path / spec_name}: ") and said in err, err


def test_the_service_refusing_a_spec_is_one_line_naming_the_field_and_status(
    served: Callable[..., Served], capsys: pytest.CaptureFixture
) -> None:
    s = served()
    argv = ["create", "d1", "--layers", "4", "--experts", "16", "--slots", "20", "--gpus", "8", "--policy", "nope"]
    code, out, err = run(capsys, "--address", s.address, *argv)
    assert (code, out) == (2, "") and len(err.splitlines()) == 1
    assert err.startswith("eplb ctl create: error: deployment.topology: num_slots (20) must be a multiple of num_gpus")
    assert "deployment.policy: unknown policy 'nope'; registered: auto," in err
    assert err.endswith(" (INVALID_ARGUMENT)\n")
    assert s.client.call("ListDeployments", pb.ListDeploymentsRequest()).deployments == []


class _Terminal(io.StringIO):
    """stdin as a terminal that answers ``text``."""

    def isatty(self) -> bool:
        return True


def test_delete_asks_on_a_terminal_and_takes_yes(
    served: Callable[..., Served], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = served()
    s.client.create_deployment("d1", TOPO)
    monkeypatch.setattr("sys.stdin", _Terminal("n\n"))
    code, out, err = run(capsys, "--address", s.address, "delete", "d1")
    assert (code, out) == (1, "")
    assert err == (
        "delete deployment 'd1' (version 1, 8 gpus) and all its state: placements, load window, acks? [y/N] "
        "eplb ctl delete: 'd1' not deleted\n"
    )
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # not a terminal: no one to ask
    code, out, err = run(capsys, "--address", s.address, "delete", "d1")
    assert (code, out) == (2, "")
    assert err == "eplb ctl delete: error: stdin is not a terminal to ask on; pass --yes to delete without asking\n"
    assert s.client.get_deployment("d1").name == "d1"  # still there
    monkeypatch.setattr("sys.stdin", _Terminal("yes\n"))
    assert run(capsys, "--address", s.address, "delete", "d1")[:2] == (0, "deleted deployment d1\n")
    s.client.create_deployment("d2", TOPO)
    assert run(capsys, "--address", s.address, "delete", "d2", "--yes") == (0, "deleted deployment d2\n", "")
    assert run(capsys, "--address", s.address, "list") == (0, "no deployments\n", "")
    code, _, err = run(capsys, "--address", s.address, "delete", "d2", "--yes")
    assert code == 2 and err == (
        "eplb ctl delete: error: deployment 'd2' not found (NOT_FOUND; eplb ctl list shows the deployments)\n"
    )


def test_output_json_for_scripts(served: Callable[..., Served], capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    s = served()
    assert run(capsys, "--address", s.address, "list", "-o", "json") == (0, '{"deployments": []}\n', "")
    s.client.create_deployment("d1", TOPO, interval_s=30)
    s.report("d1", _loads(), range(8))
    published = s.client.rebalance("d1")
    for rank in range(3):
        s.client.ack("d1", rank, 2, "switched")
    code, out, _ = run(capsys, "--address", s.address, "list", "-o", "json")
    (entry,) = json.loads(out)["deployments"]
    d, status = entry["deployment"], entry["status"]
    assert (d["name"], d["version"], d["policy"], d["trigger"]["interval"]) == ("d1", 2, "auto", "30s")
    assert d["topology"] == {
        "num_layers": 4,
        "num_experts": 16,
        "num_slots": 24,
        "num_gpus": 8,
        "num_nodes": 2,
        "num_groups": 4,
    }
    assert (status["version"], status["ranks_acked"], status["ranks_failed"], status["num_ranks"]) == (2, 3, 0, 8)
    assert status["stats"]["moves"] == published.placement.stats.moves  # 64-bit integers are numbers
    assert status["version_time"].endswith("Z")
    code, out, _ = run(capsys, "--address", s.address, "show", "d1", "-o", "json")
    shown = json.loads(out)
    assert shown["deployment"] == d and shown["status"]["ranks_acked"] == 3 and shown["down_ranks"] == []
    assert sorted(a["rank"] for a in shown["acks"]) == [0, 1, 2]
    # show's deployment is a spec: create -f takes it back (output-only fields ignored).
    (tmp_path / "copy.json").write_text(json.dumps(shown["deployment"] | {"name": "copy"}))
    assert run(capsys, "--address", s.address, "create", "-f", str(tmp_path / "copy.json"))[0] == 0
    copy = s.client.get_deployment("copy")
    assert copy.version == 1 and copy.trigger == s.client.get_deployment("d1").trigger
    code, out, _ = run(capsys, "--address", s.address, "placement", "d1", "-o", "json")
    p = json.loads(out)
    assert (p["deployment"], p["version"]) == ("d1", 2) and p["stats"]["policy_used"] == "global"
    current = s.client.get_placement("d1", topology=TOPO).placement.phy2log
    assert np.array_equal(np.array(p["phy2log"]), current)
    code, out, _ = run(capsys, "--address", s.address, "watch", "d1", "--count", "1", "-o", "json")
    (line,) = out.splitlines()  # JSON Lines: one object per version, the current one first
    assert json.loads(line) == {k: v for k, v in p.items() if k != "phy2log"}
    code, _, err = run(capsys, "--address", s.address, "placement", "d1", "-o", "json", "--format", "sglang")
    assert code == 2 and "-o json prints the version to stdout; --format is for a placement format" in err


def test_a_topology_of_ones_reads_in_the_singular() -> None:
    from eplb_tools.ctl import _topology
    from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb

    one = pb.Topology(num_layers=1, num_experts=8, num_slots=8, num_gpus=1)
    assert _topology(one) == "1 layer, 8 experts, 8 slots on 1 gpu, 1 node, 1 group"
    two = pb.Topology(num_layers=2, num_experts=1, num_slots=2, num_gpus=2, num_nodes=2, num_groups=1)
    assert _topology(two) == "2 layers, 1 expert, 2 slots on 2 gpus, 2 nodes, 1 group"
