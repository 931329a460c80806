# SPDX-License-Identifier: MIT
"""States in a pool: decode, speculative verify, prefill by slot, padding and
checkpoints, against the fp64 recurrence. Each test taking `backend` runs on
the CPU backend with numpy arrays and, where torch sees a CUDA device, on the
GPU backend with the same values as torch CUDA tensors. The error tests run
on the CPU backend, which checks indices on the host.

On a GPU machine:
    PYTHONPATH=bindings/python FLASHKDA_LIBRARY=build/libflashkda.so.0 \
        python3 -m pytest -q -p no:cacheprovider bindings/python/tests/test_serve.py
"""

import numpy as np
import pytest

import flashkda
from kda_testing import (
    BF16_NAN,
    decode_reference_fp64,
    kda_recurrence_fp64,
    make_problem,
    rel_l2,
)

def torch_cuda():
    """torch when it sees a CUDA device, else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


class Backend:
    """Calls flashkda.fwd and flashkda.decode with numpy arguments, as they
    are (CPU backend) or moved to torch CUDA tensors (GPU backend), the
    written tensors copied back into the numpy arrays afterwards."""

    WRITTEN = ("out", "final_state", "state_pool", "checkpoints")

    def __init__(self, name):
        self.name = name
        self.torch = torch_cuda() if name == "cuda" else None

    def fwd(self, **arguments):
        self._call(flashkda.fwd, arguments)

    def decode(self, **arguments):
        self._call(flashkda.decode, arguments)

    def _call(self, function, arguments):
        if self.torch is None:
            function(**arguments)
            return
        moved = {name: self._to_device(value) if isinstance(value, np.ndarray) else value
                 for name, value in arguments.items()}
        function(**moved)
        for name in self.WRITTEN:
            if arguments.get(name) is not None:
                arguments[name][...] = self._to_host(moved[name])

    def _to_device(self, array):
        torch = self.torch
        if array.dtype == np.uint16:  # bf16 bit patterns
            return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).cuda().view(
                torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(array)).cuda()

    def _to_host(self, tensor):
        torch = self.torch
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).cpu().numpy().view(np.uint16)
        return tensor.cpu().numpy()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    torch_cuda() is None, reason="torch sees no CUDA device"))])
def backend(request):
    return Backend(request.param)


SLOTS = 10
HEADS = 2
SLOW_DECAY = -6.0  # g ~ N(-6, 1): the state read from the pool dominates the result
# Decode runs the recurrence token by token in f32; prefill is chunked with
# bf16 operands, as on the GPU (the accuracy targets of the forward tests).
DECODE_F32_STATE_TOLERANCE = 1e-4
PREFILL_STATE_TOLERANCE = 5e-3
BF16_STATE_TOLERANCE = 6e-3


def random_pool(rng, heads=HEADS, dtype=np.float32):
    values = rng.standard_normal((SLOTS, heads, 128, 128))
    return flashkda.to_bf16(values) if dtype == np.uint16 else values.astype(np.float32)


def widened(array):
    return flashkda.from_bf16(array) if array.dtype == np.uint16 else array.astype(np.float64)


def decode_problem(rng, batch, seq_len, **shape):
    problem = make_problem(rng, batch=batch, seq_len=seq_len, heads=HEADS, with_initial_state=False,
                           with_final_state=False, gate_mean=SLOW_DECAY, **shape)
    problem.poison_outputs()
    return problem


def activations(problem):
    return dict(q=problem.q, k=problem.k, v=problem.v, g=problem.g, beta=problem.beta,
                scale=problem.scale, out=problem.out, A_log=problem.A_log, dt_bias=problem.dt_bias)


def assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool, padding_rows=(),
                             state_tolerance=DECODE_F32_STATE_TOLERANCE):
    """Every output row written, padding rows zero, out and the written slots
    close to the reference (f32 slots within `state_tolerance`), every other
    slot bit for bit as it was."""
    out = flashkda.from_bf16(problem.out)
    assert not np.isnan(out).any(), "out: some elements were not written"
    for row in padding_rows:
        assert not out[row].any(), f"out: padding rows {row} are not zero"
    out_error = rel_l2(out, expected_out)
    assert out_error <= 6e-3, f"out: relative L2 error {out_error:.2e}"
    written = [slot for slot in range(SLOTS)
               if not np.array_equal(expected_pool[slot], widened(pool_before[slot]))]
    assert written, "the reference writes no slot: the test checks nothing"
    for slot in range(SLOTS):
        if slot in written:
            tolerance = BF16_STATE_TOLERANCE if pool.dtype == np.uint16 else state_tolerance
            error = rel_l2(widened(pool[slot]), expected_pool[slot])
            assert error <= tolerance, f"state_pool[{slot}]: relative L2 error {error:.2e}"
        else:
            assert np.array_equal(pool[slot], pool_before[slot]), f"state_pool[{slot}] was touched"


@pytest.mark.parametrize("pool_dtype", [np.float32, np.uint16], ids=["f32_pool", "bf16_pool"])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
def test_decode_one_token_on_scattered_slots(backend, rng, pool_dtype, index_dtype):
    problem = decode_problem(rng, batch=4, seq_len=1)
    pool = random_pool(rng, dtype=pool_dtype)
    pool_before = pool.copy()
    indices = np.array([7, -1, 2, 5], dtype=index_dtype)
    backend.decode(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                    **activations(problem))
    expected_out, expected_pool = decode_reference_fp64(
        problem.q, problem.k, problem.v, problem.g, problem.beta, problem.A_log, problem.dt_bias,
        problem.scale, problem.lower_bound, pool_before, indices)
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool,
                             padding_rows=[1])


def test_decode_several_tokens_with_slot_zero_reserved(backend, rng):
    problem = decode_problem(rng, batch=3, seq_len=5)
    pool = random_pool(rng)
    pool_before = pool.copy()
    indices = np.array([3, 0, 9], dtype=np.int32)
    backend.decode(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                    null_slot_rule="nonpositive", **activations(problem))
    expected_out, expected_pool = decode_reference_fp64(
        problem.q, problem.k, problem.v, problem.g, problem.beta, problem.A_log, problem.dt_bias,
        problem.scale, problem.lower_bound, pool_before, indices, null_slot_rule="nonpositive")
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool,
                             padding_rows=[1])


def test_decode_packed_sequences_with_int32_offsets(backend, rng):
    lengths = [3, 0, 16, 1, 2]
    problem = make_problem(rng, seq_lens=lengths, heads=HEADS, with_initial_state=False,
                           with_final_state=False, cu_seqlens_dtype=np.int32,
                           gate_mean=SLOW_DECAY)
    problem.poison_outputs()
    pool = random_pool(rng)
    pool_before = pool.copy()
    # The zero-length sequence and the padded one (-1) touch nothing.
    indices = np.array([8, 4, 1, -1, 6], dtype=np.int32)
    backend.decode(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                    cu_seqlens=problem.cu_seqlens, **activations(problem))
    expected_out, expected_pool = decode_reference_fp64(
        problem.q, problem.k, problem.v, problem.g, problem.beta, problem.A_log, problem.dt_bias,
        problem.scale, problem.lower_bound, pool_before, indices, cu_seqlens=problem.cu_seqlens)
    padded_token = int(problem.cu_seqlens[3])
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool,
                             padding_rows=[(0, padded_token)])


def test_speculative_verify_starts_at_the_accepted_column(backend, rng):
    draft_tokens = 4
    problem = decode_problem(rng, batch=3, seq_len=draft_tokens)
    pool = random_pool(rng)
    pool_before = pool.copy()
    # Row n holds the slots of draft positions 0..3; -1 columns are not written.
    table = np.array([[1, 2, 3, 4], [5, 6, -1, 7], [8, 9, 0, -1]], dtype=np.int32)
    num_accepted = np.array([3, 1, 2], dtype=np.int32)
    backend.decode(lower_bound=problem.lower_bound, state_pool=pool, state_indices=table,
                    num_accepted_tokens=num_accepted, **activations(problem))
    expected_out, expected_pool = decode_reference_fp64(
        problem.q, problem.k, problem.v, problem.g, problem.beta, problem.A_log, problem.dt_bias,
        problem.scale, problem.lower_bound, pool_before, table, num_accepted_tokens=num_accepted)
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool)


def test_plan_decode_carries_the_state_from_step_to_step(rng):
    pool = random_pool(rng)
    pool_before = pool.copy()
    indices = np.array([4, 2], dtype=np.int64)
    expected_pool = widened(pool)
    with flashkda.Plan(HEADS, backend="cpu") as plan:
        assert plan.decode_workspace_size(2, 2) >= 0
        for _ in range(3):
            problem = decode_problem(rng, batch=2, seq_len=1)
            plan.decode(state_pool=pool, state_indices=indices, **activations(problem))
            expected_out, expected_pool = decode_reference_fp64(
                problem.q, problem.k, problem.v, problem.g, problem.beta, problem.A_log,
                problem.dt_bias, problem.scale, problem.lower_bound, expected_pool, indices)
            assert rel_l2(flashkda.from_bf16(problem.out), expected_out) <= 6e-3
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool)


def test_decode_rejects_an_index_outside_the_pool(rng):
    problem = decode_problem(rng, batch=2, seq_len=1)
    pool = random_pool(rng)
    indices = np.array([1, SLOTS], dtype=np.int64)
    with pytest.raises(flashkda.FlashKDAError) as caught:
        flashkda.decode(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                        **activations(problem))
    assert "state_indices" in caught.value.message


def test_decode_rejects_more_than_sixteen_tokens(rng):
    problem = decode_problem(rng, batch=1, seq_len=17)
    pool = random_pool(rng)
    with pytest.raises(flashkda.FlashKDAError):
        flashkda.decode(lower_bound=problem.lower_bound, state_pool=pool,
                        state_indices=np.array([1], dtype=np.int32), **activations(problem))


# ------------------------------------------------------------- prefill by slot


def prefill_problem(rng, lengths):
    problem = make_problem(rng, seq_lens=lengths, heads=HEADS, with_initial_state=False,
                           with_final_state=False, cu_seqlens_dtype=np.int32,
                           gate_mean=SLOW_DECAY)
    problem.poison_outputs()
    return problem


def prefill_reference(problem, initial_states, cu_seqlens=None):
    """(out, final states) of the fp64 recurrence; `cu_seqlens` replaces the
    problem's sequences (token ranges of the packed row)."""
    widened_inputs = {name: flashkda.from_bf16(getattr(problem, name))
                      for name in ("q", "k", "v", "g", "beta")}
    return kda_recurrence_fp64(
        A_log=problem.A_log, dt_bias=problem.dt_bias, scale=problem.scale,
        lower_bound=problem.lower_bound, initial_state=initial_states,
        cu_seqlens=problem.cu_seqlens if cu_seqlens is None else cu_seqlens, **widened_inputs)


def test_prefill_on_a_pool_equals_contiguous_states(backend, rng):
    problem = prefill_problem(rng, [20, 33, 5])
    pool = random_pool(rng)
    pool_before = pool.copy()
    indices = np.array([6, 1, 3], dtype=np.int32)
    backend.fwd(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                 cu_seqlens=problem.cu_seqlens, **activations(problem))
    pool_out = problem.out.copy()

    final_state = np.full((3, HEADS, 128, 128), np.nan, dtype=np.float32)
    problem.poison_outputs()
    backend.fwd(lower_bound=problem.lower_bound, initial_state=pool_before[indices],
                 final_state=final_state, cu_seqlens=problem.cu_seqlens, **activations(problem))
    assert rel_l2(flashkda.from_bf16(pool_out), flashkda.from_bf16(problem.out)) <= 1e-6
    assert rel_l2(pool[indices], final_state) <= 1e-6

    expected_out, expected_final = prefill_reference(problem, widened(pool_before[indices]))
    expected_pool = widened(pool_before)
    expected_pool[indices] = expected_final
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool,
                             state_tolerance=PREFILL_STATE_TOLERANCE)


def test_prefill_padding_and_sequences_without_initial_state(backend, rng):
    lengths = [18, 7, 30]
    problem = prefill_problem(rng, lengths)
    pool = random_pool(rng)
    pool_before = pool.copy()
    indices = np.array([4, -1, 2], dtype=np.int64)
    has_initial_state = np.array([True, True, False])
    backend.fwd(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                 has_initial_state=has_initial_state, cu_seqlens=problem.cu_seqlens,
                 **activations(problem))

    initial = widened(pool_before[[4, 0, 2]])
    initial[2] = 0.0
    expected_out, expected_final = prefill_reference(problem, initial)
    padded = slice(lengths[0], lengths[0] + lengths[1])
    expected_out[0, padded] = 0.0
    expected_pool = widened(pool_before)
    expected_pool[4], expected_pool[2] = expected_final[0], expected_final[2]
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool,
                             padding_rows=[(0, padded)], state_tolerance=PREFILL_STATE_TOLERANCE)


def states_after(problem, initial_states, offsets):
    """The reference state of each sequence after each checkpoint offset
    (NaN where the offset is negative): [N, C, H, V, K]."""
    starts = problem.cu_seqlens[:-1]
    states = np.full(offsets.shape + (HEADS, 128, 128), np.nan)
    for n, row in enumerate(offsets):
        for c, count in enumerate(row):
            if count < 0:
                continue
            _, final = prefill_reference(problem, initial_states[n:n + 1],
                                         cu_seqlens=[starts[n], starts[n] + count])
            states[n, c] = final[0]
    return states


@pytest.mark.parametrize("checkpoint_dtype", [np.float32, np.uint16], ids=["f32", "bf16"])
def test_checkpoints_into_a_tensor(backend, rng, checkpoint_dtype):
    problem = prefill_problem(rng, [40, 64])
    pool = random_pool(rng)
    pool_before = pool.copy()
    indices = np.array([5, 8], dtype=np.int32)
    offsets = np.array([[16, 32, -1], [16, 48, 64]], dtype=np.int32)
    checkpoints = np.empty((2, 3, HEADS, 128, 128), dtype=checkpoint_dtype)
    checkpoints[...] = BF16_NAN if checkpoint_dtype == np.uint16 else np.nan
    backend.fwd(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                 checkpoint_offsets=offsets, checkpoints=checkpoints,
                 cu_seqlens=problem.cu_seqlens, **activations(problem))

    initial = widened(pool_before[indices])
    expected = states_after(problem, initial, offsets)
    tolerance = BF16_STATE_TOLERANCE if checkpoint_dtype == np.uint16 else PREFILL_STATE_TOLERANCE
    for n, c in np.ndindex(offsets.shape):
        actual = widened(checkpoints[n, c])
        if offsets[n, c] < 0:
            assert np.isnan(actual).all(), f"checkpoints[{n}, {c}] has no offset but was written"
        else:
            error = rel_l2(actual, expected[n, c])
            assert error <= tolerance, f"checkpoints[{n}, {c}]: relative L2 error {error:.2e}"
    expected_out, expected_final = prefill_reference(problem, initial)
    expected_pool = widened(pool_before)
    expected_pool[indices] = expected_final
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool,
                             state_tolerance=PREFILL_STATE_TOLERANCE)


def test_checkpoints_into_pool_slots(backend, rng):
    problem = prefill_problem(rng, [40, 64])
    pool = random_pool(rng)
    pool_before = pool.copy()
    indices = np.array([1, 2], dtype=np.int32)
    offsets = np.array([[16, 32, -1], [16, 48, 64]], dtype=np.int64)
    slots = np.array([[3, 4, 9], [5, -1, 7]], dtype=np.int64)
    backend.fwd(lower_bound=problem.lower_bound, state_pool=pool, state_indices=indices,
                 checkpoint_offsets=offsets, checkpoint_slots=slots,
                 cu_seqlens=problem.cu_seqlens, **activations(problem))

    initial = widened(pool_before[indices])
    checkpoint_states = states_after(problem, initial, offsets)
    expected_out, expected_final = prefill_reference(problem, initial)
    expected_pool = widened(pool_before)
    for n, c in np.ndindex(offsets.shape):
        if offsets[n, c] >= 0 and slots[n, c] >= 0:
            expected_pool[slots[n, c]] = checkpoint_states[n, c]
    expected_pool[indices] = expected_final
    assert_pool_call_matches(problem, pool, pool_before, expected_out, expected_pool,
                             state_tolerance=PREFILL_STATE_TOLERANCE)


def test_pool_arguments_reach_the_library_by_name(rng):
    problem = prefill_problem(rng, [16])
    pool = random_pool(rng)
    with pytest.raises(flashkda.FlashKDAError) as caught:
        flashkda.fwd(lower_bound=problem.lower_bound, state_pool=pool,
                     state_indices=np.array([1.5], dtype=np.float32),
                     cu_seqlens=problem.cu_seqlens, **activations(problem))
    assert "state_indices" in caught.value.message


def test_null_slot_rule_and_debug_checks_reach_the_plan():
    with flashkda.Plan(HEADS, backend="cpu", null_slot_rule=flashkda.NullSlotRule.NONPOSITIVE,
                       debug_checks=True) as plan:
        assert plan.backend == flashkda.Backend.CPU
    with pytest.raises(flashkda.FlashKDAError) as caught:
        flashkda.Plan(HEADS, backend="cpu", null_slot_rule="zero")
    assert caught.value.message.startswith("null_slot_rule:")
    with pytest.raises(flashkda.FlashKDAError) as caught:
        flashkda.Plan(HEADS, backend="cpu", null_slot_rule=7)
    assert "null_slot_rule" in caught.value.message
