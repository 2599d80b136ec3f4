"""eplb_bench.default_bench: the target table's cases, seeds and columns."""

import json
import math
import os

import numpy as np
import pytest

from eplb.workloads import SCALES, make_loads
from eplb_bench import default_bench


def test_seed_redraws_every_case_and_zero_keeps_the_documented_rows() -> None:
    zero, one = default_bench.cases(0), default_bench.cases(1)
    assert list(zero) == list(one)
    for name in ("v3-64 zipf-1.5", "128e/128gpu/2spg hot-mix", "256e/192gpu/2spg zipf-1.0"):
        t, a, _ = zero[name]()
        _, b, _ = one[name]()
        assert np.array_equal(a, zero[name]()[1]) and not np.array_equal(a, b), name
    expected = make_loads("zipf-1.5", SCALES["kimi-64"], 0)
    assert np.array_equal(zero["kimi-64 zipf-1.5"]()[1], expected)
    t, loads, policy = zero["q235-94L/128gpu mixed 16k"]()
    assert (t.num_layers, t.num_experts, t.num_slots, t.num_gpus) == (94, 128, 256, 128)
    assert policy == "global" and loads.shape == (94, 128) and (loads == np.round(loads)).all()


def test_no_high_leaves_the_high_column_out(tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    default_bench.main(["--cases", "v3-prefill lognormal-1.0 auto", "--no-high", "--seed", "2", "--json", str(out)])
    row = json.loads(out.read_text())["v3-prefill lognormal-1.0 auto"]
    assert math.isnan(row["high"]) and row["default"] <= row["fast"] <= row["deepseek"]
    assert "v3-prefill lognormal-1.0 auto" in capsys.readouterr().out


def test_baseline_times_another_tree_plan_by_plan_and_checks_the_placements(tmp_path, capsys) -> None:
    import shutil

    import eplb

    shutil.copytree(os.path.dirname(eplb.__file__), tmp_path / "eplb")
    default_bench.main(["--cases", "v3-prefill lognormal-1.0 auto", "--baseline", str(tmp_path), "--repeat", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| v3-prefill")]
    assert [r.split(" | ")[1] for r in rows] == ["fast", "default"]
    assert all(r.rstrip(" |").endswith("yes") for r in rows)  # the same code plans the same


def test_baseline_without_an_eplb_package_is_refused(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        default_bench.main(["--cases", "v3-prefill lognormal-1.0 auto", "--baseline", str(tmp_path)])
    assert exc.value.code == 2 and "no eplb package in it" in capsys.readouterr().err
