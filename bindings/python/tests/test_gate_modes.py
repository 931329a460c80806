# SPDX-License-Identifier: MIT
"""The gate and beta forms of a plan (gate_mode, beta_mode; ABI 0.3) through
flashkda.fwd, flashkda.decode and Plan: every form against the fp64
recurrence, equivalent forms against each other, and the plan cache keeping
forms apart. Tests taking `backend` also run on torch CUDA tensors where
torch sees a device (see test_serve.py). Errors are in test_errors.py.
"""

import dataclasses

import numpy as np
import pytest

import flashkda
from flashkda import BetaMode, FlashKDAError, GateMode
from kda_testing import (
    assert_accurate,
    decode_reference_fp64,
    log_decay_fp64,
    make_problem,
    rel_l2,
    sigmoid,
    widened,
)
from test_serve import (  # noqa: F401  (backend is a fixture)
    DECODE_F32_STATE_TOLERANCE,
    HEADS,
    activations,
    assert_pool_call_matches,
    backend,
    random_pool,
)

# make_problem's keywords of each form; defaults are "bounded", "logits", bf16.
FORMS = {
    "bounded_without_A_log_and_dt_bias": dict(with_A_log=False, with_dt_bias=False),
    "softplus": dict(gate_mode="softplus"),
    "softplus_without_dt_bias": dict(gate_mode="softplus", with_dt_bias=False),
    "log_decay_f32": dict(gate_mode="log_decay", g_dtype=np.float32),
    "log_decay_bf16": dict(gate_mode="log_decay"),
    "probabilities_bf16": dict(beta_mode="probabilities"),
    "probabilities_f32": dict(beta_mode="probabilities", beta_dtype=np.float32),
    "logits_f32": dict(beta_dtype=np.float32),
    "softplus_probabilities_f32": dict(gate_mode="softplus", beta_mode="probabilities",
                                       beta_dtype=np.float32),
}

# Equivalent forms agree up to the f32 rounding of what one computes in numpy
# and the other in the library (a few bf16 ulps of `out` at most).
EQUIVALENT_TOLERANCE = 1e-3
# The same values in another dtype, or an absent tensor against its neutral
# value: the same arithmetic.
SAME_VALUES_TOLERANCE = 1e-6


def run_fwd(problem, **overrides):
    """flashkda.fwd on the problem in its form; outputs poisoned first."""
    problem.poison_outputs()
    arguments = dict(problem.arguments(), lower_bound=problem.lower_bound, **problem.modes())
    arguments.update(overrides)
    flashkda.fwd(**arguments)


def rerun_as(problem, **changes):
    """A copy of `problem` with `changes` and fresh outputs, run by flashkda.fwd."""
    other = dataclasses.replace(
        problem, out=np.empty_like(problem.out),
        final_state=None if problem.final_state is None else np.empty_like(problem.final_state),
        **changes)
    run_fwd(other)
    return other


def assert_close(actual, expected, tolerance):
    out_error = rel_l2(flashkda.from_bf16(actual.out), flashkda.from_bf16(expected.out))
    assert out_error <= tolerance, f"out: relative L2 difference {out_error:.2e}"
    state_error = rel_l2(actual.final_state, expected.final_state)
    assert state_error <= tolerance, f"final_state: relative L2 difference {state_error:.2e}"


# --------------------------------------------------------------- prefill ---


@pytest.mark.parametrize("form", FORMS)
def test_forward_matches_the_recurrence(backend, rng, form):
    problem = make_problem(rng, seq_lens=[21, 0, 40], heads=HEADS, **FORMS[form])
    problem.poison_outputs()
    backend.fwd(lower_bound=problem.lower_bound, **problem.arguments(), **problem.modes())
    assert_accurate(problem)


def test_batched_softplus_with_bf16_state(rng):
    problem = make_problem(rng, batch=2, seq_len=37, heads=HEADS, gate_mode="softplus",
                           state_dtype=np.uint16)
    run_fwd(problem)
    assert_accurate(problem, state_tolerance=6e-3)


def test_softplus_equals_log_decay_given_the_same_log_decays(rng):
    softplus = make_problem(rng, batch=2, seq_len=37, heads=HEADS, gate_mode="softplus")
    run_fwd(softplus)
    log_decays = log_decay_fp64(widened(softplus.g), softplus.A_log, softplus.dt_bias, None,
                                "softplus").astype(np.float32)
    log_decay = rerun_as(softplus, g=log_decays, A_log=None, dt_bias=None, gate_mode="log_decay")
    assert_close(log_decay, softplus, EQUIVALENT_TOLERANCE)


def test_bounded_equals_log_decay_given_the_same_log_decays(rng):
    bounded = make_problem(rng, seq_lens=[30, 19], heads=HEADS, lower_bound=-2.5)
    run_fwd(bounded)
    log_decays = log_decay_fp64(widened(bounded.g), bounded.A_log, bounded.dt_bias,
                                bounded.lower_bound, "bounded").astype(np.float32)
    log_decay = rerun_as(bounded, g=log_decays, A_log=None, dt_bias=None, lower_bound=None,
                         gate_mode="log_decay")
    # The two gates take different chunk products (bf16 operands with the
    # floor, f16 level factors without: docs/NUMERICS.md), so each is held to
    # the recurrence (assert_accurate) and they to each other within its bound.
    assert_accurate(log_decay)
    assert_close(log_decay, bounded, 6e-3)


def test_probabilities_equal_logits_given_their_sigmoid(rng):
    logits = make_problem(rng, batch=2, seq_len=29, heads=HEADS)
    run_fwd(logits)
    probabilities = sigmoid(widened(logits.beta)).astype(np.float32)
    other = rerun_as(logits, beta=probabilities, beta_mode="probabilities")
    assert_close(other, logits, EQUIVALENT_TOLERANCE)


def test_probabilities_are_clamped_into_the_unit_interval(rng):
    problem = make_problem(rng, batch=1, seq_len=33, heads=HEADS, beta_mode="probabilities",
                           beta_dtype=np.float32)
    run_fwd(problem)
    clamped = rerun_as(problem, beta=np.clip(problem.beta, 0.0, 1.0))
    assert_close(clamped, problem, SAME_VALUES_TOLERANCE)


def test_positive_log_decays_are_read_as_zero(rng):
    problem = make_problem(rng, batch=1, seq_len=33, heads=HEADS, gate_mode="log_decay",
                           g_dtype=np.float32)
    assert (problem.g > 0).any()
    run_fwd(problem)
    clamped = rerun_as(problem, g=np.minimum(problem.g, 0.0))
    assert_close(clamped, problem, SAME_VALUES_TOLERANCE)


@pytest.mark.parametrize("name", ["g", "beta"])
def test_f32_values_equal_the_same_bf16_values(rng, name):
    gate_mode = "log_decay" if name == "g" else "bounded"
    bf16 = make_problem(rng, batch=1, seq_len=40, heads=HEADS, gate_mode=gate_mode)
    run_fwd(bf16)
    f32 = rerun_as(bf16, **{name: flashkda.from_bf16(getattr(bf16, name))})
    assert_close(f32, bf16, SAME_VALUES_TOLERANCE)


@pytest.mark.parametrize("gate_mode", ["bounded", "softplus"])
def test_absent_gate_parameters_are_their_neutral_values(rng, gate_mode):
    # Absent A_log is exp(A_log) = 1 (bounded only); absent dt_bias is 0.
    problem = make_problem(rng, batch=1, seq_len=40, heads=HEADS, gate_mode=gate_mode,
                           with_dt_bias=False, with_A_log=gate_mode == "softplus")
    run_fwd(problem)
    neutral = dict(dt_bias=np.zeros((HEADS, 128), np.float32))
    if gate_mode == "bounded":
        neutral["A_log"] = np.zeros(HEADS, np.float32)
    explicit = rerun_as(problem, **neutral)
    assert_close(explicit, problem, SAME_VALUES_TOLERANCE)


# ---------------------------------------------------------------- decode ---


@pytest.mark.parametrize("form", FORMS)
def test_decode_matches_the_recurrence(backend, rng, form):
    problem = make_problem(rng, batch=4, seq_len=3, heads=HEADS, with_initial_state=False,
                           with_final_state=False, **FORMS[form])
    problem.poison_outputs()
    pool = random_pool(rng)
    pool_before = pool.copy()
    indices = np.array([7, -1, 2, 5], dtype=np.int32)
    backend.decode(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                   **activations(problem), **problem.modes())
    expected_out, expected_pool = decode_reference_fp64(
        problem.q, problem.k, problem.v, problem.g, problem.beta, problem.A_log, problem.dt_bias,
        problem.scale, problem.lower_bound, pool_before, indices, **problem.modes())
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool,
                             padding_rows=[1], state_tolerance=DECODE_F32_STATE_TOLERANCE)


# ----------------------------------------------------------------- plans ---


def test_plan_of_a_form_runs_fwd_decode_and_prepared_launches(rng):
    problem = make_problem(rng, batch=2, seq_len=20, heads=HEADS, gate_mode="softplus",
                           beta_mode="probabilities", beta_dtype=np.float32)
    with flashkda.Plan(HEADS, backend="cpu", gate_mode="softplus",
                       beta_mode=BetaMode.PROBABILITIES) as plan:
        assert plan.gate_mode == GateMode.SOFTPLUS and plan.beta_mode == BetaMode.PROBABILITIES
        problem.poison_outputs()
        plan.fwd(**problem.arguments())
        assert_accurate(problem)
        launch = plan.prepare(**problem.arguments())
        problem.poison_outputs()
        launch()
        assert_accurate(problem)

        pool = random_pool(rng)
        pool_before = pool.copy()
        indices = np.array([3, 8], dtype=np.int64)
        decode = make_problem(rng, batch=2, seq_len=2, heads=HEADS, with_initial_state=False,
                              with_final_state=False, gate_mode="softplus",
                              beta_mode="probabilities", beta_dtype=np.float32)
        decode.poison_outputs()
        plan.prepare_decode(state_pool=pool, state_indices=indices, **activations(decode))()
        expected_out, expected_pool = decode_reference_fp64(
            decode.q, decode.k, decode.v, decode.g, decode.beta, decode.A_log, decode.dt_bias,
            decode.scale, None, pool_before, indices, **decode.modes())
        assert_pool_call_matches(decode, pool, pool_before, expected_out, expected_pool)


def test_plans_without_a_floor_have_no_lower_bound():
    for gate_mode in ("softplus", GateMode.LOG_DECAY, "log-decay"):
        with flashkda.Plan(HEADS, backend="cpu", gate_mode=gate_mode, lower_bound=None) as plan:
            assert plan.gate_mode == (GateMode.SOFTPLUS if gate_mode == "softplus"
                                      else GateMode.LOG_DECAY)
            for action in (plan.get_lower_bound, lambda: plan.set_lower_bound(-1.0)):
                with pytest.raises(FlashKDAError) as caught:
                    action()
                assert caught.value.message.startswith("plan:"), caught.value.message
                assert "bounded" in caught.value.message
    with flashkda.Plan(HEADS, backend="cpu") as plan:
        assert plan.gate_mode == GateMode.BOUNDED and plan.beta_mode == BetaMode.LOGITS
        assert plan.lower_bound == -5.0


def test_forms_are_part_of_the_plan_and_block_keys(rng, block_builds):
    problem = make_problem(rng, batch=1, seq_len=24, heads=HEADS, with_A_log=False,
                           with_dt_bias=False, beta_dtype=np.float32)
    results = []
    for beta_mode in ("logits", "probabilities", BetaMode.LOGITS, "logits"):
        run_fwd(problem, beta_mode=beta_mode)
        results.append(problem.out.copy())
    # A string and its member build one block each, on the same shared plan.
    assert len(block_builds) == 3
    assert block_builds[0].plan is block_builds[2].plan
    assert block_builds[1].plan is not block_builds[0].plan
    assert block_builds[1].plan.beta_mode == BetaMode.PROBABILITIES
    assert not np.array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])
    np.testing.assert_array_equal(results[0], results[3])
