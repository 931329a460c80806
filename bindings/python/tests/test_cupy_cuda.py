# SPDX-License-Identifier: MIT
"""CuPy arrays (__cuda_array_interface__) on the GPU backend. Skipped without
CuPy or a CUDA device. CuPy has no bf16: uint16 arrays carry the bit patterns.
"""

import numpy as np
import pytest

import flashkda
from flashkda import FlashKDAError, Status
from kda_testing import BF16_NAN, assert_accurate, make_problem

cupy = pytest.importorskip("cupy", reason="CuPy is not installed")


def _device_count():
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # CuPy without a driver raises its own runtime errors
        return 0


pytestmark = pytest.mark.skipif(_device_count() == 0, reason="CuPy sees no CUDA device")

INPUTS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state", "cu_seqlens")


def device_arguments(problem):
    arguments = {name: None if getattr(problem, name) is None else cupy.asarray(getattr(problem, name))
                 for name in INPUTS}
    arguments["out"] = cupy.full(problem.out.shape, BF16_NAN, dtype=cupy.uint16)
    arguments["final_state"] = cupy.full(problem.final_state.shape, np.nan,
                                         dtype=problem.final_state.dtype)
    arguments["scale"] = problem.scale
    return arguments


def fetch(problem, arguments):
    cupy.cuda.get_current_stream().synchronize()
    problem.out[...] = cupy.asnumpy(arguments["out"])
    problem.final_state[...] = cupy.asnumpy(arguments["final_state"])
    return problem


def test_forward_on_a_cupy_stream(rng):
    problem = make_problem(rng, seq_lens=[100, 0, 61], heads=2)
    arguments = device_arguments(problem)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        flashkda.fwd(lower_bound=problem.lower_bound, **arguments)
        stream.synchronize()
        assert_accurate(fetch(problem, arguments))


def test_bf16_state(rng):
    problem = make_problem(rng, batch=2, seq_len=40, heads=2, state_dtype=np.uint16)
    arguments = device_arguments(problem)
    arguments["final_state"] = cupy.full(problem.final_state.shape, BF16_NAN, dtype=cupy.uint16)
    flashkda.fwd(lower_bound=problem.lower_bound, **arguments)
    assert_accurate(fetch(problem, arguments))


def test_mixed_host_and_device(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=2)
    arguments = device_arguments(problem)
    arguments["beta"] = problem.beta
    with pytest.raises(FlashKDAError) as caught:
        flashkda.fwd(lower_bound=problem.lower_bound, **arguments)
    assert caught.value.status == Status.INVALID_ARGUMENT
    assert caught.value.message.startswith("beta:")


def test_float64_has_no_flashkda_dtype(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=2)
    arguments = device_arguments(problem)
    arguments["A_log"] = arguments["A_log"].astype(cupy.float64)
    with pytest.raises(FlashKDAError) as caught:
        flashkda.fwd(lower_bound=problem.lower_bound, **arguments)
    assert caught.value.message.startswith("A_log:")
