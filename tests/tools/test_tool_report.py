"""eplb-bench: the report's numbers are the library's metrics; plots open as PNGs of the set size."""

import json
import os
import uuid

import matplotlib.image as mpimg
import numpy as np
import pytest

import eplb
from eplb.workloads import SCALES, drift, make_loads
from eplb_bench import report
from eplb_tools import plots

TINY = report.Settings(
    scales=("small",),
    workloads=("zipf-1.0",),
    policies=("deepseek", "global", "hierarchical"),
    replan_scales=("small",),
    replan_steps=6,
    replan_every=2,
    step_scales=("small",),
    tokens_per_gpu=(8, 64),
    sim_steps=20,
    topk=2,
    layer=0,
    ilp_time_limit=1.0,
)


def test_placement_rows_equal_library_metrics():
    topo = eplb.Topology(3, 16, 20, 4, 2, 4)
    loads = make_loads("lognormal-1.0", topo)
    case = report.Case("mine", "lognormal-1.0", topo, loads)
    row, placement, _ = report.plan_case(case, "global")
    plan = eplb.rebalance(loads, topo, "global")
    expect = eplb.imbalance(eplb.gpu_loads(loads, plan.placement))
    assert placement == plan.placement
    assert row["imbalance_mean"] == float(expect.mean())
    assert row["imbalance_worst"] == float(expect.max())
    assert row["imbalance_lb_mean"] == float(eplb.imbalance_lb(loads, topo).mean())
    assert row["gap_to_lb"] == pytest.approx(float((expect / eplb.imbalance_lb(loads, topo)).mean() - 1))
    none, contiguous, _ = report.plan_case(case, "none")
    assert contiguous == eplb.Placement.contiguous(topo)
    assert none["imbalance_mean"] == float(eplb.imbalance(eplb.gpu_loads(loads, contiguous)).mean())
    assert "solve_seconds" not in none


def test_hierarchical_is_skipped_with_the_reason_when_groups_do_not_split():
    topo = eplb.Topology(1, 16, 20, 4, 2, 1)
    row, placement, _ = report.plan_case(report.Case("s", "w", topo, np.ones((1, 16))), "hierarchical")
    assert placement is None and row["skipped"] == "num_groups (1) % num_nodes (2) != 0"


def test_ilp_gap_is_relative_to_the_ilp_row():
    rows = [
        {"scale": "s", "workload": "w", "policy": "ilp", "imbalance_mean": 1.0},
        {"scale": "s", "workload": "w", "policy": "global", "imbalance_mean": 1.05},
        {"scale": "t", "workload": "w", "policy": "global", "imbalance_mean": 1.2},
    ]
    report.add_ilp_gap(rows)
    assert rows[1]["gap_to_ilp"] == pytest.approx(0.05)
    assert "gap_to_ilp" not in rows[2]


def test_ilp_only_on_the_small_scale():
    assert "ilp" not in report.policies_for(SCALES["v3-prefill"], "v3-prefill")
    assert ("ilp" in report.policies_for(SCALES["small"], "small")) == ("ilp" in eplb.policies())
    assert report.policies_for(SCALES["small"], "small", ("global",))[:2] == ("none", "global")


def test_replan_series_scores_each_step_with_the_placement_in_service():
    topo = SCALES["small"].with_layers(2)
    seq = drift(make_loads("zipf-1.0", topo), 0.2, 6, seed=3)
    s = report.replan_series(topo, seq, "global", every=2)
    first = eplb.rebalance(seq[0], topo, "global")
    second = eplb.rebalance(seq[0:2].sum(axis=0), topo, "global", previous=first.placement)
    assert s["replan_steps"].tolist() == [2, 4]
    assert s["imbalance"][1] == eplb.imbalance(eplb.gpu_loads(seq[1], first.placement)).mean()
    assert s["imbalance"][2] == eplb.imbalance(eplb.gpu_loads(seq[2], second.placement)).mean()
    assert s["moves"][0] == int(eplb.moves(first.placement, second.placement).sum())


def test_build_report_writes_plots_of_the_set_size(tmp_path):
    rep = report.build_report(TINY, plots=tmp_path)
    assert {r["policy"] for r in rep["placement"]} >= {"none", "deepseek", "global", "hierarchical"}
    assert {r["sequence"] for r in rep["replan"]} == {"drift-0.05", "shift"}
    assert [r["tokens_per_gpu"] for r in rep["steps"] if r["workload"] == "uniform"] == [8, 64]
    names = sorted(p.split("/")[-1] for p in rep["plots"])
    assert names == sorted(
        [
            "gpu_load_small_zipf-1.0_layer0.png",
            "imbalance_over_time_small_drift-0.05.png",
            "imbalance_over_time_small_shift.png",
            "solve_time_by_scale.png",
        ]
    )
    for path in rep["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        img = mpimg.imread(path)
        assert img.shape[:2] == (plots.PIXELS[1], plots.PIXELS[0]) == (500, 1000)
    table = report.markdown(rep)
    row = next(r for r in rep["placement"] if r["policy"] == "global")
    assert f"| small | zipf-1.0 | global | {row['imbalance_mean']:.4f} | {row['imbalance_worst']:.4f} |" in table


def test_main_reads_trace_files_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "QUICK", TINY)
    topo = eplb.Topology(2, 16, 20, 4, 1, 1)
    loads = make_loads("lognormal-1.5", topo)
    trace = tmp_path / "t.npy"
    np.save(trace, loads)
    out = tmp_path / "r.json"
    assert (
        report.main([str(trace), "--quick", "--slots", "20", "--gpus", "4", "--policies", "global", "--json", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["placement"]
    mine = next(r for r in rows if r["workload"] == str(trace) and r["policy"] == "global")
    plan = eplb.rebalance(loads, topo, "global")
    assert mine["imbalance_mean"] == plan.mean_imbalance
    assert mine["scale"] == "trace(4 gpus)"
    assert "## per-step (sampled routing)" in capsys.readouterr().out
    assert report.main([str(trace), "--quick"]) == 2
    assert "give the deployment for trace files with --topology CONFIG or --slots and --gpus" in capsys.readouterr().err


def test_trace_with_a_time_axis_gets_a_replanning_row_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "QUICK", TINY)
    topo = eplb.Topology(2, 16, 20, 4, 1, 1)
    seq = np.round(drift(make_loads("zipf-1.0", topo), 0.2, 6, seed=5))
    trace = tmp_path / "seq.npy"
    np.save(trace, seq)
    out = tmp_path / "r.json"
    argv = [
        str(trace),
        "--quick",
        "--slots",
        "20",
        "--gpus",
        "4",
        "--policies",
        "global",
        "--expert-bytes",
        "1e9",
        "--json",
        str(out),
        "--plots",
        str(tmp_path / "png"),
    ]
    assert report.main(argv) == 0
    rep = json.loads(out.read_text())
    mine = next(r for r in rep["replan"] if r["sequence"] == str(trace) and r["policy"] == "global")
    s = report.replan_series(topo, seq, "global", TINY.replan_every)
    assert mine["imbalance_mean"] == float(s["imbalance"].mean())
    assert mine["moved_bytes_per_replan"] == mine["moves_per_replan"] * 1e9
    assert (tmp_path / "png" / "imbalance_over_time_trace_4_gpus_seq.npy.png").is_file()
    assert (
        f"| {mine['moves_per_replan']:.1f} | {mine['moved_fraction']:.3f} | {mine['moves_per_replan']:.2f} |"
        in capsys.readouterr().out
    )


# Plugin policies that are broken in three ways: an invalid plan (eplb.PolicyError), a plain
# ValueError of their own, any other exception.
BROKEN = {
    "invalid-plan": "return eplb.PolicyResult(np.zeros((topology.num_layers, 3), dtype=np.int32), 'x')",
    "value-error": "raise ValueError('index 17 out of range')",
    "zero-division": "return 1 / 0",
}
PLUGIN = """
import numpy as np, eplb


@eplb.register_policy("{name}")
def broken(loads, topology, options):
    {body}
"""


@pytest.fixture
def broken_plugin(tmp_path, monkeypatch):
    """``make(body)`` writes a plugin module registering a policy that runs ``body``, named in
    EPLB_PLUGINS → the policy's name; unregistered afterwards."""
    made = []

    def make(body: str) -> str:
        tag = uuid.uuid4().hex[:8]
        module, name = f"eplb_test_bench_plugin_{tag}", f"broken-{tag}"
        (tmp_path / f"{module}.py").write_text(PLUGIN.format(name=name, body=body))
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("EPLB_PLUGINS", module)
        made.append(name)
        return name

    yield make
    for name in made:
        if name in eplb.policies():
            eplb.unregister_policy(name)


@pytest.mark.parametrize(
    "kind, error",
    [
        ("invalid-plan", "PolicyError: policy '{name}' returned an invalid placement: phy2log has shape (3, 3)"),
        ("value-error", "ValueError: index 17 out of range"),
        ("zero-division", "ZeroDivisionError: division by zero"),
    ],
)
def test_a_broken_policy_fails_the_run_after_the_tables_so_far(broken_plugin, tmp_path, capsys, kind, error):
    # It was a "skipped" row and status 0 (the ZeroDivisionError a traceback).
    name = broken_plugin(BROKEN[kind])
    trace = tmp_path / "t.npy"
    np.save(trace, np.random.default_rng(0).integers(1, 100, (1, 3, 16)))
    out = tmp_path / "r.json"
    argv = [str(trace), "--slots", "24", "--gpus", "8", "--policies", f"global,{name},deepseek", "--json", str(out)]
    assert report.main(argv) == 1
    stdout, stderr = capsys.readouterr()
    line = f"eplb-bench: error: policy {name!r} failed on trace(8 gpus) / {trace}: {error.format(name=name)}"
    assert len(stderr.splitlines()) == 1 and stderr.startswith(line)
    table = [r for r in stdout.splitlines() if r.startswith(f"| trace(8 gpus) | {trace} |")]
    assert [r.split(" | ")[2] for r in table] == ["none", "global"]  # the rows before it
    assert "skipped" not in stdout
    rep = json.loads(out.read_text())
    assert [r["policy"] for r in rep["placement"]] == ["none", "global"]
    assert rep["failed"] == stderr.strip().removeprefix("eplb-bench: error: ")


def test_what_does_not_apply_is_still_a_skipped_row(broken_plugin):
    topo = eplb.Topology(1, 4, 12, 2)
    # deepseek computes in float32: layers summing above 2**127 are beyond it.
    huge = report.Case("trace(2 gpus)", "t", topo, np.full((1, 4), 1e39))
    row, placement, _ = report.plan_case(huge, "deepseek")
    assert placement is None and row["skipped"].startswith("loads too large: layer 0 sums to 4e+39")
    assert "policy 'deepseek' computes in float32 as eplb.py does" in row["skipped"]
    # ilp keeps one replica of an expert per gpu: 12 slots cannot fit 4 experts x 2 gpus.
    row, placement, _ = report.plan_case(report.Case("trace(2 gpus)", "t", topo, np.ones((1, 4))), "ilp")
    assert placement is None and row["skipped"] == (
        "ilp keeps at most one replica of an expert per gpu: num_slots (12) > num_experts x num_gpus (8)"
    )
    # A missing extra: the policy's dependency is not installed.
    name = broken_plugin("import eplb_no_such_dependency_xyz")
    from eplb_service import plugins

    plugins.load(plugins.parse(os.environ["EPLB_PLUGINS"]))
    row, placement, _ = report.plan_case(report.Case("trace(2 gpus)", "t", topo, np.ones((1, 4))), name)
    assert placement is None and row["skipped"] == "No module named 'eplb_no_such_dependency_xyz'"


def test_a_policy_that_fails_only_when_re_planning_fails_the_run_there(broken_plugin, tmp_path, capsys):
    # Whole-trace sums (the placement section) plan; the re-planning windows, smaller, do not.
    name = broken_plugin(
        "if loads.sum() < 1000:\n        raise RuntimeError('window too small')\n"
        "    return eplb.PolicyResult(eplb.Placement.contiguous(topology).phy2log, 'x')"
    )
    trace = tmp_path / "seq.npy"
    np.save(trace, np.full((6, 2, 16), 10))  # 320 tokens a step
    argv = [str(trace), "--slots", "20", "--gpus", "4", "--policies", name, "--replan-every", "2"]
    assert report.main(argv) == 1
    stdout, stderr = capsys.readouterr()
    assert stderr == (
        f"eplb-bench: error: policy {name!r} failed on trace(4 gpus) / {trace} (re-planning at step 0): "
        "RuntimeError: window too small\n"
    )
    assert f"| trace(4 gpus) | {trace} | {name} | 1.2500 |" in stdout  # its placement row, planned


def test_a_policy_missing_its_dependency_is_skipped_in_every_section(broken_plugin, tmp_path, capsys):
    name = broken_plugin("import eplb_no_such_dependency_xyz")
    trace = tmp_path / "seq.npy"
    np.save(trace, np.random.default_rng(1).integers(1, 100, (6, 2, 16)))
    out = tmp_path / "r.json"
    argv = [str(trace), "--slots", "20", "--gpus", "4", "--policies", f"{name},global", "--replan-every", "2"]
    argv += ["--json", str(out)]
    assert report.main(argv) == 0, capsys.readouterr().err
    rep = json.loads(out.read_text())
    assert [(r["policy"], r.get("skipped")) for r in rep["placement"]] == [
        ("none", None),
        (name, "No module named 'eplb_no_such_dependency_xyz'"),
        ("global", None),
    ]
    assert [r["policy"] for r in rep["replan"]] == ["none", "global"]
