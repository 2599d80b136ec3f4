"""eplb.checks: each scalar rule accepts what it says and refuses the rest, naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eplb import checks


@pytest.mark.parametrize("value", [0, 7, np.int32(3), np.int64(0)])
def test_nonneg_int_accepts_integers_from_zero(value):
    out = checks.nonneg_int("n", value)
    assert out == int(value) and type(out) is int


@pytest.mark.parametrize("value", [-1, 1.0, 2.5, "3", None, True, False, np.bool_(True)])
def test_nonneg_int_refuses_the_rest_and_bools(value):
    with pytest.raises(ValueError, match=rf"^n must be an integer >= 0, got {value!r}$"):
        checks.nonneg_int("n", value)


@pytest.mark.parametrize("value", [1, np.int64(8)])
def test_positive_int_accepts_integers_from_one(value):
    assert checks.positive_int("n", value) == int(value)


@pytest.mark.parametrize("value", [0, -3, 1.0, True])
def test_positive_int_refuses_zero_floats_and_bools(value):
    with pytest.raises(ValueError, match=rf"^n must be an integer >= 1, got {value!r}$"):
        checks.positive_int("n", value)


@pytest.mark.parametrize("value", [0, 0.5, np.float32(2.0), np.int64(3), math.inf])
def test_nonneg_number_accepts_reals_from_zero_infinity_included(value):
    out = checks.nonneg_number("x", value)
    assert out == float(value) and type(out) is float


@pytest.mark.parametrize("value", [-0.01, math.nan, "1", None, True])
def test_nonneg_number_refuses_negatives_nan_and_bools(value):
    with pytest.raises(ValueError, match=r"^x must be a number >= 0, got "):
        checks.nonneg_number("x", value)


def test_finite_refuses_infinity():
    assert checks.nonneg_number("x", 1e308, finite=True) == 1e308
    with pytest.raises(ValueError, match=r"^x must be a finite number >= 0, got inf$"):
        checks.nonneg_number("x", math.inf, finite=True)
    with pytest.raises(ValueError, match=r"^x must be a finite number > 0, got inf$"):
        checks.positive_number("x", math.inf, finite=True)


@pytest.mark.parametrize("value", [0, -1.0, math.nan, False])
def test_positive_number_refuses_zero_negatives_nan_and_bools(value):
    with pytest.raises(ValueError, match=r"^x must be a number > 0, got "):
        checks.positive_number("x", value)
    assert checks.positive_number("x", 1e-9) == 1e-9


def test_the_message_says_what_the_value_counts_and_what_none_means():
    with pytest.raises(ValueError) as info:
        checks.nonneg_int("max_moves", -1, "slots rewritten", none="no limit")
    assert str(info.value) == "max_moves must be an integer >= 0 (slots rewritten) or None (no limit), got -1"
    with pytest.raises(ValueError) as info:
        checks.nonneg_int("staging_bytes", 1.5, none="")
    assert str(info.value) == "staging_bytes must be an integer >= 0 or None, got 1.5"
    with pytest.raises(ValueError) as info:
        checks.positive_int("num_gpus", 0, allowed="a positive integer")
    assert str(info.value) == "num_gpus must be a positive integer, got 0"


def test_predicates_refuse_bools():
    assert checks.is_int(np.int16(2)) and not checks.is_int(True) and not checks.is_int(2.0)
    assert checks.is_number(2.0) and checks.is_number(np.float16(1)) and not checks.is_number(np.True_)


def test_one_of_names_the_choices():
    assert checks.one_of("effort", "fast", ("fast", "default")) == "fast"
    with pytest.raises(ValueError) as info:
        checks.one_of("effort", "max", ("fast", "default"), none="the default")
    assert str(info.value) == "effort must be one of 'fast', 'default' or None (the default), got 'max'"
    with pytest.raises(ValueError, match=r"^effort must be one of 'fast', got 1$"):
        checks.one_of("effort", 1, ("fast",))
