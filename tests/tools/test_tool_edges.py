"""Messages of `eplb place` and `eplb demo` that named the wrong thing, or nothing: each is one
line naming the flag (or the file), said before planning where it can be."""

import numpy as np
import pytest

from eplb_tools import cli

SMALL = ["--synthetic", "zipf-1.0", "--scale", "small", "--policy", "global", "--effort", "fast"]


def _err(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_an_out_file_that_cannot_be_written_is_refused_before_planning(capsys, monkeypatch):
    # It used to plan, print the report, then end on a raw [Errno 13] (or 30) naming no flag.
    planned = []
    monkeypatch.setattr(cli.eplb, "rebalance", lambda *a, **k: planned.append(1))
    err = _err(capsys, ["place", *SMALL, "--out", "/sys/p.json"])
    assert err.startswith("eplb place: error: --out /sys/p.json: cannot write it (")
    assert err.endswith("); give a writable file path\n") and "Errno" not in err
    assert planned == []


def test_the_out_check_leaves_no_new_file_and_an_existing_one_untouched(tmp_path, capsys):
    # The check opens the file for appending: a new one is removed again, an old one kept as it was.
    bad = ["--previous", str(tmp_path / "missing.json")]  # refused after the --out check
    new, old = tmp_path / "new.json", tmp_path / "old.json"
    old.write_text("old")
    _err(capsys, ["place", *SMALL, "--out", str(new), *bad])
    _err(capsys, ["place", *SMALL, "--out", str(old), *bad])
    assert not new.exists() and old.read_text() == "old"


def test_a_full_stdout_is_one_line_naming_out_dash(capsys, monkeypatch):
    # It used to print a raw [Errno 28] No space left on device (and more at exit).
    full = open("/dev/full", "w")  # noqa: SIM115 (closed below)
    monkeypatch.setattr("sys.stdout", full)
    try:
        code = cli.main(["place", *SMALL, "--out", "-"])
    finally:
        full.close()
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines()[-1] == (
        "eplb place: error: --out -: cannot write the placement to stdout (No space left on device); give --out FILE"
    )
    assert "Traceback" not in err and "Errno" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ranks", "0"], "--ranks must be in [2, 16], got 0"),
        (["--ranks", "17"], "--ranks must be in [2, 16], got 17"),
        (["--seconds", "0"], "--seconds must be a finite number > 0, got 0"),
        (["--seconds", "nan"], "--seconds must be a finite number > 0, got nan"),
    ],
)
def test_demo_names_the_flag_that_is_out_of_range(capsys, argv, message):
    # It used to say "--ranks must be in [2, 16] and --seconds > 0" whichever was wrong.
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err == f"eplb demo: error: {message} (see eplb demo --help)\n"
    assert "and --seconds" not in err


@pytest.mark.parametrize("suffix", [".npy", ".json"])
def test_a_trace_given_as_previous_is_named_a_trace(tmp_path, capsys, suffix):
    from eplb.traces import LoadTrace
    from eplb_tools import io as eio

    path = tmp_path / f"trace{suffix}"
    counts = np.ones((8, 1, 16))
    if suffix == ".npy":
        np.save(path, counts)
    else:
        eio.write_trace(path, LoadTrace(counts))
    err = _err(capsys, ["place", *SMALL, "--previous", str(path)])
    assert err == (
        f"eplb place: error: --previous {path}: this looks like a load trace (8 steps x 1 layers x 16 experts of "
        "counts), not a placement (layers x slots of expert ids); give it as TRACE, and the placement in service "
        "as --previous\n"
    )


def test_duplicate_csv_rows_are_summed_with_a_warning(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    rows = ["layer,expert,count"] + [f"0,{e},{e + 1}" for e in range(16)] + ["0,3,100"]
    trace.write_text("\n".join(rows) + "\n")
    assert cli.main(["place", str(trace), "--scale", "small", "--policy", "global", "--effort", "fast"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"eplb place: warning: {trace}: 1 row repeats an earlier (layer, expert) and was summed with it; "
        "the first: line 18 repeats line 5 (layer 0, expert 3)"
    ]
    trace.write_text("\n".join(rows[:-1]) + "\n")
    assert cli.main(["place", str(trace), "--scale", "small", "--policy", "global", "--effort", "fast"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_an_all_zero_trace_is_planned_with_a_warning(tmp_path, capsys):
    np.save(tmp_path / "zero.npy", np.zeros((1, 16)))
    assert cli.main(["place", str(tmp_path / "zero.npy"), "--scale", "small", "--policy", "global"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"eplb place: warning: the loads planned (trace {tmp_path / 'zero.npy'}: all 1 steps) are all zero: any "
        "placement balances them, so the plan and its imbalance 1.0 say nothing about a real load"
    ]
    assert "mean 1.0000" in captured.out


@pytest.mark.parametrize(
    ("flag", "meant"), [("--polcy", "--policy"), ("--previos", "--previous"), ("--tolerence=0.1", "--tolerance")]
)
def test_a_mistyped_place_flag_is_one_line_with_the_close_flag(capsys, flag, meant):
    # It used to print the top-level usage ("usage: eplb [-h] {place,serve,demo,ctl} ..."), then
    # eplb place's 18 lines of usage before the error.
    with pytest.raises(SystemExit) as exc:
        cli.main(["place", *SMALL, flag, "x"] if "=" not in flag else ["place", *SMALL, flag])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    (line,) = err.splitlines()
    assert line.startswith("eplb place: error: unrecognized arguments: ")
    assert line.endswith(f"did you mean {meant}?) (see eplb place --help)")


def test_an_unknown_flag_far_from_any_gets_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        cli.main(["place", *SMALL, "--zzzzqqq"])
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "eplb place: error: unrecognized arguments: --zzzzqqq (see eplb place --help)"


def test_a_plan_too_large_for_the_memory_is_refused_before_allocating(capsys, monkeypatch):
    # It used to grow to 23.5 GB and be killed by the kernel without a word.
    import time

    allocated = []
    monkeypatch.setattr(cli, "make_loads", lambda *a: allocated.append(a))
    argv = ["place", "--synthetic", "zipf-1.0", "--layers", "1", "--experts", "100000000", "--slots", "100000000"]
    start = time.monotonic()
    err = _err(capsys, [*argv, "--gpus", "1"])
    assert time.monotonic() - start < 5 and allocated == []
    assert err.startswith(
        "eplb place: error: a plan of 1 layer x 100000000 experts on 100000000 slots (100000000 per gpu) needs "
        "about 50 PB of memory (eplb.limits.plan_bytes), more than the "
    )
    assert err.endswith(" available (MemAvailable); plan fewer layers, experts or slots per gpu\n")


def test_the_size_check_names_the_estimate_and_the_limit_it_was_given():
    import eplb

    topo = eplb.Topology(2, 1000, 1000, 10)
    need = (1 << 20) + 2 * (384 * 1000 + 72 * 1000 + 1000 * 10 + (4 + 10) * 100 * 100)
    assert cli.check_plan_fits(topo, available=need) == need  # fits exactly
    with pytest.raises(ValueError, match=r"needs about 2.26 MB of memory .*, more than the 2.26 MB available"):
        cli.check_plan_fits(topo, available=need - 1)


def test_the_size_check_of_a_re_plan_counts_its_repairs(capsys, monkeypatch, tmp_path):
    # 2 layers x 256 experts on 512 slots of 4 gpus: a fresh plan needs about 4.5 MB, a re-plan
    # 52 MB (it used 35 MB, its repairs' swap grids, where the estimate said 0.2 MB).
    import eplb

    topo = eplb.Topology(2, 256, 512, 4)
    monkeypatch.setattr(cli, "available_bytes", lambda: 10**7)
    previous = tmp_path / "p.npy"
    np.save(previous, eplb.Placement.contiguous(topo).phy2log)
    flags = ["--layers", "2", "--experts", "256", "--slots", "512", "--gpus", "4"]
    err = _err(capsys, ["place", "--synthetic", "zipf-1.0", *flags, "--previous", str(previous)])
    assert err == (
        "eplb place: error: a plan of 2 layers x 256 experts on 512 slots (128 per gpu) needs about 51.6 MB of memory "
        "(eplb.limits.plan_bytes), more than the 10 MB available (MemAvailable); plan fewer layers, experts or "
        "slots per gpu\n"
    )


def test_eplb_place_plans_up_to_the_memory_available_not_the_librarys_default(capsys, monkeypatch):
    # The library's default limit is for callers that do not know the machine; eplb place
    # measures it, and sets the library's limit to it while it plans (then puts it back).
    import eplb

    monkeypatch.setattr(cli, "available_bytes", lambda: 1 << 30)
    old = eplb.set_max_plan_bytes(1000)  # below any plan: the library alone would refuse this one
    try:
        seen = []
        plan = eplb.rebalance
        monkeypatch.setattr(
            cli.eplb, "rebalance", lambda *a, **k: seen.append(eplb.limits.max_plan_bytes()) or plan(*a, **k)
        )
        assert cli.main(["place", *SMALL]) == 0
        assert seen == [1 << 30] and eplb.limits.max_plan_bytes() == 1000
    finally:
        eplb.set_max_plan_bytes(old)
    capsys.readouterr()


def test_eplb_bench_refuses_a_trace_deployment_too_large_for_the_memory(tmp_path, capsys):
    from eplb_bench import report

    np.save(tmp_path / "t.npy", np.ones((2, 1, 16)))
    assert report.main([str(tmp_path / "t.npy"), "--slots", "200000000", "--gpus", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eplb-bench: error: a plan of 1 layer x 16 experts on 200000000 slots (200000000 per gpu)")
    assert "(MemAvailable)" in err and err.count("\n") == 1


def test_random_bytes_in_a_pt_are_not_called_python_objects(tmp_path, capsys):
    # Both used to read "it holds Python objects besides tensors, numbers and containers".
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    (tmp_path / "noise.pt").write_bytes(b"\x13\x37" + rng.bytes(4000))
    (tmp_path / "torn.pt").write_bytes(b"\x80\x02" + b"\xf2" * 100)  # a pickle header, then no opcode
    small = ["--scale", "small", "--policy", "global"]
    err = _err(capsys, ["place", str(tmp_path / "noise.pt"), *small])
    assert err == (
        f"eplb place: error: {tmp_path / 'noise.pt'}: not an SGLang expert-distribution dump saved by torch.save "
        "(it starts with neither a zip nor a pickle header: damaged, or another kind of file)\n"
    )
    err = _err(capsys, ["place", str(tmp_path / "torn.pt"), *small])
    assert err == (
        f"eplb place: error: {tmp_path / 'torn.pt'}: not a readable SGLang expert-distribution dump "
        "(its pickle is damaged (an invalid opcode))\n"
    )


def test_a_bad_eplb_agent_flag_is_one_line(capsys):
    # eplb agent's parser lives in eplb_engine (which may not import the tools): it printed its
    # usage before the error until the eplb command handed it the one-line parser.
    with pytest.raises(SystemExit) as exc:
        cli.main(["agent", "--socket", "/tmp/x.sock", "--address", "127.0.0.1:1", "--bogus"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.splitlines() == ["eplb agent: error: unrecognized arguments: --bogus (see eplb agent --help)"]
