# SPDX-License-Identifier: MIT
"""Every error path reachable without a GPU: each raises FlashKDAError naming
the argument, carrying the library's status and message."""

import math
import os

import numpy as np
import pytest

import flashkda
from flashkda import FlashKDAError, Status
from kda_testing import make_problem


def run_fwd(problem, **overrides):
    arguments = problem.arguments()
    arguments.update(overrides)
    lower_bound = arguments.pop("lower_bound", problem.lower_bound)
    flashkda.fwd(lower_bound=lower_bound, **arguments)


def expect_error(action, argument, status=Status.INVALID_ARGUMENT):
    with pytest.raises(FlashKDAError) as caught:
        action()
    error = caught.value
    assert error.status == status, str(error)
    assert error.message.startswith(argument + ":") or error.message.startswith(
        "desc." + argument + ":"
    ), error.message
    assert error.message in str(error)
    return error


@pytest.fixture
def problem(rng):
    return make_problem(rng, batch=1, seq_len=20, heads=2)


def test_wrong_dtype_is_reported_by_the_library(problem):
    error = expect_error(lambda: run_fwd(problem, q=flashkda.from_bf16(problem.q)), "q")
    assert "bf16" in error.message and "f32" in error.message
    assert error.status_text == flashkda.status_string(Status.INVALID_ARGUMENT)


def test_dtype_without_flashkda_equivalent(problem):
    error = expect_error(lambda: run_fwd(problem, k=problem.k.astype(np.float64)), "k")
    assert "float64" in error.message


def test_wrong_state_dtype_for_the_plan(rng):
    problem = make_problem(rng, batch=1, seq_len=20, heads=2, state_dtype=np.uint16)
    expect_error(
        lambda: run_fwd(problem, final_state=np.empty(problem.final_state.shape, np.float32)),
        "final_state",
    )


@pytest.mark.parametrize("name", ["k", "v", "g", "beta", "out"])
def test_wrong_shape(problem, name):
    array = getattr(problem, name)
    expect_error(lambda: run_fwd(problem, **{name: array[:, :-1]}), name)


def test_wrong_head_count_in_dt_bias(problem):
    expect_error(lambda: run_fwd(problem, dt_bias=problem.dt_bias[:1]), "dt_bias")


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "out"])
def test_required_argument_none(problem, name):
    expect_error(lambda: run_fwd(problem, **{name: None}), name)


# ------------------------------------------------ gate and beta forms ---


@pytest.mark.parametrize("keyword, value", [
    ("gate_mode", "sigmoid"), ("gate_mode", 7), ("gate_mode", 1.5), ("gate_mode", None),
    ("beta_mode", "odds"), ("beta_mode", -1),
])
def test_unknown_forms(problem, keyword, value):
    error = expect_error(lambda: run_fwd(problem, **{keyword: value}), keyword)
    if isinstance(value, str):
        assert value in error.message
    expect_error(lambda: flashkda.Plan(2, backend="cpu", **{keyword: value}), keyword)


def test_softplus_needs_A_log(problem):
    error = expect_error(lambda: run_fwd(problem, gate_mode="softplus", A_log=None), "A_log")
    assert "softplus" in error.message


@pytest.mark.parametrize("present", ["A_log", "dt_bias"])
def test_log_decay_takes_no_gate_parameters(problem, present):
    absent = {"A_log": None, "dt_bias": None}
    absent.pop(present)
    expect_error(lambda: run_fwd(problem, gate_mode="log_decay", **absent), present)


@pytest.mark.parametrize("gate_mode", ["bounded", "softplus"])
def test_f32_g_only_with_log_decay(problem, gate_mode):
    error = expect_error(lambda: run_fwd(problem, gate_mode=gate_mode,
                                         g=flashkda.from_bf16(problem.g)), "g")
    assert "log-decay" in error.message


@pytest.mark.parametrize("gate_mode", ["softplus", "log_decay"])
def test_lower_bound_belongs_to_the_bounded_gate(problem, gate_mode):
    arguments = dict(A_log=None, dt_bias=None) if gate_mode == "log_decay" else {}
    error = expect_error(lambda: run_fwd(problem, gate_mode=gate_mode, lower_bound=-2.0,
                                         **arguments), "lower_bound")
    assert gate_mode.replace("_", "-") in error.message
    expect_error(lambda: flashkda.Plan(2, backend="cpu", gate_mode=gate_mode, lower_bound=-2.0),
                 "lower_bound")


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_beta_dtype(problem, dtype):
    expect_error(lambda: run_fwd(problem, beta=flashkda.from_bf16(problem.beta).astype(dtype)),
                 "beta")


def test_decode_checks_the_form_too(rng):
    problem = make_problem(rng, batch=2, seq_len=1, heads=2, with_initial_state=False,
                           with_final_state=False)
    pool = np.zeros((4, 2, 128, 128), np.float32)

    def decode(**overrides):
        arguments = dict(q=problem.q, k=problem.k, v=problem.v, g=problem.g, beta=problem.beta,
                         scale=problem.scale, out=problem.out, A_log=problem.A_log,
                         dt_bias=problem.dt_bias, lower_bound=None, state_pool=pool,
                         state_indices=np.array([0, 1], np.int32))
        arguments.update(overrides)
        flashkda.decode(**arguments)

    expect_error(lambda: decode(gate_mode="softplus", A_log=None), "A_log")
    expect_error(lambda: decode(gate_mode="log_decay", A_log=None), "dt_bias")
    expect_error(lambda: decode(g=flashkda.from_bf16(problem.g)), "g")
    expect_error(lambda: decode(beta_mode="certainties"), "beta_mode")


def test_not_an_array(problem):
    error = expect_error(lambda: run_fwd(problem, beta=problem.beta.tolist()), "beta")
    assert "list" in error.message


def test_read_only_output(problem):
    problem.out.flags.writeable = False
    expect_error(lambda: run_fwd(problem), "out")


def test_rank_above_the_maximum(problem):
    expect_error(lambda: run_fwd(problem, q=problem.q.reshape(1, 1, 1, 1, 20, 2, 128)), "q")


def test_byte_strides_not_a_multiple_of_the_element_size(problem):
    storage = np.zeros(8, dtype=np.float32)
    skewed = np.lib.stride_tricks.as_strided(storage, shape=(2,), strides=(6,))
    expect_error(lambda: run_fwd(problem, A_log=skewed), "A_log")


def test_non_native_byte_order(problem):
    expect_error(lambda: run_fwd(problem, A_log=problem.A_log.astype(">f4")), "A_log")


@pytest.mark.parametrize("lower_bound", [-5.5, 0.5, math.nan, -math.inf])
def test_lower_bound_out_of_range(problem, lower_bound):
    expect_error(lambda: run_fwd(problem, lower_bound=lower_bound), "lower_bound")
    with flashkda.Plan(2, backend="cpu") as plan:
        expect_error(lambda: plan.set_lower_bound(lower_bound), "lower_bound")
        assert plan.get_lower_bound() == -5.0
    expect_error(lambda: flashkda.Plan(2, backend="cpu", lower_bound=lower_bound), "lower_bound")


def test_lower_bound_not_a_number(problem):
    expect_error(lambda: run_fwd(problem, lower_bound="steep"), "lower_bound")


def test_scale_not_finite(problem):
    expect_error(lambda: run_fwd(problem, scale=math.inf), "scale")


def test_cu_seqlens_not_increasing(rng):
    problem = make_problem(rng, seq_lens=[10, 10], heads=2)
    problem.cu_seqlens[1] = 15
    problem.cu_seqlens[2] = 12
    expect_error(lambda: run_fwd(problem), "cu_seqlens")


def test_cu_seqlens_not_ending_at_the_token_count(rng):
    problem = make_problem(rng, seq_lens=[10, 10], heads=2)
    problem.cu_seqlens[2] = 19
    expect_error(lambda: run_fwd(problem), "cu_seqlens")


def test_bad_plan_descriptions():
    expect_error(lambda: flashkda.Plan(0, backend="cpu"), "num_heads")
    expect_error(lambda: flashkda.Plan(2.5, backend="cpu"), "num_heads")
    expect_error(lambda: flashkda.Plan(2**40, backend="cpu"), "num_heads")
    expect_error(lambda: flashkda.Plan(2, backend="tpu"), "backend")
    expect_error(lambda: flashkda.Plan(2, backend=7), "backend")
    expect_error(lambda: flashkda.Plan(2, backend="cpu", state_dtype="f16"), "state_dtype")
    expect_error(lambda: flashkda.Plan(2, backend="cpu", state_dtype=flashkda.Dtype.I32),
                 "state_dtype")
    expect_error(lambda: flashkda.Plan(2, backend="cpu", state_layout=3), "state_layout")
    expect_error(lambda: flashkda.Plan(2, backend="cpu", head_dim_k=64), "head_dim_k",
                 Status.UNSUPPORTED)


def test_workspace_size_arguments():
    with flashkda.Plan(2, backend="cpu") as plan:
        expect_error(lambda: plan.workspace_size(-1, 1), "total_tokens")
        expect_error(lambda: plan.workspace_size(1, -1), "num_seqs")
        expect_error(lambda: plan.workspace_size("many", 1), "total_tokens")


def test_closed_plan(problem):
    plan = flashkda.Plan(2, backend="cpu")
    plan.close()
    plan.close()  # idempotent
    assert plan.closed
    expect_error(lambda: plan.fwd(**problem.arguments()), "plan")
    expect_error(lambda: plan.workspace_size(1, 1), "plan")
    expect_error(lambda: plan.set_lower_bound(-1.0), "plan")
    expect_error(lambda: plan.get_lower_bound(), "plan")
    expect_error(lambda: plan.backend, "plan")


def test_context_manager_closes():
    with flashkda.Plan(1, backend="cpu") as plan:
        assert not plan.closed
    assert plan.closed


def test_workspace_arguments(problem):
    with flashkda.Plan(2, backend="cpu") as plan:
        expect_error(lambda: plan.fwd(workspace=np.empty((4, 4), np.uint8)[:, ::2],
                                      **problem.arguments()), "workspace")
        expect_error(lambda: plan.fwd(workspace=[0] * 16, **problem.arguments()), "workspace")


def test_stream_argument(problem):
    with flashkda.Plan(2, backend="cpu") as plan:
        expect_error(lambda: plan.fwd(stream="default", **problem.arguments()), "stream")


def test_gpu_backend_without_a_device():
    if flashkda.query_device().device_count > 0:
        pytest.skip("a CUDA device is present")
    with pytest.raises(FlashKDAError) as caught:
        flashkda.Plan(1, backend="gpu")
    assert caught.value.status in (Status.NO_DEVICE, Status.UNSUPPORTED_ARCH)
    assert caught.value.message.startswith("desc.backend:")


def test_query_device_bad_ordinal():
    expect_error(lambda: flashkda.query_device(-2), "device")


def test_query_device_without_gpu_succeeds():
    info = flashkda.query_device()
    assert info.device_count >= 0
    if not info.driver_loaded:
        assert info.device_count == 0


def test_missing_library_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "nowhere" / "libflashkda.so.0"
    in_use = flashkda.library_path()
    with pytest.raises(FlashKDAError) as caught:
        flashkda.load_library(missing)
    assert caught.value.status is None
    assert str(missing) in str(caught.value)
    assert flashkda.library_path() == in_use


def test_library_that_is_not_a_library(tmp_path):
    impostor = tmp_path / "libflashkda.so.0"
    impostor.write_text("not an ELF file")
    with pytest.raises(FlashKDAError) as caught:
        flashkda.load_library(impostor)
    assert caught.value.status is None
    assert str(impostor) in str(caught.value)


def test_environment_variable_to_a_missing_file(tmp_path, monkeypatch):
    missing = str(tmp_path / "libflashkda.so.0")
    monkeypatch.setattr(flashkda._library, "_current", None)
    monkeypatch.setenv("FLASHKDA_LIBRARY", missing)
    with pytest.raises(FlashKDAError) as caught:
        flashkda.version()
    assert "FLASHKDA_LIBRARY" in str(caught.value) and missing in str(caught.value)


def test_explicit_path_takes_precedence(tmp_path, monkeypatch):
    real = flashkda.library_path()
    monkeypatch.setattr(flashkda._library, "_current", None)
    monkeypatch.setenv("FLASHKDA_LIBRARY", str(tmp_path / "missing.so"))
    plan = flashkda.Plan(1, backend="cpu", library_path=real)
    try:
        assert os.path.samefile(plan.library_path, real)
    finally:
        plan.close()
