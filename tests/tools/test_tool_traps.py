"""What a new user trips on in `eplb place` and `eplb-bench`: each gives a named error (exit
2) or does what the flag says, never a traceback."""

import json
import pickle
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import eplb
from eplb import formats
from eplb.workloads import SCALES, make_loads
from eplb_bench import report
from eplb_tools import cli
from eplb_tools.pipes import BROKEN_PIPE_STATUS, INTERRUPTED_STATUS

ROOT = Path(__file__).resolve().parents[2]
SMALL_TOPO = ["--scale", "small", "--policy", "global"]
SMALL = [*SMALL_TOPO, "--synthetic", "lognormal-1.0"]


@pytest.mark.parametrize("name", ["t.npy", "t.npz", "t.json", "t.csv", "t.pt"])
def test_an_empty_trace_file_is_named(tmp_path, capsys, name):
    (tmp_path / name).touch()
    assert cli.main(["place", str(tmp_path / name), "--slots", "20", "--gpus", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eplb place: error: {tmp_path / name}: ")
    assert "empty" in err and "Traceback" not in err


def test_a_cut_short_or_binary_file_is_named(tmp_path, capsys):
    np.save(tmp_path / "full.npy", np.ones((2, 16)))
    (tmp_path / "cut.npy").write_bytes((tmp_path / "full.npy").read_bytes()[:100])
    assert cli.main(["place", str(tmp_path / "cut.npy"), "--slots", "20", "--gpus", "4"]) == 2
    assert f"{tmp_path / 'cut.npy'}: not a readable .npy array (" in capsys.readouterr().err
    (tmp_path / "b.csv").write_bytes(b"\xff\xfe\x00layer")
    assert cli.main(["place", str(tmp_path / "b.csv"), "--slots", "20", "--gpus", "4"]) == 2
    assert f"{tmp_path / 'b.csv'}: not a UTF-8 text file (byte 0" in capsys.readouterr().err
    (tmp_path / "prev.npy").touch()
    assert cli.main(["place", *SMALL, "--previous", str(tmp_path / "prev.npy")]) == 2
    assert f"{tmp_path / 'prev.npy'}: the file is empty; expected a .npy array" in capsys.readouterr().err


def _quiet(proc: subprocess.Popen) -> str:
    err = proc.stderr.read().decode()
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err
    return err


def test_a_closed_pipe_ends_eplb_place_quietly():
    # The reader is gone before the first write: every write fails.
    cmd = [sys.executable, "-m", "eplb_tools.cli", "place", *SMALL]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()
    _quiet(proc)
    assert proc.wait(timeout=120) == BROKEN_PIPE_STATUS
    # `eplb place ... --format listing | head -1`: 1,856 lines, more than a pipe holds. The
    # listing is one write, which CPython may end early without an error when the reader goes.
    cmd = [
        sys.executable,
        "-m",
        "eplb_tools.cli",
        "place",
        "--scale",
        "v3-prefill",
        "--synthetic",
        "lognormal-1.0",
        "--policy",
        "global",
        "--effort",
        "fast",
        "--format",
        "listing",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    first = proc.stdout.readline()
    proc.stdout.close()
    assert "imbalance after:" in _quiet(proc)
    assert proc.wait(timeout=120) in (0, BROKEN_PIPE_STATUS)
    assert first.startswith(b"# eplb placement listing, format 1: layers=58")


def test_a_closed_pipe_ends_eplb_bench_quietly():
    cmd = [
        sys.executable,
        "-m",
        "eplb_bench.report",
        "--quick",
        "--scales",
        "small",
        "--workloads",
        "zipf-1.0",
        "--policies",
        "global",
        "--tokens-per-gpu",
        "8",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()  # the reader is gone before the report is printed
    _quiet(proc)
    assert proc.wait(timeout=300) == BROKEN_PIPE_STATUS


def test_format_and_out_suffix_must_agree_before_planning(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli.main(["place", *SMALL, "--format", "vllm", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert (
        "a vllm placement is written as a .npz file, not .json; name it p.npz or choose a .json format (.json native, .json sglang)"
        in captured.err
    )
    assert captured.out == "" and not out.exists()  # refused before planning
    assert cli.main(["place", *SMALL, "--format", "listing", "--out", str(tmp_path / "p.npy")]) == 2
    assert "name it p.txt" in capsys.readouterr().err
    assert cli.main(["place", *SMALL, "--out", str(tmp_path / "p.yaml")]) == 2
    assert "cannot tell the placement format from suffix '.yaml'; use .json .npz .txt" in capsys.readouterr().err
    assert cli.main(["place", *SMALL, "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: is a directory" in capsys.readouterr().err
    assert cli.main(["place", *SMALL, "--format", "vllm"]) == 2
    assert "give --out FILE.npz" in capsys.readouterr().err


def test_a_format_without_out_prints_the_placement_and_sends_the_report_to_stderr(capsys):
    expect = eplb.rebalance(make_loads("lognormal-1.0", SCALES["small"]), SCALES["small"], "global")
    assert cli.main(["place", *SMALL, "--format", "listing"]) == 0
    captured = capsys.readouterr()
    assert formats.from_listing(captured.out) == expect.placement
    assert "imbalance after:" in captured.err and "imbalance after:" not in captured.out
    assert cli.main(["place", *SMALL, "--out", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert formats.from_native(doc) == expect.placement and doc["stats"]["imbalance"] == expect.imbalance.tolist()
    assert cli.main(["place", *SMALL]) == 0
    assert "placement not written: give --out FILE" in capsys.readouterr().out


def test_ilp_time_limit_is_one_limit_with_progress_and_a_note(tmp_path, capsys):
    # 4 layers whose CP-SAT models take far longer to build than 0.2 s / 4: every layer keeps
    # the global plan, and the note says the ILP found nothing better.
    flags = ["--layers", "4", "--experts", "64", "--slots", "80", "--gpus", "16", "--synthetic", "zipf-1.0"]
    out = tmp_path / "p.json"
    assert (
        cli.main(
            [
                "place",
                *flags,
                "--policy",
                "ilp",
                "--time-limit",
                "0.2",
                "--workers",
                "1",
                "--progress",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "note: ilp: found nothing better than the global policy's placement on 4 of 4 layers" in captured.out
    assert (
        "hint: 4 layers ran out of time (--time-limit 0.2 s over 4 layers) before CP-SAT finished building"
        in captured.out
    )
    # Not a terminal: plain lines, from the start with --progress.
    # (the seconds are wall time: 0 or 1 on a loaded machine, so they are not asserted)
    assert re.search(r"^eplb place: ilp: layers 4/4 \(100 %\), \d+ s$", captured.err, re.M), captured.err
    topo = eplb.Topology(4, 64, 80, 16)
    assert (
        eplb.Placement(np.array(json.loads(out.read_text())["phy2log"]), topo)
        == eplb.rebalance(make_loads("zipf-1.0", topo), topo, "global").placement
    )
    assert cli.main(["place", *flags, "--policy", "global", "--progress"]) == 0
    assert re.search(
        r"^eplb place: search: layers 4/4 \(100 %\), \d+ s\neplb place: planned in \d+ s$",
        capsys.readouterr().err,
        re.M,
    )
    assert cli.main(["place", *flags, "--policy", "global", "--time-limit", "0"]) == 2
    assert "--time-limit must be a number of seconds > 0, got 0.0" in capsys.readouterr().err


def test_without_a_terminal_or_progress_flag_no_bar_is_drawn(capsys):
    assert cli.main(["place", *SMALL]) == 0
    assert capsys.readouterr().err == ""


def test_bench_unknown_policy_names_the_registered_ones(capsys):
    assert report.main(["--quick", "--scales", "small", "--policies", "greedy,global"]) == 2
    err = capsys.readouterr().err
    assert f"--policies: unknown 'greedy'; registered policies: {', '.join(eplb.policies())}" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scales", "smal"], "--scales: unknown 'smal'; known: v3-prefill"),
        (["--workloads", "zipf"], "--workloads: unknown 'zipf'; known:"),
        (
            ["--scales", "small", "--layer", "3"],
            "--layer must be between 0 and 0 (the per-step scale small has 1 layer), got 3",
        ),
        (["--ilp-time-limit", "0"], "--ilp-time-limit must be a positive number of seconds, got 0"),
        (["--json", "/no/such/dir/r.json"], "--json /no/such/dir/r.json: directory /no/such/dir does not exist"),
    ],
)
def test_bench_bad_flags_are_named_before_the_run(capsys, argv, message):
    assert report.main(["--quick", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tokens-per-gpu", "x"], "argument --tokens-per-gpu: expected comma-separated integers >= 1, got 'x'"),
        (["--replan-every", "0"], "argument --replan-every: expected one integer >= 1, got '0'"),
        (["--policies", ","], "argument --policies: expected comma-separated names, got ','"),
    ],
)
def test_bench_malformed_values_are_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        report.main(["--quick", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_bench_scales_rule_every_section(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = [
        "--quick",
        "--scales",
        "small",
        "--workloads",
        "zipf-1.0",
        "--policies",
        "global, ilp",
        "--tokens-per-gpu",
        "8",
        "--ilp-time-limit",
        "1",
        "--json",
        str(out),
    ]
    assert report.main(argv) == 0
    rep = json.loads(out.read_text())
    assert {r["policy"] for r in rep["placement"]} == {"none", "global", "ilp"}
    for section in ("placement", "replan", "steps"):
        assert rep[section] and {r["scale"] for r in rep[section]} == {"small"}, section
    assert "| small | drift-0.05 | global |" in capsys.readouterr().out


def test_bench_ilp_asked_for_at_a_model_scale_says_why_it_is_skipped():
    rows = [report.plan_case(report.Case("v3-prefill", "w", SCALES["v3-prefill"], np.ones((58, 256))), "ilp")[0]]
    assert rows[0]["skipped"] == "ilp runs on the small scale and trace files only"
    assert report.policies_for(SCALES["v3-prefill"], "v3-prefill", ("global", "ilp")) == ("none", "global", "ilp")


def test_bench_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as exc:
        report.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and "**" not in text and ":func:" not in text
    assert "re-planning   imbalance over a drifting" in text and "docs/scales.md" in text


def test_docs_the_tools_point_at_are_in_the_repo(capsys):
    texts = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "bench").glob("*.py")),
        *sorted((ROOT / "eplb").rglob("*.py")),
    ]
    cited = {m for path in texts for m in re.findall(r"docs/[\w.-]+\.md", path.read_text())}
    assert "docs/scales.md" in cited
    assert [c for c in sorted(cited) if not (ROOT / c).is_file()] == []
    assert not [p.name for p in texts if "BENCHMARKS.md" in p.read_text()]
    with pytest.raises(SystemExit) as exc:  # eplb place --help, as a user reads it
        cli.main(["place", "--help"])
    assert exc.value.code == 0
    scale_help = capsys.readouterr().out
    assert "--scale" in scale_help and "docs/scales.md" in scale_help
    # A command the docs say the README runs must be in the README.
    readme = (ROOT / "README.md").read_text()
    claimed = [
        line.split("#")[0].strip()
        for path in texts
        for line in path.read_text().splitlines()
        if "what the README runs" in line
    ]
    assert [c for c in claimed if c not in readme] == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--half-life", "0"], "--half-life must be a number of steps > 0, got 0.0"),
        (["--workers", "0"], "--workers must be a number of processes >= 1, got 0"),
        (["--work-budget", "-1"], "--work-budget must be a number of work units >= 0, got -1.0"),
        (["--gpus", "0"], "--gpus must be a number >= 1, got 0"),
        (["--seed", "3"], "--seed applies to synthetic workloads, not to a TRACE"),
        (["--synthetic", "zipf-1.0"], "--synthetic applies to synthetic workloads, not to a TRACE"),
    ],
)
def test_place_numeric_and_mode_flags_are_named(tmp_path, capsys, argv, message):
    np.save(tmp_path / "t.npy", np.ones((1, 16)))
    assert cli.main(["place", str(tmp_path / "t.npy"), *SMALL_TOPO, *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[], ["--scale", "small"], ["--slots", "20", "--gpus", "4", "--seed", "1"]])
def test_place_without_a_trace_or_a_workload_says_what_it_needs(tmp_path, capsys, argv):
    out = tmp_path / "p.json"
    assert cli.main(["place", *argv, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert (
        "eplb place: error: nothing to plan: give a TRACE file, or --synthetic NAME for a built-in workload (zipf-0.5, "
        in captured.err
    )
    assert "e.g. eplb place --synthetic lognormal-1.0 --scale v3-prefill --out p.json" in captured.err
    assert captured.out == "" and not out.exists()  # refused before planning


def test_place_with_only_a_workload_plans_it_at_v3_prefill(capsys):
    assert cli.main(["place", "--synthetic", "zipf-1.0", "--policy", "global", "--effort", "fast"]) == 0
    out = capsys.readouterr().out
    assert "loads: synthetic zipf-1.0 (seed 0)" in out and f"topology: {SCALES['v3-prefill']}" in out


def test_trace_flags_without_a_trace_are_refused(capsys):
    assert cli.main(["place", *SMALL, "--topology", "t.toml"]) == 2
    assert "give one of --scale NAME and --topology CONFIG" in capsys.readouterr().err
    assert cli.main(["place", *SMALL, "--window", "3", "--trace-format", "csv"]) == 2
    assert "--window, --trace-format apply to a TRACE file; none was given" in capsys.readouterr().err
    assert cli.main(["place", *SMALL, "--seed", "-1"]) == 2
    assert "--seed must be an integer >= 0, got -1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--window", "0"], "--window applies to a TRACE file; none was given"),
        (["--half-life", "-2"], "--half-life applies to a TRACE file; none was given"),
        (
            ["--window", "0", "--recorded-under", "p.json"],
            "--window, --recorded-under apply to a TRACE file; none was given",
        ),
    ],
)
def test_a_trace_flag_without_a_trace_is_refused_for_that_before_its_range(capsys, argv, message):
    # --window 0 got the range error ("--window must be a number of steps >= 1"), as if a
    # window of 1 would have done.
    assert cli.main(["place", *SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "must be" not in err


def test_bench_on_trace_files_alone_reports_only_them(tmp_path, capsys):
    topo = eplb.Topology(2, 16, 20, 4, 1, 1)
    seq = np.round(np.stack([make_loads("zipf-1.0", topo, seed) for seed in range(4)]))
    np.save(tmp_path / "seq.npy", seq)
    out = tmp_path / "r.json"
    argv = [
        str(tmp_path / "seq.npy"),
        "--slots",
        "20",
        "--gpus",
        "4",
        "--policies",
        "global",
        "--replan-every",
        "2",
        "--json",
        str(out),
    ]
    assert report.main(argv) == 0
    rep = json.loads(out.read_text())
    assert {r["scale"] for r in rep["placement"]} == {"trace(4 gpus)"}
    assert {(r["sequence"], r["policy"]) for r in rep["replan"]} == {
        (str(tmp_path / "seq.npy"), p) for p in ("none", "global")
    }
    assert rep["steps"] == []
    assert report.main(["--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path}: is a directory" in capsys.readouterr().err
    assert report.main(["--plots", str(tmp_path / "seq.npy")]) == 2
    assert f"--plots {tmp_path / 'seq.npy'}: is a file; give a directory" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_stops_a_long_ilp_run_quietly(tmp_path):
    # CP-SAT's own SIGINT handler used to end only the current layer's search, so Ctrl-C was
    # swallowed and the run went on to the next layer. 3 s in, layer 0's model (built in
    # about a second) is being solved, for up to 10 s.
    out = tmp_path / "p.json"
    cmd = [
        sys.executable,
        "-m",
        "eplb_tools.cli",
        "place",
        "--policy",
        "ilp",
        "--layers",
        "3",
        "--experts",
        "64",
        "--slots",
        "80",
        "--gpus",
        "16",
        "--synthetic",
        "zipf-1.0",
        "--workers",
        "1",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stderr.readline().startswith(b"eplb place: ilp builds and solves one CP-SAT model per layer (3 layers")
    time.sleep(3.0)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == INTERRUPTED_STATUS
    assert "eplb place: interrupted; nothing written" in err and "Traceback" not in err
    assert not out.exists()


def test_place_without_tqdm_still_plans_ilp_and_shows_plain_lines_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the bench extra not installed
    monkeypatch.setattr(cli, "_is_terminal", lambda: True)
    flags = ["--layers", "1", "--experts", "4", "--slots", "4", "--gpus", "2", "--synthetic", "zipf-1.0"]
    assert cli.main(["place", *flags, "--policy", "ilp", "--time-limit", "5", "--workers", "1", "--progress"]) == 0
    captured = capsys.readouterr()
    assert "policy ilp -> ilp" in captured.out
    assert "eplb place: ilp: layers 1/1 (100 %)" in captured.err and "|" not in captured.err
    assert cli.main(["place", *flags, "--policy", "global", "--progress"]) == 0
    assert "eplb place: search: layers 1/1 (100 %)" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".json", ".txt"])
def test_previous_planned_for_another_topology_is_refused(tmp_path, capsys, suffix):
    # Native and listing files record their topology: a re-plan under other flags is refused.
    flags = ["--synthetic", "zipf-1.0", "--layers", "4", "--experts", "32", "--slots", "64"]
    p0 = tmp_path / f"p0{suffix}"
    assert cli.main(["place", *flags, "--gpus", "32", "--out", str(p0)]) == 0
    capsys.readouterr()
    assert cli.main(["place", *flags, "--gpus", "16", "--nodes", "2", "--previous", str(p0)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"eplb place: error: --previous {p0}: the placement was planned for 32 gpus, 1 node but the flags give "
        "16 gpus, 2 nodes; re-plan with the topology in service (--gpus, --nodes) or plan afresh without --previous\n"
    )
    assert cli.main(["place", *flags, "--gpus", "32", "--previous", str(p0)]) == 0


def test_recorded_under_is_refused_where_it_does_not_apply(tmp_path, capsys):
    topo = SCALES["small"]
    loads = make_loads("zipf-1.0", topo)
    plan = eplb.rebalance(loads, topo, "global").placement
    np.save(tmp_path / "map.npy", plan.phy2log)
    other = eplb.Placement.contiguous(topo).phy2log
    flags = ["--recorded-under", str(tmp_path / "map.npy"), *SMALL_TOPO]
    # Logical traces: nothing to map.
    np.save(tmp_path / "t.npy", loads)
    (tmp_path / "t.json").write_text(json.dumps({"counts": loads.tolist()}))
    for name, kind in (("t.npy", "npy"), ("t.json", "json")):
        assert cli.main(["place", str(tmp_path / name), *flags]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / name}: --recorded-under maps a vLLM window of physical counts" in err
        assert f"this is a {kind} trace of logical (per-expert) counts: drop --recorded-under" in err
    # A vLLM archive with its own map: one that disagrees is refused, the same one is fine.
    phys = np.take_along_axis(loads / plan.logcnt, plan.phy2log, axis=1)[None]
    np.savez(tmp_path / "w.npz", expert_load_window=phys, physical_to_logical=other)
    assert cli.main(["place", str(tmp_path / "w.npz"), *flags]) == 2
    assert "w.npz: the archive has its own physical_to_logical" in capsys.readouterr().err
    np.savez(tmp_path / "w.npz", expert_load_window=phys, physical_to_logical=plan.phy2log)
    assert cli.main(["place", str(tmp_path / "w.npz"), *flags]) == 0


def _err(capsys, argv: list[str], tool=cli.main) -> str:
    assert tool(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_place_messages_name_the_flag(tmp_path, capsys):
    loads = make_loads("zipf-1.0", SCALES["small"])
    np.save(tmp_path / "one.npy", loads[None])
    err = _err(capsys, ["place", str(tmp_path / "one.npy"), *SMALL_TOPO, "--window", "2"])
    assert err == "eplb place: error: --window must be between 1 and the trace's 1 step, got 2\n"
    prev = tmp_path / "p.json"
    assert cli.main(["place", *SMALL, "--out", str(prev)]) == 0
    capsys.readouterr()
    err = _err(capsys, ["place", *SMALL, "--previous", str(prev), "--expert-bytes", "inf"])
    assert err == "eplb place: error: --expert-bytes must be a number of bytes > 0, got inf (not a finite number)\n"
    flags = ["place", "--synthetic", "zipf-1.0", "--scale", "small", "--previous", str(prev)]
    err = _err(capsys, [*flags, "--policy", "deepseek", "--max-moves", "100"])
    assert (
        err
        == "eplb place: error: --max-moves does not apply to --policy deepseek; it applies to auto, global, hierarchical\n"
    )
    err = _err(capsys, [*flags, "--policy", "deepseek", "--tolerance", "0.1", "--effort", "fast"])
    assert err.startswith("eplb place: error: --tolerance, --effort do not apply to --policy deepseek; they apply to")


def test_a_trace_of_the_wrong_format_says_what_it_is(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    loads = make_loads("zipf-1.0", SCALES["small"])
    np.save(tmp_path / "t.npy", loads)
    np.savez(tmp_path / "t.npz", counts=loads)
    torch.save({"x": np.ones(3)}, tmp_path / "objects.pt")  # not loadable with weights_only
    (tmp_path / "pickle.bin").write_bytes(pickle.dumps({"a": 1}))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    cases = [
        ("t.npz", "npy", "not a .npy array (it is an .npz archive)"),
        ("pickle.bin", "npy", "not a .npy array (it is a Python pickle)"),
        (
            "objects.npy",
            "npy",
            "not a readable .npy array (it holds Python objects (a pickled object array), not numbers)",
        ),
        ("t.npy", "sglang-pt", "not an SGLang expert-distribution dump saved by torch.save (it is a .npy array)"),
        ("t.npz", "sglang-pt", "not an SGLang expert-distribution dump saved by torch.save (it is an .npz archive)"),
        ("objects.pt", "sglang-pt", "not a readable SGLang expert-distribution dump (it holds Python objects besides"),
        ("objects.pt", "npz", "not an .npz archive (it is a torch.save file)"),
        ("t.npy", "npz", "not an .npz archive (it is a .npy array)"),
    ]
    for name, fmt, message in cases:
        err = _err(capsys, ["place", str(tmp_path / name), "--trace-format", fmt, *SMALL_TOPO])
        assert err.startswith(f"eplb place: error: {tmp_path / name}: {message}"), err
        # Never the libraries' advice to load a pickle unsafely.
        assert "allow_pickle" not in err and "weights_only" not in err


def test_a_directory_or_a_placement_as_trace_is_named(tmp_path, capsys):
    err = _err(capsys, ["place", str(tmp_path), *SMALL_TOPO])
    assert err == f"eplb place: error: {tmp_path}: is a directory; give a trace file in it\n"
    for name in ("p.json", "p.npz"):
        assert cli.main(["place", *SMALL, "--out", str(tmp_path / name)]) == 0
        capsys.readouterr()
        err = _err(capsys, ["place", str(tmp_path / name), *SMALL_TOPO])
        assert "this is a placement (it maps slots to experts), not a load trace" in err
        assert "give it as --previous PLACEMENT" in err


def test_loads_too_large_give_the_error_without_numpy_warnings(tmp_path, capsys):
    np.save(tmp_path / "big.npy", np.full((1, 16), 1e308))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would fail the run here
        err = _err(capsys, ["place", str(tmp_path / "big.npy"), *SMALL_TOPO])
    assert err.startswith("eplb place: error: loads too large: layer 0 sums to inf")


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "0"])
def test_bench_refuses_expert_bytes_that_are_not_a_size(capsys, value):
    err = _err(capsys, ["--quick", "--expert-bytes", value], tool=report.main)
    assert err == f"eplb-bench: error: --expert-bytes must be a number of bytes > 0, got {float(value)}\n"


@pytest.mark.parametrize("value", ["0", "4,8", "x"])
def test_bench_replan_every_says_it_takes_one_integer(capsys, value):
    with pytest.raises(SystemExit):
        report.main(["--quick", "--replan-every", value])
    assert f"argument --replan-every: expected one integer >= 1, got '{value}'" in capsys.readouterr().err


def test_a_trace_only_bench_prints_no_empty_tables(tmp_path, capsys):
    np.save(tmp_path / "one.npy", make_loads("zipf-1.0", SCALES["small"])[None])
    flags = ["--slots", "20", "--gpus", "4", "--nodes", "2", "--groups", "4", "--policies", "global"]
    assert report.main([str(tmp_path / "one.npy"), *flags]) == 0
    out = capsys.readouterr().out
    assert "## placement" in out
    assert "## per-step" not in out and "## re-planning" not in out  # one step: nothing to re-plan
