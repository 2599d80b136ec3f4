"""eplb place: trace in, placement file out, short report; synthetic mode still works."""

import json
import re
import subprocess
import sys

import numpy as np

import eplb
from eplb import traces
from eplb.workloads import drift, make_loads
from eplb_tools import cli
from eplb_tools import io as eio

TOPO = eplb.Topology(2, 16, 20, 4, 2, 4)


def _trace(tmp_path):
    seq = np.round(drift(make_loads("zipf-1.0", TOPO), 0.3, 5, seed=1))
    path = tmp_path / "trace.json"
    eio.write_trace(path, traces.LoadTrace(seq), "native")
    return path, seq


def test_place_from_a_trace_window_writes_each_format(tmp_path, capsys):
    path, seq = _trace(tmp_path)
    flags = ["--slots", "20", "--gpus", "4", "--nodes", "2", "--groups", "4", "--policy", "global", "--window", "2"]
    expect = eplb.rebalance(seq[-2:].sum(axis=0), TOPO, "global")
    for fmt, name in (("native", "p.json"), ("sglang", "s.json"), ("vllm", "v.npz"), ("listing", "l.txt")):
        assert cli.main(["place", str(path), *flags, "--format", fmt, "--out", str(tmp_path / name)]) == 0
        assert eio.read_placement(tmp_path / name, num_gpus=4, num_nodes=2, num_groups=4) == expect.placement
    out = capsys.readouterr().out
    assert "last 2 of 5 steps" in out
    assert f"imbalance after:               mean {expect.mean_imbalance:.4f}" in out
    rep = (expect.logcnt > 1).sum(axis=1)
    assert f"replicated experts per layer: min {rep.min()}  mean {rep.mean():.1f}  max {rep.max()}" in out
    stats = json.loads((tmp_path / "p.json").read_text())["stats"]
    assert stats["imbalance"] == expect.imbalance.tolist()


def test_place_reads_topology_config_and_decay(tmp_path, capsys):
    path, seq = _trace(tmp_path)
    cfg = tmp_path / "topo.toml"
    cfg.write_text("layers = 2\nexperts = 16\nslots = 20\ngpus = 4\nnodes = 2\ngroups = 4\n")
    assert (
        cli.main(
            [
                "place",
                str(path),
                "--topology",
                str(cfg),
                "--half-life",
                "1",
                "--policy",
                "global",
                "--out",
                str(tmp_path / "p.json"),
            ]
        )
        == 0
    )
    weights = 0.5 ** np.arange(4, -1, -1)
    expect = eplb.rebalance(np.tensordot(weights, seq, axes=1), TOPO, "global")
    assert eio.read_placement(tmp_path / "p.json") == expect.placement
    assert "decay half-life 1.0 steps" in capsys.readouterr().out


def test_place_synthetic_mode_and_errors(tmp_path, capsys):
    assert cli.main(["place", "--synthetic", "zipf-1.0", "--scale", "small", "--out", str(tmp_path / "p.npy")]) == 0
    assert np.load(tmp_path / "p.npy").shape == (1, 20)
    path, _ = _trace(tmp_path)
    assert cli.main(["place", str(path), "--gpus", "4"]) == 2
    assert "topology incomplete: give --slots" in capsys.readouterr().err
    assert cli.main(["place", str(path), "--layers", "3", "--slots", "20", "--gpus", "4"]) == 2
    assert "the trace has 2 layers x 16 experts but the topology says 3 x 16" in capsys.readouterr().err


def test_place_from_a_vllm_window_recorded_under_a_placement(tmp_path, capsys):
    loads = make_loads("zipf-1.0", TOPO)
    old = eplb.rebalance(loads, TOPO, "global").placement
    # Physical counts: each expert's tokens split evenly over its replicas.
    window = np.stack([loads / old.logcnt] * 3)
    phys = np.take_along_axis(window, np.broadcast_to(old.phy2log, (3, *old.phy2log.shape)), axis=2)
    np.savez(tmp_path / "w.npz", expert_load_window=phys)
    eio.write_placement(tmp_path / "old.json", old, "sglang")
    flags = [
        "--slots",
        "20",
        "--gpus",
        "4",
        "--nodes",
        "2",
        "--groups",
        "4",
        "--policy",
        "global",
        "--out",
        str(tmp_path / "new.json"),
    ]
    assert cli.main(["place", str(tmp_path / "w.npz"), "--recorded-under", str(tmp_path / "old.json"), *flags]) == 0
    expect = eplb.rebalance(3 * loads, TOPO, "global")
    assert np.allclose(eio.read_trace(tmp_path / "w.npz", phy2log=old.phy2log).window(), 3 * loads)
    assert eio.read_placement(tmp_path / "new.json") == expect.placement
    assert cli.main(["place", str(tmp_path / "w.npz"), *flags]) == 2
    assert "w.npz: field 'physical_to_logical': missing" in capsys.readouterr().err


def test_place_with_previous_replans_migration_aware_and_reports_transfers(tmp_path, capsys):
    from eplb.transfer import transfer_plan, transfer_schedule

    path, seq = _trace(tmp_path)
    old = eplb.rebalance(seq[:3].sum(axis=0), TOPO, "global").placement
    eio.write_placement(tmp_path / "old.json", old, "native")
    flags = ["--slots", "20", "--gpus", "4", "--nodes", "2", "--groups", "4", "--policy", "global", "--window", "2"]
    args = [*flags, "--previous", str(tmp_path / "old.json"), "--tolerance", "0.05", "--expert-bytes", "2e6"]
    assert cli.main(["place", str(path), *args, "--out", str(tmp_path / "new.json")]) == 0
    expect = eplb.rebalance(seq[-2:].sum(axis=0), TOPO, "global", previous=old, tolerance=0.05)
    assert eio.read_placement(tmp_path / "new.json") == expect.placement
    out = capsys.readouterr().out
    before = eplb.imbalance(eplb.gpu_loads(seq[-2:].sum(axis=0), old))
    assert f"imbalance before (previous):   mean {before.mean():.4f}" in out
    assert f"moves: {expect.total_moves} of 40 slots" in out
    tp = transfer_plan(old, expect.placement, TOPO, expert_bytes=2e6)
    assert f"transfers: {tp.num_transfers} (" in out
    assert f"per gpu sent max {tp.sent_bytes.max() / 1e6:.1f} MB" in out
    sched = transfer_schedule(old, expect.placement, TOPO, expert_bytes=2e6)
    assert f"schedule: {sched.total_rounds} rounds over {TOPO.num_layers} layers" in out
    assert f"predicted {sched.predicted_seconds:.3f} s" in out
    # A fresh plan of the same loads moves at least as many slots.
    assert expect.total_moves <= int(
        eplb.moves(old, eplb.rebalance(seq[-2:].sum(axis=0), TOPO, "global").placement).sum()
    )
    # A move budget below what the tolerance needs holds the re-plan to it and says so.
    budget = expect.total_moves // 2
    assert cli.main(["place", str(path), *args[:-2], "--tolerance", "0", "--max-moves", str(budget)]) == 0
    out = capsys.readouterr().out
    held = eplb.rebalance(seq[-2:].sum(axis=0), TOPO, "global", previous=old, tolerance=0.0, max_moves=budget)
    assert f"moves: {held.total_moves} of 40 slots" in out and held.total_moves <= budget
    assert f"note: move budget (max_moves={budget}, max_layer_moves=None) held the re-plan" in out


def test_place_previous_flags_are_checked(tmp_path, capsys):
    path, _ = _trace(tmp_path)
    flags = ["--slots", "20", "--gpus", "4", "--nodes", "2", "--groups", "4"]
    assert cli.main(["place", str(path), *flags, "--tolerance", "0.02"]) == 2
    assert "give --previous PLACEMENT" in capsys.readouterr().err
    np.save(tmp_path / "bad.npy", np.zeros((2, 16), dtype=np.int32))
    assert cli.main(["place", str(path), *flags, "--previous", str(tmp_path / "bad.npy")]) == 2
    assert "the placement is [2, 16] (layers x slots) but the topology needs [2, 20]" in capsys.readouterr().err
    old = eplb.Placement.contiguous(TOPO)
    np.save(tmp_path / "old.npy", old.phy2log)
    assert cli.main(["place", str(path), *flags, "--previous", str(tmp_path / "old.npy"), "--tolerance", "-1"]) == 2
    assert "tolerance must be" in capsys.readouterr().err
    assert cli.main(["place", str(path), *flags, "--previous", str(tmp_path / "old.npy"), "--max-moves", "-2"]) == 2
    assert "--max-moves must be a number of slots >= 0, got -2" in capsys.readouterr().err
    assert cli.main(["place", str(path), *flags, "--max-layer-moves", "3"]) == 2
    assert "give --previous PLACEMENT" in capsys.readouterr().err


def test_place_takes_effort_budget_time_limit_and_workers(tmp_path, capsys):
    path, seq = _trace(tmp_path)
    flags = ["--slots", "20", "--gpus", "4", "--nodes", "2", "--groups", "4", "--policy", "global"]
    loads = seq.sum(axis=0)
    for extra, options in (
        (["--effort", "fast"], {"effort": "fast"}),
        (["--effort", "high", "--workers", "2"], {"effort": "high"}),
        (["--work-budget", "0"], {"work_budget": 0}),
    ):
        out = tmp_path / "p.json"
        assert cli.main(["place", str(path), *flags, *extra, "--out", str(out)]) == 0
        expect = eplb.rebalance(loads, TOPO, "global", **options)
        assert eio.read_placement(out, num_gpus=4, num_nodes=2, num_groups=4) == expect.placement
    assert cli.main(["place", str(path), *flags, "--time-limit", "5"]) == 0
    capsys.readouterr()
    assert cli.main(["place", str(path), *flags[:-1], "deepseek", "--effort", "high"]) == 2
    assert (
        "--effort does not apply to --policy deepseek; it applies to auto, global, hierarchical"
        in capsys.readouterr().err
    )


def test_place_names_its_own_flags_in_errors(tmp_path, capsys):
    path, _ = _trace(tmp_path)
    flags = ["--slots", "20", "--gpus", "4", "--nodes", "2", "--groups", "4"]
    assert cli.main(["place", str(path), *flags, "--window", "0"]) == 2
    assert "--window must be a number of steps >= 1, got 0" in capsys.readouterr().err
    missing = tmp_path / "no" / "such" / "p.json"
    assert cli.main(["place", str(path), *flags, "--out", str(missing)]) == 2
    assert f"directory {missing.parent} does not exist" in capsys.readouterr().err
    assert not missing.parent.exists()


def test_place_time_limit_caps_a_whole_replan_end_to_end(tmp_path):
    # The real command in its own process. The old re-plan searched with a limit of its own
    # after the first plans and repaired the previous placement with none: a 0.2 s limit took
    # 0.99 s of 1.17 s here. Timing-free on a loaded machine: the capped run against the free one.
    def place(*flags: str) -> str:
        cmd = [sys.executable, "-m", "eplb_tools.cli", "place", "--scale", "v3-prefill", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return done.stdout + done.stderr

    def solve_seconds(report: str) -> float:
        return float(re.search(r"solve time: ([0-9.]+) ms", report).group(1)) / 1e3

    prev = tmp_path / "prev.npy"
    place("--synthetic", "zipf-1.0", "--effort", "fast", "--out", str(prev))
    free = place("--synthetic", "zipf-1.5", "--previous", str(prev))
    capped = place("--synthetic", "zipf-1.5", "--previous", str(prev), "--time-limit", "0.2")
    assert "note: time_limit" in capped and "note: time_limit" not in free
    assert solve_seconds(capped) < 0.5 * solve_seconds(free)


def test_version_flag_and_the_package_version_are_the_installed_release(capsys):
    from importlib.metadata import version

    installed = version("eplb")
    assert eplb.__version__ == installed and "__version__" in dir(eplb)
    try:
        cli.main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out == f"eplb {installed}\n"
    # The console script itself, as a user types it.
    out = subprocess.run([sys.executable, "-m", "eplb_tools.cli", "--version"], capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (0, f"eplb {installed}\n")


def test_a_checkout_that_was_never_installed_has_a_pep440_version(monkeypatch):
    from importlib.metadata import PackageNotFoundError

    from eplb import survivor_rules

    def missing(name: str) -> str:
        raise PackageNotFoundError(name)

    monkeypatch.setattr(survivor_rules, "version", missing)
    assert survivor_rules.eplb_version() == "0+unknown"


def test_eplb_bench_is_the_eplb_bench_command(capsys):
    try:
        cli.main(["bench", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    assert "usage: eplb-bench" in capsys.readouterr().out
    try:
        code = cli.main(["bench", "--scales", "no-such-scale"])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "no-such-scale" in err, err
