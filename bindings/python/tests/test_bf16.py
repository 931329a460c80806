# SPDX-License-Identifier: MIT
"""to_bf16 / from_bf16: exact round trips, round to nearest even, NaN kept."""

import numpy as np
import pytest

import flashkda

ALL_PATTERNS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def is_nan_pattern(bits):
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)


def test_every_bf16_value_survives_a_round_trip():
    widened = flashkda.from_bf16(ALL_PATTERNS)
    assert widened.dtype == np.float32
    back = flashkda.to_bf16(widened)
    nan = is_nan_pattern(ALL_PATTERNS)
    np.testing.assert_array_equal(back[~nan], ALL_PATTERNS[~nan])
    assert np.isnan(widened[nan]).all()
    assert is_nan_pattern(back[nan]).all()
    # The sign of a NaN is kept.
    np.testing.assert_array_equal(back[nan] & 0x8000, ALL_PATTERNS[nan] & 0x8000)


def test_widening_is_exact():
    widened = flashkda.from_bf16(ALL_PATTERNS)
    np.testing.assert_array_equal(
        widened.view(np.uint32), ALL_PATTERNS.astype(np.uint32) << 16
    )


def nearest_even_reference(values):
    """Independent rounding: pick the closer of the two neighbouring bf16
    values in float64 arithmetic; ties go to the even pattern."""
    bits = values.view(np.uint32)
    down = (bits >> 16).astype(np.uint16)
    up = (down.astype(np.uint32) + 1).astype(np.uint16)
    low = flashkda.from_bf16(down).astype(np.float64)
    high = flashkda.from_bf16(up).astype(np.float64)
    exact = values.astype(np.float64)
    with np.errstate(invalid="ignore"):
        to_low = np.abs(exact - low)
        to_high = np.abs(high - exact)
    choose_up = (to_high < to_low) | ((to_high == to_low) & (down & 1 == 1))
    # Beyond the largest finite bf16 the upper neighbour is infinity; IEEE
    # rounding picks infinity from the halfway point on.
    largest = flashkda.from_bf16(np.array([0x7F7F], np.uint16)).astype(np.float64)[0]
    halfway = largest + 2.0 ** (127 - 8)
    overflow = np.abs(exact) >= halfway
    expected = np.where(choose_up, up, down)
    expected = np.where(overflow, np.where(exact > 0, 0x7F80, 0xFF80), expected)
    return expected.astype(np.uint16)


def test_round_to_nearest_even_on_random_floats(rng):
    values = rng.standard_normal(100_000).astype(np.float32) * np.float32(1e3)
    np.testing.assert_array_equal(flashkda.to_bf16(values), nearest_even_reference(values))


def test_round_to_nearest_even_on_random_bit_patterns(rng):
    bits = rng.integers(0, 1 << 32, size=100_000, dtype=np.uint64).astype(np.uint32)
    values = bits.view(np.float32)
    finite = np.isfinite(values)
    np.testing.assert_array_equal(
        flashkda.to_bf16(values[finite]), nearest_even_reference(values[finite])
    )


def test_ties_go_to_even():
    one = 1.0
    step = 2.0 ** -7  # bf16 spacing at 1
    values = np.array([one + step / 2, one + 3 * step / 2, -(one + step / 2)], dtype=np.float32)
    expected = flashkda.to_bf16(np.array([one, one + 2 * step, -one], dtype=np.float32))
    np.testing.assert_array_equal(flashkda.to_bf16(values), expected)


def test_special_values():
    values = np.array([np.inf, -np.inf, 0.0, -0.0, np.nan, 3.4e38], dtype=np.float32)
    result = flashkda.to_bf16(values)
    assert result[0] == 0x7F80 and result[1] == 0xFF80
    assert result[2] == 0x0000 and result[3] == 0x8000
    assert is_nan_pattern(result[4])
    assert result[5] == 0x7F80  # rounds past the largest bf16


def test_shapes_and_float64_input(rng):
    values = rng.standard_normal((3, 4, 5))
    result = flashkda.to_bf16(values)
    assert result.shape == (3, 4, 5) and result.dtype == np.uint16
    np.testing.assert_array_equal(result, flashkda.to_bf16(values.astype(np.float32)))
    assert flashkda.to_bf16(1.0).shape == ()
    assert flashkda.from_bf16(result).shape == (3, 4, 5)


def test_from_bf16_rejects_other_dtypes():
    with pytest.raises(TypeError):
        flashkda.from_bf16(np.zeros(3, dtype=np.float32))


def test_ml_dtypes_arrays_are_accepted():
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    values = np.array([1.5, -2.25, 1e-3], dtype=np.float32)
    as_ml = values.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(flashkda.from_bf16(as_ml), as_ml.astype(np.float32))
    np.testing.assert_array_equal(flashkda.to_bf16(values), as_ml.view(np.uint16))
