"""eplb.kernel: the kernel cost models, their fit and the shipped H100 models."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

from eplb import kernel


def _sets(seed: int = 0, count: int = 120) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        k = int(rng.integers(1, 33))
        n = np.round(10 ** rng.uniform(0, 3.5) * rng.lognormal(0, 1, k)).astype(np.int64)
        n[rng.random(k) < 0.3] = 0
        if n.sum():
            out.append(n)
    return out


def test_fit_recovers_a_model_and_its_tile():
    true = kernel.KernelModel(25.0, 3.0, 2.0, 64, 0.004)
    train, held = _sets(0), _sets(1)
    m = kernel.fit(train, kernel.model_us(true, train), gpu="test")
    assert m.tile == 64
    assert m.gpu == "test"
    np.testing.assert_allclose([m.call_us, m.expert_us, m.tile_us, m.token_us], [25.0, 3.0, 2.0, 0.004], rtol=1e-6)
    err = kernel.fit_error(m, held, kernel.model_us(true, held))
    assert err["max"] < 1e-6 and err["n"] == len(held)


def test_fit_keeps_coefficients_nonnegative_under_noise():
    true = kernel.KernelModel(30.0, 1.0, 4.0, 128)
    train = _sets(2)
    noisy = kernel.model_us(true, train) * np.random.default_rng(3).lognormal(0, 0.05, len(train))
    m = kernel.fit(train, noisy)
    assert min(m.call_us, m.expert_us, m.tile_us, m.token_us) >= 0
    assert kernel.fit_error(m, train, noisy)["median"] < 0.06


def test_gpu_us_pays_the_launch_once_and_nothing_for_idle_slots():
    m = kernel.KernelModel(10.0, 2.0, 1.0, 128)
    assert m.gpu_us(np.array([0, 0, 0])) == 0
    assert m.gpu_us(np.array([1, 0, 0])) == pytest.approx(13.0)
    assert m.gpu_us(np.array([129, 0, 128])) == pytest.approx(10 + (2 + 2) + (2 + 1))
    np.testing.assert_allclose(m.gpu_us(np.array([[0, 0], [1, 1]])), [0.0, 16.0])


def test_curve_interpolates_and_extends_by_the_last_slope():
    c = kernel.as_cost_model((np.array([1, 64, 128]), np.array([10.0, 12.0, 20.0])))
    np.testing.assert_allclose(c.slot_us(np.array([0, 1, 32, 64, 96, 256])), [0, 10, 10 + 2 * 31 / 63, 12, 16, 36])
    assert c.gpu_us(np.array([0, 1, 64])) == pytest.approx(22.0)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.array([1, 2]), np.array([1.0])), "one length"),
        ((np.array([2, 1]), np.array([1.0, 2.0])), "strictly increasing"),
        ((np.array([0, 1]), np.array([1.0, 2.0])), ">= 1"),
        ((np.array([1, 2]), np.array([-1.0, 2.0])), ">= 0"),
    ],
)
def test_bad_curves_say_what_is_allowed(args, match):
    with pytest.raises(ValueError, match=match):
        kernel.as_cost_model(args)


def test_bad_models_and_names_say_what_is_allowed():
    with pytest.raises(ValueError, match="tile must be an integer >= 1"):
        kernel.KernelModel(1.0, 1.0, 1.0, 0)
    with pytest.raises(ValueError, match="call_us must be a finite number >= 0"):
        kernel.KernelModel(-1.0, 1.0, 1.0, 64)
    with pytest.raises(ValueError, match="all 0"):
        kernel.KernelModel(1.0, 0.0, 0.0, 64)
    with pytest.raises(ValueError, match="no shipped kernel model 'nope'; shipped: deepseek-v3@h100"):
        kernel.load("nope")
    with pytest.raises(ValueError, match="kernel_curve must be"):
        kernel.as_cost_model([1, 2, 3])


@pytest.mark.parametrize("name", ["deepseek-v3@h100", "qwen3-235b-a22b@h100", "qwen3-30b-a3b@h100"])
def test_shipped_models_are_labelled_and_refit_from_their_samples(name):
    assert name in kernel.shipped()
    m = kernel.load(name)
    assert "H100" in m.gpu and "grouped_mm" in m.kernel and m.dtype == "bfloat16"
    raw = json.loads(resources.files("eplb.kernels").joinpath(f"{name}.json").read_text())
    train = [np.array(n) for n, _ in raw["samples"]["train"]]
    held = [np.array(n) for n, _ in raw["samples"]["heldout"]]
    us_train = np.array([u for _, u in raw["samples"]["train"]])
    us_held = np.array([u for _, u in raw["samples"]["heldout"]])
    # The stored error is what the stored samples give, and a refit makes the same model.
    assert kernel.fit_error(m, held, us_held) == m.heldout
    refit = kernel.fit(train, us_train)
    assert (refit.tile, round(refit.expert_us, 6)) == (m.tile, round(m.expert_us, 6))
    assert m.heldout["median"] < 0.1 and m.heldout["n"] >= 50
