# SPDX-License-Identifier: MIT
"""The CPU backend through the Python binding, against the fp64 recurrence."""

import numpy as np
import pytest

import flashkda
from kda_testing import HEAD_DIM, assert_accurate, make_problem, rel_l2


@pytest.mark.parametrize("state_dtype", [np.float32, np.uint16], ids=["f32_state", "bf16_state"])
def test_batched_forward_matches_recurrence(rng, state_dtype):
    problem = make_problem(rng, batch=2, seq_len=37, heads=2, state_dtype=state_dtype)
    problem.poison_outputs()
    flashkda.fwd(lower_bound=problem.lower_bound, **problem.arguments())
    assert_accurate(problem)


@pytest.mark.parametrize("offsets_dtype", [np.int64, np.int32])
def test_varlen_forward_matches_recurrence(rng, offsets_dtype):
    problem = make_problem(rng, seq_lens=[21, 0, 40, 3], heads=2, cu_seqlens_dtype=offsets_dtype)
    problem.poison_outputs()
    flashkda.fwd(lower_bound=problem.lower_bound, **problem.arguments())
    assert_accurate(problem)


def test_without_states_starts_from_zero(rng):
    problem = make_problem(rng, batch=1, seq_len=33, heads=1,
                           with_initial_state=False, with_final_state=False)
    problem.poison_outputs()
    flashkda.fwd(lower_bound=problem.lower_bound, **problem.arguments())
    assert_accurate(problem)


def test_other_lower_bound(rng):
    problem = make_problem(rng, batch=1, seq_len=30, heads=2, lower_bound=-1.25)
    problem.poison_outputs()
    flashkda.fwd(lower_bound=problem.lower_bound, **problem.arguments())
    assert_accurate(problem)


def test_strided_views_give_the_contiguous_result(rng):
    problem = make_problem(rng, batch=2, seq_len=19, heads=2)
    flashkda.fwd(lower_bound=problem.lower_bound, **problem.arguments())
    contiguous_out = problem.out.copy()
    contiguous_state = problem.final_state.copy()

    def widened_heads(array):
        # The same values as a view with a larger head stride.
        wide = flashkda.to_bf16(rng.standard_normal(array.shape[:2] + (3,) + array.shape[3:]))
        view = wide[:, :, 1:3]
        view[...] = array
        assert not view.flags.c_contiguous
        return view

    strided = {name: widened_heads(getattr(problem, name)) for name in ("q", "k", "v", "g")}
    beta_rows = np.zeros((problem.beta.shape[0], problem.beta.shape[1] * 2, 2), dtype=np.uint16)
    beta_view = beta_rows[:, ::2]
    beta_view[...] = problem.beta
    out_view = widened_heads(np.zeros_like(problem.out))
    out_view[...] = 0x7FC0
    problem.final_state[...] = np.nan
    flashkda.fwd(strided["q"], strided["k"], strided["v"], strided["g"], beta_view,
                 problem.scale, out_view, problem.A_log, problem.dt_bias, problem.lower_bound,
                 initial_state=problem.initial_state, final_state=problem.final_state)
    np.testing.assert_array_equal(out_view, contiguous_out)
    np.testing.assert_array_equal(problem.final_state, contiguous_state)


def test_plan_reuse_across_shapes_and_lower_bounds(rng):
    first = make_problem(rng, batch=2, seq_len=24, heads=2)
    second = make_problem(rng, seq_lens=[5, 50], heads=2, lower_bound=-2.5)
    with flashkda.Plan(2, backend="cpu", lower_bound=first.lower_bound) as plan:
        assert plan.backend == flashkda.Backend.CPU
        for _ in range(2):
            first.poison_outputs()
            plan.fwd(**first.arguments())
            assert_accurate(first)
        plan.set_lower_bound(second.lower_bound)
        assert plan.get_lower_bound() == second.lower_bound
        second.poison_outputs()
        plan.fwd(**second.arguments())
        assert_accurate(second)
        plan.lower_bound = first.lower_bound
        assert plan.lower_bound == first.lower_bound
        first_out = first.out.copy()
        first.poison_outputs()
        plan.fwd(**first.arguments())
        np.testing.assert_array_equal(first.out, first_out)


def test_explicit_workspace(rng):
    problem = make_problem(rng, batch=1, seq_len=40, heads=2)
    with flashkda.Plan(2, backend=flashkda.Backend.CPU) as plan:
        size = plan.workspace_size(40, 1)
        assert size >= 0
        workspace = np.empty(size + 64, dtype=np.uint8)
        problem.poison_outputs()
        plan.fwd(workspace=workspace, **problem.arguments())
        assert_accurate(problem)


def test_bf16_state_plan(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=1, state_dtype=np.uint16)
    with flashkda.Plan(1, backend="cpu", state_dtype="bf16") as plan:
        problem.poison_outputs()
        plan.fwd(**problem.arguments())
    assert_accurate(problem)


def test_state_round_trip_through_two_calls(rng):
    whole = make_problem(rng, batch=1, seq_len=48, heads=1)
    flashkda.fwd(lower_bound=whole.lower_bound, **whole.arguments())
    first_half = dict(whole.arguments())
    middle_state = np.empty_like(whole.final_state)
    out_first = np.empty((1, 32, 1, HEAD_DIM), dtype=np.uint16)
    out_second = np.empty((1, 16, 1, HEAD_DIM), dtype=np.uint16)
    end_state = np.empty_like(whole.final_state)
    for name in ("q", "k", "v", "g", "beta"):
        first_half[name] = getattr(whole, name)[:, :32]
    first_half.update(out=out_first, final_state=middle_state)
    flashkda.fwd(lower_bound=whole.lower_bound, **first_half)
    second_half = dict(first_half)
    for name in ("q", "k", "v", "g", "beta"):
        second_half[name] = getattr(whole, name)[:, 32:]
    second_half.update(out=out_second, initial_state=middle_state, final_state=end_state)
    flashkda.fwd(lower_bound=whole.lower_bound, **second_half)
    split_out = np.concatenate([flashkda.from_bf16(out_first), flashkda.from_bf16(out_second)], axis=1)
    assert rel_l2(split_out, flashkda.from_bf16(whole.out)) <= 1e-3
    assert rel_l2(end_state, whole.final_state) <= 1e-4


def test_ml_dtypes_bfloat16_arrays(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    problem = make_problem(rng, batch=1, seq_len=17, heads=1)
    as_bf16 = {name: getattr(problem, name).view(ml_dtypes.bfloat16)
               for name in ("q", "k", "v", "g", "beta", "out")}
    problem.poison_outputs()
    arguments = problem.arguments()
    arguments.update(as_bf16)
    flashkda.fwd(lower_bound=problem.lower_bound, **arguments)
    assert_accurate(problem)


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    problem = make_problem(rng, batch=1, seq_len=18, heads=2)

    def as_torch(array):
        if array.dtype == np.uint16:
            return torch.from_numpy(flashkda.from_bf16(array)).to(torch.bfloat16)
        return torch.from_numpy(array)

    tensors = {name: as_torch(getattr(problem, name))
               for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")}
    out = torch.full(problem.out.shape, float("nan"), dtype=torch.bfloat16)
    final_state = torch.full(problem.final_state.shape, float("nan"), dtype=torch.float32)
    flashkda.fwd(scale=problem.scale, out=out, lower_bound=problem.lower_bound,
                 final_state=final_state, **tensors)
    problem.out[...] = out.view(torch.int16).numpy().view(np.uint16)
    problem.final_state[...] = final_state.numpy()
    assert_accurate(problem)


class _DLPackOnly:
    """An array that offers nothing but the DLPack protocol."""

    def __init__(self, array):
        self._array = array

    def __dlpack__(self, stream=None):
        return self._array.__dlpack__()

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_dlpack_producers(rng):
    if not hasattr(np.ndarray, "__dlpack__"):
        pytest.skip("numpy too old for DLPack")
    problem = make_problem(rng, batch=1, seq_len=21, heads=2)
    problem.poison_outputs()
    arguments = problem.arguments()
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "out", "initial_state",
                 "final_state"):
        arguments[name] = _DLPackOnly(arguments[name])
    flashkda.fwd(lower_bound=problem.lower_bound, **arguments)
    assert_accurate(problem)
