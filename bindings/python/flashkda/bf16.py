# SPDX-License-Identifier: MIT
"""bf16 conversions for numpy, which has no bf16 dtype.

bf16 arrays are uint16 arrays holding the bit patterns (the upper half of an
IEEE float32). Conversion to bf16 rounds to nearest, ties to even; NaNs stay
NaNs (quiet, sign kept) and overflow goes to infinity.
"""

import numpy as np


def to_bf16(values):
    """float array (any float dtype) -> uint16 array of bf16 bit patterns.

    float64 input is first rounded to float32, as torch does.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        as_f32 = np.asarray(values, dtype=np.float32)
    bits = np.ascontiguousarray(as_f32).view(np.uint32)
    lowest_kept_bit = (bits >> np.uint32(16)) & np.uint32(1)
    # Non-NaN values never carry past 0xFFFFFFFF: the largest is -inf + 0x8000.
    rounded = (bits + np.uint32(0x7FFF) + lowest_kept_bit) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    result = np.where(np.isnan(as_f32), quiet_nan, rounded)
    return result.astype(np.uint16).reshape(as_f32.shape)


def from_bf16(bits):
    """uint16 array of bf16 bit patterns (or an ml_dtypes.bfloat16 array) -> float32."""
    array = np.asarray(bits)
    if array.dtype.name == "bfloat16" and array.dtype.itemsize == 2:
        array = array.view(np.uint16)
    if array.dtype != np.uint16:
        raise TypeError(f"from_bf16: expected uint16 bit patterns, got {array.dtype}")
    widened = array.astype(np.uint32) << np.uint32(16)
    return widened.view(np.float32).reshape(array.shape)
