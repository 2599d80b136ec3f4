"""`eplb place` shows progress on stderr through rebalance's progress callback: plain lines
without a terminal (once the plan has run PROGRESS_AFTER_S, then at most one per
PROGRESS_EVERY_S), a tqdm bar on one, nothing for a quick plan. Called in-process."""

import json
import re

import numpy as np

import eplb
from eplb_tools import cli

# 70 layers: five search chunks of 16.
FLAGS = ["--layers", "70", "--experts", "32", "--slots", "48", "--gpus", "8", "--synthetic", "zipf-1.0"]
LINE = re.compile(r"^eplb place: (.+): layers (\d+)/(\d+) \((\d+) %\), (\d+) s$")


def _lines(err: str) -> list[tuple[str, int, int]]:
    rows = err.splitlines()
    assert rows[-1].startswith("eplb place: planned in "), err
    out = []
    for row in rows[:-1]:
        m = LINE.match(row)
        assert m, row
        out.append((m[1], int(m[2]), int(m[3])))
    return out


def test_a_slow_plan_prints_a_line_per_update_and_plans_the_same(monkeypatch, capsys, tmp_path):
    # The plan made "slow": no wait before the first line, none between lines.
    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)
    out = tmp_path / "p.json"
    assert cli.main(["place", *FLAGS, "--policy", "global", "--out", str(out)]) == 0
    lines = _lines(capsys.readouterr().err)
    assert lines[0] == ("first plan", 70, 70)
    assert [d for phase, d, _ in lines if phase == "search"] == [16, 32, 48, 64, 70]
    assert {t for *_, t in lines} == {70}
    topo = eplb.Topology(70, 32, 48, 8)
    from eplb.workloads import make_loads

    expect = eplb.rebalance(make_loads("zipf-1.0", topo, 0), topo, "global").phy2log
    assert np.array_equal(np.array(json.loads(out.read_text())["phy2log"]), expect)


def test_lines_are_spaced_by_the_interval_but_each_phase_end_shows(monkeypatch, capsys):
    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 1e9)
    assert cli.main(["place", *FLAGS, "--policy", "global"]) == 0
    # The first update, then the search's end: its chunks in between are within the interval.
    assert _lines(capsys.readouterr().err) == [("first plan", 70, 70), ("search", 70, 70)]


def test_a_quick_plan_prints_nothing_on_stderr(capsys, tmp_path):
    # Default threshold (3 s): this plan, a re-plan with its extra phase, takes well under it.
    prev = tmp_path / "prev.json"
    assert cli.main(["place", *FLAGS, "--out", str(prev)]) == 0
    assert cli.main(["place", *FLAGS, "--seed", "1", "--previous", str(prev)]) == 0
    assert capsys.readouterr().err == ""


def test_a_re_plan_reports_its_phase(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)
    prev = tmp_path / "prev.json"
    assert cli.main(["place", *FLAGS, "--out", str(prev)]) == 0
    capsys.readouterr()
    assert cli.main(["place", *FLAGS, "--seed", "1", "--previous", str(prev)]) == 0
    lines = _lines(capsys.readouterr().err)
    assert [(p, d) for p, d, _ in lines if p == "re-plan"] == [("re-plan", 0), ("re-plan", 70)]


def test_on_a_terminal_progress_is_a_tqdm_bar(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_is_terminal", lambda: True)
    assert cli.main(["place", *FLAGS, "--policy", "global", "--progress"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"eplb place: search: 100%\|.*\| 70/70 ", err), err
    assert "planned in" not in err  # the plain lines' closing line is not drawn with a bar


def test_eplb_bench_says_how_far_a_long_plan_got_without_a_terminal(monkeypatch, capsys):
    from eplb_bench import report

    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)
    assert report.main(["--quick", "--scales", "small", "--policies", "global"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^eplb-bench: global on small/[\w.-]+: search: layers (\d+)/\1 \(100 %\), \d+ s$", err, re.M), err
    assert "eplb-bench: global on small/" in err and ": planned in " in err


def test_eplb_bench_prints_no_progress_for_its_quick_plans(capsys):
    from eplb_bench import report

    assert report.main(["--quick", "--scales", "small", "--policies", "global"]) == 0
    assert "layers" not in capsys.readouterr().err


def test_eplb_bench_sections_say_how_far_they_got_without_a_terminal(monkeypatch, capsys):
    # `eplb-bench --quick 2>log` was silent for its whole 24 s: tqdm bars were off without a terminal.
    from eplb_bench import report

    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(cli, "PROGRESS_EVERY_S", 0.0)
    assert report.main(["--quick", "--scales", "small", "--policies", "global"]) == 0
    err = capsys.readouterr().err
    placement = re.findall(r"^eplb-bench: placement (\d+)/(\d+), \d+ s$", err, re.M)
    total = int(placement[-1][1])
    assert [int(done) for done, _ in placement] == list(range(1, total + 1)) and total >= 3
    assert re.search(r"^eplb-bench: re-planning (\d+)/\1, \d+ s$", err, re.M), err


def test_progress_lines_wait_then_space_themselves(monkeypatch, capsys):
    clock = iter([0.0, 1.0, 2.0, 3.5, 4.0, 7.0, 7.5, 8.0])  # start, then one reading per item, then the end
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock))
    assert list(cli.progress_lines(list("abcdef"), "x:")) == list("abcdef")
    # Nothing before 3 s; then at most one line per 3 s; the last once done.
    assert capsys.readouterr().err == "x: 2/6, 4 s\nx: 4/6, 7 s\nx: 6/6, 8 s\n"  # items done, seconds
