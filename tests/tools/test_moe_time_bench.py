"""moe_time_bench's pure parts: the one-expert curve of issue 34's simulation, the mix summary,
and a small run scored by the kernel model (no GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from eplb import kernel
from eplb_bench import moe_time_bench as mtb


def test_single_expert_curve_is_the_models_one_slot_samples_and_over_states_a_grouped_call() -> None:
    curve = mtb.single_expert_curve("qwen3-30b-a3b@h100")
    assert (np.diff(curve.us) >= 0).all() and curve.tokens[0] == 1 and curve.tokens[-1] == 16384
    model = kernel.load("qwen3-30b-a3b@h100")
    # Eight slots of 256 tokens as one grouped call against eight one-expert calls: the sum pays
    # every launch and under-used tile again (measured: 70.7 us against 8 x 49.8 us).
    grouped = float(model.gpu_us(np.full(8, 256)))
    summed = float(curve.gpu_us(np.full(8, 256)))
    assert summed > 3 * grouped


def _row(b: int, default: float, mix: float, at_b: float, deepseek: float) -> dict:
    return {
        "shape": "s",
        "config": "c",
        "tokens_per_gpu": b,
        "ms": {"default": default, "time@mix": mix, f"time@{b}": at_b, "deepseek": deepseek},
    }


def test_mix_summary_sums_the_sizes_and_bounds_by_the_best_of_each() -> None:
    rows = [
        _row(4, 1.0, 0.9, 0.8, 1.0),
        _row(16, 1.0, 0.95, 0.9, 1.1),
        _row(64, 2.0, 2.02, 2.0, 1.9),
        _row(256, 4.0, 4.0, 4.2, 4.1),
    ]
    line = mtb.mix_summary(rows)
    assert line is not None
    # default 8.0; mix 7.87 (-1.6 %); best of each: 0.8 + 0.9 + 1.9 + 4.0 = 7.6 (-5.0 %)
    assert "default 8.000 ms" in line and "mix plan 7.870 (-1.6%" in line and "worst size +1.0%" in line
    assert "best of each size alone 7.600 (-5.0%" in line
    assert mtb.mix_summary(rows[:3]) is None  # a size of the mix missing: no summary


def test_a_small_model_scored_run_prints_the_mix_and_curve_plans(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rows.json"
    argv = ["--shapes", "qwen3-30b-a3b", "--configs", "EP16 P=160", "--batches", "4,16,64,256", "--layers", "2"]
    assert mtb.main([*argv, "--steps", "2", "--curve-plans", "--score", "curve", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "mix 4/16/64/256: default" in text and "curve " in text
    rows = json.loads(out.read_text())
    assert [r["tokens_per_gpu"] for r in rows] == [4, 16, 64, 256]
    assert all(f"curve@{r['tokens_per_gpu']}" in r["ms"] and r["ms"]["default"] > 0 for r in rows)
