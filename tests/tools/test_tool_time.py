"""Planning for time in the tools: eplb place --kernel-curve, eplb-bench --kernel-curve, eplb calibrate."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

import eplb
from eplb import timing
from eplb.workloads import make_loads
from eplb_bench import report
from eplb_tools import calibrate, cli

MODEL = "qwen3-30b-a3b@h100"
FLAGS = ["--synthetic", "lognormal-1.0", "--layers", "2", "--experts", "32", "--slots", "48", "--gpus", "8"]
FLAGS += ["--nodes", "1", "--groups", "1"]


def test_place_plans_for_time_and_prints_the_prediction(tmp_path, capsys):
    out = tmp_path / "p.npy"
    flags = FLAGS + ["--kernel-curve", MODEL, "--tokens-per-gpu", "4:3,64:1", "--top-k", "4", "--out", str(out)]
    assert cli.main(["place", *flags]) == 0
    text = capsys.readouterr().out
    topo = eplb.Topology(2, 32, 48, 8, 1, 1)
    loads = make_loads("lognormal-1.0", topo)
    want = eplb.rebalance(loads, topo, kernel_curve=MODEL, tokens_per_gpu=[(4, 3.0), (64, 1.0)], top_k=4)
    assert np.array_equal(np.load(out), want.phy2log)
    assert f"4 tokens/gpu {want.predicted_ms[4]:.3f} ms  64 tokens/gpu {want.predicted_ms[64]:.3f} ms" in text
    # A model written by eplb calibrate --out is read the same.
    path = tmp_path / "m.json"
    path.write_text(eplb.kernel.load(MODEL).to_json())
    assert cli.main(["place", *FLAGS, "--kernel-curve", str(path), "--tokens-per-gpu", "16"]) == 0
    assert "16 tokens/gpu" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tokens-per-gpu", "4"], "--tokens-per-gpu plan for time: give --kernel-curve"),
        (["--kernel-curve", MODEL], "give --tokens-per-gpu"),
        (["--kernel-curve", "nope", "--tokens-per-gpu", "4"], "no shipped kernel model 'nope'"),
        (["--kernel-curve", MODEL, "--tokens-per-gpu", "4,x"], "'x' is not N or N:WEIGHT"),
        (["--kernel-curve", MODEL, "--tokens-per-gpu", "0"], "tokens_per_gpu must be"),
    ],
)
def test_place_time_flags_are_checked(capsys, flags, message):
    assert cli.main(["place", *FLAGS, *flags]) == 2
    assert message in capsys.readouterr().err


def test_bench_report_adds_predicted_ms_per_placement():
    settings = replace(
        report.QUICK,
        scales=("small",),
        workloads=("zipf-1.0",),
        policies=("deepseek", "global"),
        replan_scales=(),
        step_scales=(),
        tokens_per_gpu=(8, 64),
        kernel_curve=MODEL,
    )
    rep = report.build_report(settings)
    rows = [r for r in rep["placement"] if r["policy"] in ("deepseek", "global")]
    assert len(rows) == 2
    topo = eplb.workloads.SCALES["small"]
    loads = make_loads("zipf-1.0", topo)
    for r in rows:
        placement = eplb.rebalance(loads, topo, r["policy"]).placement
        us = timing.predicted_layer_us(placement, loads, MODEL, [8, 64], settings.topk).sum(axis=0)
        assert r["predicted_ms"] == {
            8: pytest.approx(us[0] / 1000, abs=1e-4),
            64: pytest.approx(us[1] / 1000, abs=1e-4),
        }
    assert "predicted MoE ms per step" in report.markdown(rep)
    json.dumps(rep)


def test_calibrate_needs_a_gpu_and_says_so(capsys):
    # CI has no CUDA device: the command says why it cannot measure, rather than fail inside torch.
    assert cli.main(["calibrate", "--shape", "qwen3-30b-a3b"]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        calibrate.main(["--hidden", "2048"])


def test_calibration_sets_cover_the_documented_grid():
    sets = calibrate.training_sets(calibrate.Shape(2048, 768), 1 << 17)
    assert len(sets) == 165
    assert {s.size for s in sets} == {1, 2, 4, 8, 16, 32}
    assert max(int(s.max()) for s in sets) == 16384
    held = calibrate.heldout_sets(60, 1 << 17)
    assert len(held) == 60 and all(0 < s.sum() <= 1 << 17 and s.size <= 32 for s in held)
