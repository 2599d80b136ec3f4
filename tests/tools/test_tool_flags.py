"""Flags of `eplb place` and `eplb-bench` that disagree with each other or with the topology:
each error names the flags (or where a value came from), not the library's parameters, and no
flag given is silently left unused."""

import json

import numpy as np
import pytest

from eplb_bench import report
from eplb_tools import cli

SMALL = ["--synthetic", "zipf-1.0", "--scale", "small", "--policy", "global", "--effort", "fast"]


def _err(capsys, argv: list[str], tool=cli.main) -> str:
    assert tool(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [*SMALL, "--slots", "7"],
            "slots (7, --slots) must be >= experts (16, from --scale small): every expert needs at least one slot",
        ),
        (
            [*SMALL, "--gpus", "40"],
            "slots (20, from --scale small) must be a multiple of gpus (40, --gpus) so every gpu has the same",
        ),
        ([*SMALL, "--nodes", "3"], "gpus (4, from --scale small) must be a multiple of nodes (3, --nodes)"),
    ],
)
def test_place_topology_errors_name_the_flags(capsys, argv, message):
    err = _err(capsys, ["place", *argv])
    assert message in err and "num_" not in err


def test_place_topology_errors_name_the_trace_and_the_config(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.ones((2, 16)))
    err = _err(capsys, ["place", str(tmp_path / "t.npy"), "--slots", "10", "--gpus", "2"])
    assert "slots (10, --slots) must be >= experts (16, from the trace)" in err
    (tmp_path / "d.toml").write_text("[topology]\nlayers = 2\nexperts = 16\nslots = 20\ngpus = 4\n")
    err = _err(capsys, ["place", str(tmp_path / "t.npy"), "--topology", str(tmp_path / "d.toml"), "--gpus", "3"])
    assert f"slots (20, from {tmp_path / 'd.toml'}) must be a multiple of gpus (3, --gpus)" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slots", "20", "--gpus", "0"], "eplb-bench: error: --gpus must be a number >= 1, got 0\n"),
        (["--slots", "20", "--gpus", "4", "--nodes", "0"], "eplb-bench: error: --nodes must be a number >= 1, got 0\n"),
        (
            ["--slots", "20", "--gpus", "4", "--nodes", "3"],
            "eplb-bench: error: gpus (4, --gpus) must be a multiple of nodes (3, --nodes)\n",
        ),
    ],
)
def test_bench_trace_deployment_errors_name_the_flags(tmp_path, capsys, argv, message):
    np.save(tmp_path / "t.npy", np.ones((2, 1, 16)))
    assert _err(capsys, [str(tmp_path / "t.npy"), *argv], tool=report.main) == message


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["--scales", "small", "--slots", "99"], "--slots applies"),
        (["--quick", "--nodes", "2", "--groups", "4"], "--nodes, --groups apply"),
        (["--quick", "--topology", "d.toml"], "--topology applies"),
    ],
)
def test_bench_deployment_flags_without_trace_files_are_refused(capsys, argv, flags):
    err = _err(capsys, argv, tool=report.main)
    assert err == (
        f"eplb-bench: error: {flags} to trace files (the deployment they were recorded on); none was given, "
        "and the scales have their own (docs/scales.md)\n"
    )


def test_bench_flags_override_the_trace_topology_config(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.ones((2, 1, 16)))
    (tmp_path / "d.toml").write_text("[topology]\nlayers = 1\nexperts = 16\nslots = 20\ngpus = 4\n")
    argv = [str(tmp_path / "t.npy"), "--topology", str(tmp_path / "d.toml"), "--policies", "global"]
    assert report.main([*argv, "--slots", "32", "--gpus", "2", "--json", str(tmp_path / "r.json")]) == 0
    rows = json.loads((tmp_path / "r.json").read_text())["placement"]
    assert {r["scale"] for r in rows} == {"trace(2 gpus)"}  # not the config's 4 gpus, silently
    capsys.readouterr()
    err = _err(capsys, [*argv, "--gpus", "3"], tool=report.main)
    assert f"slots (20, from {tmp_path / 'd.toml'}) must be a multiple of gpus (3, --gpus)" in err


@pytest.mark.parametrize(("argv", "steps"), [(["--quick", "--replan-every", "16"], 16), (["--replan-every", "64"], 64)])
def test_bench_replan_every_that_never_replans_is_refused(capsys, argv, steps):
    err = _err(capsys, argv, tool=report.main)
    assert err == (
        f"eplb-bench: error: --replan-every must be below the {steps} steps of the drifting and shifting sequences "
        f"(every {steps} steps there would be no re-plan after the first plan), got {steps}\n"
    )


def test_bench_a_trace_too_short_to_replan_is_left_out_with_a_note(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.random.default_rng(0).integers(1, 100, (4, 1, 16)))
    argv = [str(tmp_path / "t.npy"), "--slots", "20", "--gpus", "4", "--policies", "global"]
    assert report.main(argv) == 0  # re-planning every 8 steps (the default) of 4
    captured = capsys.readouterr()
    assert "## re-planning" not in captured.out  # no row claiming 0 moves per re-plan
    assert (
        f"eplb-bench: note: {tmp_path / 't.npy'} has 4 steps, so re-planning every 8 never re-plans; it is left "
        "out of the re-planning section (--replan-every K below 4 includes it)"
    ) in captured.err
    assert report.main([*argv, "--replan-every", "2"]) == 0
    assert "| trace(4 gpus) | " + str(tmp_path / "t.npy") + " | global | 4 | 2 |" in capsys.readouterr().out


def test_bench_a_json_file_that_cannot_be_written_is_named_and_the_tables_are_kept(tmp_path, monkeypatch, capsys):
    np.save(tmp_path / "t.npy", np.ones((1, 1, 16)))
    target = tmp_path / "r.json"  # fine when checked before the run ...
    real = report.build_report

    def build(*args, **kwargs):
        target.mkdir()  # ... and a directory by the time the report is written
        return real(*args, **kwargs)

    monkeypatch.setattr(report, "build_report", build)
    argv = [str(tmp_path / "t.npy"), "--slots", "20", "--gpus", "4", "--policies", "global", "--json", str(target)]
    assert report.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"eplb-bench: error: --json {target}: cannot write it (Is a directory)\n"
    assert "| trace(4 gpus) | " in captured.out  # the run's tables are not lost


@pytest.mark.parametrize(
    ("argv", "flags"),
    [
        (["--workloads", "zipf-1.0"], "--workloads applies"),
        (["--workloads", "zipf-1.0", "--tokens-per-gpu", "8"], "--workloads, --tokens-per-gpu apply"),
    ],
)
def test_bench_synthetic_flags_with_trace_files_alone_are_refused(tmp_path, capsys, argv, flags):
    np.save(tmp_path / "t.npy", np.ones((1, 1, 16)))
    err = _err(capsys, [str(tmp_path / "t.npy"), "--slots", "20", "--gpus", "4", *argv], tool=report.main)
    assert err == (
        f"eplb-bench: error: {flags} to the synthetic scales, and trace files given alone are all the report "
        "covers: add --scales A,B (or --quick) to run them too\n"
    )


def test_an_npz_archive_of_no_arrays_is_named_as_one(tmp_path, capsys):
    np.savez(tmp_path / "none.npz")
    err = _err(capsys, ["place", str(tmp_path / "none.npz"), "--slots", "4", "--gpus", "2"])
    assert err == (
        f"eplb place: error: {tmp_path / 'none.npz'}: field 'counts': missing; expected an array named counts or "
        "logical_count (archive has: nothing)\n"
    )  # not "not an .npz archive (not a zip archive)"


def test_place_writes_a_bare_phy2log_to_the_file_it_names(tmp_path, capsys):
    out = tmp_path / "p.NPY"
    assert cli.main(["place", *SMALL, "--out", str(out)]) == 0
    assert f"wrote phy2log [1, 20] to {out}" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.NPY"]  # not p.NPY.npy
    assert np.load(out).shape == (1, 20)


def test_a_previous_npy_that_is_no_placement_is_named(tmp_path, capsys):
    np.save(tmp_path / "floats.npy", np.arange(20, dtype=np.float64)[None] % 16)
    err = _err(capsys, ["place", *SMALL, "--previous", str(tmp_path / "floats.npy")])
    assert err == (
        f"eplb place: error: --previous {tmp_path / 'floats.npy'}: not a placement of this topology: "
        "phy2log must hold integers, got dtype float64\n"
    )
    np.save(tmp_path / "ids.npy", np.arange(20)[None] + 100)
    err = _err(capsys, ["place", *SMALL, "--previous", str(tmp_path / "ids.npy")])
    assert err.startswith(f"eplb place: error: --previous {tmp_path / 'ids.npy'}: not a placement of this topology: ")


def test_a_binary_trace_read_as_text_says_what_it_is(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.ones((1, 16)))
    err = _err(capsys, ["place", str(tmp_path / "t.npy"), "--slots", "20", "--gpus", "4", "--trace-format", "csv"])
    assert err == f"eplb place: error: {tmp_path / 't.npy'}: not a UTF-8 text file (it is a .npy array)\n"
    np.savez(tmp_path / "d.npz", counts=np.ones((1, 16)))
    err = _err(capsys, ["place", str(tmp_path / "t.npy"), "--topology", str(tmp_path / "d.npz")])
    assert err == f"eplb place: error: {tmp_path / 'd.npz'}: not a UTF-8 text file (it is an .npz archive)\n"


def test_place_reports_the_gap_to_the_bound_and_the_search(tmp_path, capsys):
    out = tmp_path / "p.json"
    flags = ["place", "--synthetic", "zipf-1.5", "--layers", "3", "--experts", "32", "--slots", "48", "--gpus", "24"]
    assert cli.main([*flags, "--policy", "global", "--out", str(out)]) == 0
    report_lines = capsys.readouterr().out.splitlines()
    stats = json.loads(out.read_text())["stats"]
    gap = np.array(stats["imbalance"]) / np.array(stats["imbalance_lb"]) - 1
    within = int((gap <= 0.001 + 1e-12).sum())
    assert (
        f"gap to the bound:              mean {100 * gap.mean():.2f} %  worst {100 * gap.max():.2f} %; "
        f"{within} of 3 layers within 0.1 %"
    ) in report_lines
    assert any(line.startswith("search after the first plan:   ") for line in report_lines) == (within < 3)
    assert cli.main([*flags, "--policy", "deepseek"]) == 0  # no search, no gap target: the gap alone
    assert any(
        line.startswith("gap to the bound:") and "within" not in line for line in capsys.readouterr().out.splitlines()
    )


def test_bench_a_name_given_twice_runs_once(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--scales", "small,small", "--workloads", "zipf-1.0, zipf-1.0", "--policies", "global,global"]
    argv += ["--tokens-per-gpu", "8", "--replan-every", "4", "--json", str(out)]
    assert report.main(argv) == 0
    rep = json.loads(out.read_text())
    assert [(r["scale"], r["workload"], r["policy"]) for r in rep["placement"]] == [
        ("small", "zipf-1.0", "none"),
        ("small", "zipf-1.0", "global"),
    ]
    assert [(r["sequence"], r["policy"]) for r in rep["replan"]] == [
        ("drift-0.05", "none"),
        ("drift-0.05", "global"),
        ("shift", "none"),
        ("shift", "global"),
    ]


def test_bench_an_infinite_ilp_time_limit_is_refused(capsys):
    err = _err(capsys, ["--quick", "--ilp-time-limit", "inf"], tool=report.main)
    assert (
        err
        == "eplb-bench: error: --ilp-time-limit must be a positive number of seconds, got inf (not a finite number)\n"
    )
