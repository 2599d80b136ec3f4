"""Plugin policies: a module named by the config or an installed entry point registers a policy,
and the service (server and planning workers) and ``eplb place`` plan with it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from svc_helpers import FAST
from test_cli import assert_one_line_error, run_serve

import eplb
from eplb_bench.harness.service import reports
from eplb_engine.aio import AsyncServiceClient
from eplb_service import plugins
from eplb_wire._gen.eplb.v1 import balancer_pb2 as pb
from eplb_wire.arrays import encode

ROOT = Path(__file__).resolve().parents[2]

# Every slot p holds expert (p + offset) % E: easy to recognise in an answer.
PLUGIN = """
from dataclasses import dataclass
import numpy as np, eplb


@dataclass(frozen=True)
class Options:
    offset: int = 0


@eplb.register_policy("{name}", options=Options, replans=False)
def rotated(loads, topology, options):
    slots = (np.arange(topology.num_slots) + options.offset) % topology.num_experts
    return eplb.PolicyResult(np.tile(slots, (topology.num_layers, 1)).astype(np.int32), "{name}")
"""


def rotated(topo: eplb.Topology, offset: int = 0) -> np.ndarray:
    return np.tile((np.arange(topo.num_slots) + offset) % topo.num_experts, (topo.num_layers, 1))


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A plugin module on ``sys.path`` (spawned workers inherit it) → (module, policy name);
    the policy is unregistered afterwards."""
    tag = uuid.uuid4().hex[:8]
    module, name = f"eplb_test_plugin_{tag}", f"rotated-{tag}"
    (tmp_path / f"{module}.py").write_text(PLUGIN.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module, name
    if name in eplb.policies():
        eplb.unregister_policy(name)


async def test_a_plugin_policy_plans_stateless_calls_and_deployments_in_the_workers(serve, plugin, connect):
    module, name = plugin
    assert name not in eplb.policies()
    c = connect(await serve(balancer=replace(FAST, plugins=(module,))))
    assert name in eplb.policies()
    topo = eplb.Topology(4, 16, 24, 8)
    wire = pb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8)
    counts = np.random.default_rng(0).integers(1, 100, (4, 16)).astype(np.int32)
    out = await c.stub.ComputePlacement(pb.ComputePlacementRequest(topology=wire, policy=name, loads=encode(counts)))
    assert np.array_equal(np.frombuffer(out.phy2log.data, "<i4").reshape(4, 24), rotated(topo))
    assert out.stats.policy_used == name
    # A deployment's re-plans run in the other pool's worker, which loads the plugin as well.
    d = pb.Deployment(name="rot", topology=wire, policy=name)
    await c.stub.CreateDeployment(pb.CreateDeploymentRequest(deployment=d))
    assert (await AsyncServiceClient.over(c.channel).report(reports("rot", 0, [counts]))).accepted == 1
    await asyncio.sleep(0.3)
    plan = await c.stub.Rebalance(pb.RebalanceRequest(deployment="rot", force=True), timeout=30)
    assert plan.published
    assert np.array_equal(np.frombuffer(plan.placement.phy2log.data, "<i4").reshape(4, 24), rotated(topo))


BROKEN = """
import numpy as np, eplb


@eplb.register_policy("{name}")
def broken(loads, topology, options):
    return eplb.PolicyResult(np.zeros((topology.num_layers, 3), dtype=np.int32), "{name}")
"""


async def test_a_plugin_policy_returning_a_bad_placement_is_internal_not_the_callers_fault(
    serve, connect, tmp_path, monkeypatch
):
    # It used to answer INVALID_ARGUMENT on "request", blaming a valid request.
    tag = uuid.uuid4().hex[:8]
    module, name = f"eplb_test_broken_{tag}", f"broken-{tag}"
    (tmp_path / f"{module}.py").write_text(BROKEN.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        c = connect(await serve(balancer=replace(FAST, plugins=(module,))))
        wire = pb.Topology(num_layers=4, num_experts=16, num_slots=24, num_gpus=8)
        counts = np.ones((4, 16), dtype=np.int32)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.stub.ComputePlacement(pb.ComputePlacementRequest(topology=wire, policy=name, loads=encode(counts)))
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert f"policy {name!r} returned an invalid placement" in info.value.details()
    finally:
        if name in eplb.policies():
            eplb.unregister_policy(name)


def test_a_plugin_that_fails_to_import_is_named():
    with pytest.raises(ValueError, match="plugin 'no_such_module_xyz' failed to load: ModuleNotFoundError"):
        plugins.load(("no_such_module_xyz",))
    assert plugins.parse(" a.b, ,c ") == ("a.b", "c") and plugins.parse(None) == ()


def test_eplb_serve_refuses_a_plugin_it_cannot_import():
    out = run_serve("--port", "0", "--plugins", "no_such_module_xyz")
    assert_one_line_error(out, "--plugins", "no_such_module_xyz", "ModuleNotFoundError")


def test_an_installed_entry_point_reaches_eplb_place(tmp_path):
    """A distribution on the path whose ``eplb.policies`` entry point names the module: ``eplb
    place --policy`` offers and runs its policy with no flag or variable set."""
    tag = uuid.uuid4().hex[:8]
    module, name = f"eplb_test_ep_{tag}", f"rotated-{tag}"
    (tmp_path / f"{module}.py").write_text(PLUGIN.format(name=name))
    info = tmp_path / f"eplb_test_ep_{tag}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: eplb-test-ep-{tag}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[eplb.policies]\nrot = {module}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPLB_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    out_file = tmp_path / "p.json"
    argv = [sys.executable, "-m", "eplb_tools.cli", "place", "--synthetic", "zipf-1.0", "--layers", "3"]
    argv += ["--experts", "16", "--slots", "24", "--gpus", "8", "--policy", name, "--out", str(out_file)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    phy2log = np.array(json.loads(out_file.read_text())["phy2log"])
    assert np.array_equal(phy2log, rotated(eplb.Topology(3, 16, 24, 8)))
    # The same module named again by EPLB_PLUGINS is loaded once, not registered twice.
    again = subprocess.run(
        argv, cwd=ROOT, env=env | {"EPLB_PLUGINS": module}, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr


def test_eplb_bench_benchmarks_a_plugin_policy(plugin, tmp_path, monkeypatch, capsys):
    """EPLB_PLUGINS reaches eplb-bench as it reaches eplb place: --policies takes the plugin's
    policy (it was 'unknown', the list of registered policies leaving it out)."""
    from eplb_bench import report

    module, name = plugin
    monkeypatch.setenv("EPLB_PLUGINS", module)
    np.save(tmp_path / "t.npy", np.random.default_rng(0).integers(1, 100, (1, 3, 16)))
    out = tmp_path / "r.json"
    argv = [str(tmp_path / "t.npy"), "--slots", "24", "--gpus", "8", "--policies", name, "--json", str(out)]
    assert report.main(argv) == 0, capsys.readouterr().err
    rows = {r["policy"]: r for r in json.loads(out.read_text())["placement"]}
    assert set(rows) == {"none", name} and "skipped" not in rows[name]
    monkeypatch.setenv("EPLB_PLUGINS", "no_such_module_xyz")
    assert report.main(argv) == 2
    assert "eplb-bench: error: EPLB_PLUGINS: plugin 'no_such_module_xyz' failed to load" in capsys.readouterr().err
