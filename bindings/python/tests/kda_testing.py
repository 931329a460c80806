"""Test helpers: random KDA inputs and an independent fp64 recurrence."""

from dataclasses import dataclass
from typing import Optional

import numpy as np

import flashkda

HEAD_DIM = 128
BF16_NAN = np.uint16(0x7FC0)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def kda_recurrence_fp64(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound,
                        initial_state=None, cu_seqlens=None):
    """The token-by-token KDA recurrence in float64.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; A_log: [H];
    dt_bias: [H, K]; initial_state: [N, H, V, K] or None (zeros).
    Returns (out [B, T, H, V], final_state [N, H, V, K]).
    """
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    A_log = np.asarray(A_log, dtype=np.float64)
    dt_bias = np.asarray(dt_bias, dtype=np.float64)
    batch, seq_len, heads, dim_k = q.shape
    dim_v = v.shape[-1]
    if cu_seqlens is None:
        sequences = [(row, 0, seq_len) for row in range(batch)]
    else:
        offsets = [int(x) for x in cu_seqlens]
        sequences = [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]
    out = np.zeros((batch, seq_len, heads, dim_v))
    final_state = np.zeros((len(sequences), heads, dim_v, dim_k))
    for n, (row, begin, end) in enumerate(sequences):
        state = (np.array(initial_state[n], dtype=np.float64) if initial_state is not None
                 else np.zeros((heads, dim_v, dim_k)))
        for t in range(begin, end):
            out[row, t], state = kda_step_fp64(state, q[row, t], k[row, t], v[row, t], g[row, t],
                                               beta[row, t], A_log, dt_bias, scale, lower_bound)
        final_state[n] = state
    return out, final_state


def kda_step_fp64(state, q_t, k_t, v_t, g_t, beta_t, A_log, dt_bias, scale, lower_bound):
    """One token of every head in float64: state [H, V, K], q_t, k_t, g_t
    [H, K], v_t [H, V], beta_t [H]. Returns (out_t [H, V], the new state)."""
    q_hat = q_t / np.sqrt(np.sum(q_t * q_t, axis=-1, keepdims=True) + 1e-6)
    k_hat = k_t / np.sqrt(np.sum(k_t * k_t, axis=-1, keepdims=True) + 1e-6)
    gate_rate = np.exp(np.asarray(A_log, dtype=np.float64))[:, None]  # [H, 1]
    gate = lower_bound * sigmoid(gate_rate * (g_t + dt_bias))  # [H, K]
    write_strength = sigmoid(beta_t)  # [H]
    state = state * np.exp(gate)[:, None, :]
    predicted = np.einsum("hvk,hk->hv", state, k_hat)
    correction = write_strength[:, None] * (v_t - predicted)
    state = state + correction[:, :, None] * k_hat[:, None, :]
    return scale * np.einsum("hvk,hk->hv", state, q_hat), state


def is_null_slot(index, null_slot_rule):
    """Whether a pool index means padding under the plan's rule."""
    return index < 0 or (null_slot_rule == "nonpositive" and index == 0)


def decode_reference_fp64(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, state_pool,
                          state_indices, num_accepted_tokens=None, cu_seqlens=None,
                          null_slot_rule="negative"):
    """fkda_decode's documented semantics in float64, on bf16-widened inputs.

    state_pool [slots, H, V, K] (f32, or bf16 as uint16 bits); state_indices
    [N] or [N, W]. Returns (out [B, T, H, V], the updated pool in float64)."""
    q, k, v, g, beta = (flashkda.from_bf16(x).astype(np.float64) for x in (q, k, v, g, beta))
    dt_bias = np.asarray(dt_bias, dtype=np.float64)
    pool = (flashkda.from_bf16(state_pool) if state_pool.dtype == np.uint16
            else state_pool).astype(np.float64)
    batch, seq_len = q.shape[:2]
    if cu_seqlens is None:
        sequences = [(row, 0, seq_len) for row in range(batch)]
    else:
        offsets = [int(x) for x in cu_seqlens]
        sequences = [(0, offsets[n], offsets[n + 1]) for n in range(len(offsets) - 1)]
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    indices = np.asarray(state_indices)
    for n, (row, begin, end) in enumerate(sequences):
        if indices.ndim == 1:
            start_slot, write_slots = indices[n], None
        else:
            start_column = (int(num_accepted_tokens[n]) if num_accepted_tokens is not None else 1) - 1
            start_slot, write_slots = indices[n, start_column], indices[n]
        if is_null_slot(start_slot, null_slot_rule) or end == begin:
            continue
        state = pool[start_slot].copy()
        for t in range(begin, end):
            out[row, t], state = kda_step_fp64(state, q[row, t], k[row, t], v[row, t], g[row, t],
                                               beta[row, t], A_log, dt_bias, scale, lower_bound)
            if write_slots is not None and not is_null_slot(write_slots[t - begin], null_slot_rule):
                pool[write_slots[t - begin]] = state
        if write_slots is None:
            pool[start_slot] = state
    return out, pool


def rel_l2(actual, expected):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@dataclass
class Problem:
    """One forward call's inputs (bf16 as uint16 bits) and output buffers."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    A_log: np.ndarray
    dt_bias: np.ndarray
    scale: float
    lower_bound: float
    out: np.ndarray
    initial_state: Optional[np.ndarray]
    final_state: Optional[np.ndarray]
    cu_seqlens: Optional[np.ndarray]

    def arguments(self):
        return dict(q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta, scale=self.scale,
                    out=self.out, A_log=self.A_log, dt_bias=self.dt_bias,
                    initial_state=self.initial_state, final_state=self.final_state,
                    cu_seqlens=self.cu_seqlens)

    def poison_outputs(self):
        self.out[...] = BF16_NAN
        if self.final_state is not None:
            if self.final_state.dtype == np.uint16:
                self.final_state[...] = BF16_NAN
            else:
                self.final_state[...] = np.nan

    def state_as_f64(self, state):
        if state is None:
            return None
        return flashkda.from_bf16(state) if state.dtype == np.uint16 else state

    def reference(self):
        widened = {name: flashkda.from_bf16(getattr(self, name))
                   for name in ("q", "k", "v", "g", "beta")}
        return kda_recurrence_fp64(
            A_log=self.A_log, dt_bias=self.dt_bias, scale=self.scale,
            lower_bound=self.lower_bound,
            initial_state=self.state_as_f64(self.initial_state),
            cu_seqlens=self.cu_seqlens, **widened)


def make_problem(rng, *, batch=1, seq_len=40, heads=2, seq_lens=None, state_dtype=np.float32,
                 with_initial_state=True, with_final_state=True, cu_seqlens_dtype=np.int64,
                 lower_bound=-5.0, gate_mean=0.0):
    """Random inputs of the accuracy cases: q, k, v, beta ~ N(0, 1) and
    g ~ N(gate_mean, 1) in bf16, A_log, dt_bias ~ U(0, 1), initial state
    ~ 0.1 N(0, 1). gate_mean -6 gives slow decays, under which a lost or
    misplaced state changes the result visibly.

    With `seq_lens`, a varlen problem: batch 1, T = sum(seq_lens)."""
    cu_seqlens = None
    if seq_lens is not None:
        batch, seq_len = 1, int(sum(seq_lens))
        cu_seqlens = np.concatenate([[0], np.cumsum(seq_lens)]).astype(cu_seqlens_dtype)
        num_seqs = len(seq_lens)
    else:
        num_seqs = batch

    def bf16_normal(*shape):
        return flashkda.to_bf16(rng.standard_normal(shape))

    def state(values):
        if state_dtype == np.uint16:
            return flashkda.to_bf16(values)
        return values.astype(np.float32)

    state_shape = (num_seqs, heads, HEAD_DIM, HEAD_DIM)
    return Problem(
        q=bf16_normal(batch, seq_len, heads, HEAD_DIM),
        k=bf16_normal(batch, seq_len, heads, HEAD_DIM),
        v=bf16_normal(batch, seq_len, heads, HEAD_DIM),
        g=flashkda.to_bf16(gate_mean + rng.standard_normal((batch, seq_len, heads, HEAD_DIM))),
        beta=bf16_normal(batch, seq_len, heads),
        A_log=rng.uniform(0.0, 1.0, heads).astype(np.float32),
        dt_bias=rng.uniform(0.0, 1.0, (heads, HEAD_DIM)).astype(np.float32),
        scale=HEAD_DIM ** -0.5,
        lower_bound=lower_bound,
        out=np.empty((batch, seq_len, heads, HEAD_DIM), dtype=np.uint16),
        initial_state=state(0.1 * rng.standard_normal(state_shape)) if with_initial_state else None,
        final_state=np.empty(state_shape, dtype=state_dtype) if with_final_state else None,
        cu_seqlens=cu_seqlens,
    )


def assert_accurate(problem, out_tolerance=6e-3, state_tolerance=5e-3):
    """Every output element written (no poison left) and close to the fp64 recurrence."""
    out = flashkda.from_bf16(problem.out)
    assert not np.isnan(out).any(), "out: some elements were not written"
    expected_out, expected_state = problem.reference()
    out_error = rel_l2(out, expected_out)
    assert out_error <= out_tolerance, f"out: relative L2 error {out_error:.2e}"
    if problem.final_state is not None:
        state = problem.state_as_f64(problem.final_state)
        assert not np.isnan(state).any(), "final_state: some elements were not written"
        state_error = rel_l2(state, expected_state)
        assert state_error <= state_tolerance, f"final_state: relative L2 error {state_error:.2e}"
