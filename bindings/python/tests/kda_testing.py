# SPDX-License-Identifier: MIT
"""Test helpers: random KDA inputs and an independent fp64 recurrence."""

from dataclasses import dataclass
from typing import Optional

import numpy as np

import flashkda

HEAD_DIM = 128
BF16_NAN = np.uint16(0x7FC0)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x):
    """log(1 + exp(x)), taken as x above 20 (the library's threshold)."""
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def log_decay_fp64(g, A_log, dt_bias, lower_bound, gate_mode="bounded"):
    """The log-decay a <= 0 of every element of g [..., H, K] under a gate
    mode ("bounded", "softplus", "log_decay"; header fkda_gate_mode), in
    float64. A_log [H] and dt_bias [H, K] may be None (absent)."""
    g = np.asarray(g, dtype=np.float64)
    if gate_mode == "log_decay":
        return np.minimum(g, 0.0)
    heads = g.shape[-2]
    rate = np.ones((heads, 1)) if A_log is None else np.exp(np.asarray(A_log, np.float64))[:, None]
    bias = 0.0 if dt_bias is None else np.asarray(dt_bias, dtype=np.float64)
    if gate_mode == "softplus":
        return -rate * softplus(g + bias)
    assert gate_mode == "bounded", gate_mode
    return lower_bound * sigmoid(rate * (g + bias))


def step_size_fp64(beta, beta_mode="logits"):
    """The delta rule's step size from beta (header fkda_beta_mode)."""
    beta = np.asarray(beta, dtype=np.float64)
    if beta_mode == "probabilities":
        return np.clip(beta, 0.0, 1.0)
    assert beta_mode == "logits", beta_mode
    return sigmoid(beta)


def kda_recurrence_fp64(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound,
                        initial_state=None, cu_seqlens=None, gate_mode="bounded",
                        beta_mode="logits"):
    """The token-by-token KDA recurrence in float64.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; A_log: [H] or
    None; dt_bias: [H, K] or None; initial_state: [N, H, V, K] or None
    (zeros); gate_mode and beta_mode as the plan's.
    Returns (out [B, T, H, V], final_state [N, H, V, K]).
    """
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    modes = dict(gate_mode=gate_mode, beta_mode=beta_mode)
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
                                               beta[row, t], A_log, dt_bias, scale, lower_bound,
                                               **modes)
        final_state[n] = state
    return out, final_state


def kda_step_fp64(state, q_t, k_t, v_t, g_t, beta_t, A_log, dt_bias, scale, lower_bound,
                  gate_mode="bounded", beta_mode="logits"):
    """One token of every head in float64: state [H, V, K], q_t, k_t, g_t
    [H, K], v_t [H, V], beta_t [H]. Returns (out_t [H, V], the new state)."""
    q_hat = q_t / np.sqrt(np.sum(q_t * q_t, axis=-1, keepdims=True) + 1e-6)
    k_hat = k_t / np.sqrt(np.sum(k_t * k_t, axis=-1, keepdims=True) + 1e-6)
    gate = log_decay_fp64(g_t, A_log, dt_bias, lower_bound, gate_mode)  # [H, K]
    write_strength = step_size_fp64(beta_t, beta_mode)  # [H]
    state = state * np.exp(gate)[:, None, :]
    predicted = np.einsum("hvk,hk->hv", state, k_hat)
    correction = write_strength[:, None] * (v_t - predicted)
    state = state + correction[:, :, None] * k_hat[:, None, :]
    return scale * np.einsum("hvk,hk->hv", state, q_hat), state


def is_null_slot(index, null_slot_rule):
    """Whether a pool index means padding under the plan's rule."""
    return index < 0 or (null_slot_rule == "nonpositive" and index == 0)


def widened(array):
    """bf16 bits (uint16) or f32 values as float64."""
    array = np.asarray(array)
    return (flashkda.from_bf16(array) if array.dtype == np.uint16 else array).astype(np.float64)


def decode_reference_fp64(q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, state_pool,
                          state_indices, num_accepted_tokens=None, cu_seqlens=None,
                          null_slot_rule="negative", gate_mode="bounded", beta_mode="logits"):
    """fkda_decode's documented semantics in float64, on bf16-widened inputs.

    state_pool [slots, H, V, K] (f32, or bf16 as uint16 bits); state_indices
    [N] or [N, W]. Returns (out [B, T, H, V], the updated pool in float64)."""
    q, k, v, g, beta = (widened(x) for x in (q, k, v, g, beta))
    modes = dict(gate_mode=gate_mode, beta_mode=beta_mode)
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
                                               beta[row, t], A_log, dt_bias, scale, lower_bound,
                                               **modes)
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
    """One forward call's inputs (bf16 as uint16 bits) and output buffers.

    g and beta are bf16 bits or float32 values; A_log and dt_bias None where
    the gate takes them absent; lower_bound None for gates without a floor."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    A_log: Optional[np.ndarray]
    dt_bias: Optional[np.ndarray]
    scale: float
    lower_bound: Optional[float]
    out: np.ndarray
    initial_state: Optional[np.ndarray]
    final_state: Optional[np.ndarray]
    cu_seqlens: Optional[np.ndarray]
    gate_mode: str = "bounded"
    beta_mode: str = "logits"

    def arguments(self):
        return dict(q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta, scale=self.scale,
                    out=self.out, A_log=self.A_log, dt_bias=self.dt_bias,
                    initial_state=self.initial_state, final_state=self.final_state,
                    cu_seqlens=self.cu_seqlens)

    def modes(self):
        """The keywords of flashkda.fwd and flashkda.decode (and Plan) that
        select the problem's gate and beta forms."""
        return dict(gate_mode=self.gate_mode, beta_mode=self.beta_mode)

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
        inputs = {name: widened(getattr(self, name)) for name in ("q", "k", "v", "g", "beta")}
        return kda_recurrence_fp64(
            A_log=self.A_log, dt_bias=self.dt_bias, scale=self.scale,
            lower_bound=self.lower_bound,
            initial_state=self.state_as_f64(self.initial_state),
            cu_seqlens=self.cu_seqlens, **self.modes(), **inputs)


def make_problem(rng, *, batch=1, seq_len=40, heads=2, seq_lens=None, state_dtype=np.float32,
                 with_initial_state=True, with_final_state=True, cu_seqlens_dtype=np.int64,
                 lower_bound=-5.0, gate_mean=0.0, gate_mode="bounded", beta_mode="logits",
                 g_dtype=np.uint16, beta_dtype=np.uint16, with_A_log=True, with_dt_bias=True):
    """Random inputs of the accuracy cases: q, k, v, beta ~ N(0, 1) and
    g ~ N(gate_mean, 1) in bf16, A_log, dt_bias ~ U(0, 1), initial state
    ~ 0.1 N(0, 1). gate_mean -6 gives slow decays, under which a lost or
    misplaced state changes the result visibly.

    Other gates and beta forms (the plan's gate_mode and beta_mode):
      "softplus"       Kimi-Linear's gate parameters: A_log = log U(1, 16),
                       dt_bias the inverse softplus of log-uniform values in
                       [0.001, 0.1]; g ~ N(gate_mean, 1)
      "log_decay"      g the log-decay itself, ~ N(-0.5, 0.5) (some above 0,
                       which the library reads as 0); no A_log, no dt_bias
      "probabilities"  beta ~ U(-0.1, 1.1) (the library clamps into [0, 1])
    g_dtype and beta_dtype: np.uint16 (bf16 bits) or np.float32. with_A_log,
    with_dt_bias False leave them None (absent).

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

    def as_dtype(values, dtype):
        return flashkda.to_bf16(values) if dtype == np.uint16 else values.astype(dtype)

    state_shape = (num_seqs, heads, HEAD_DIM, HEAD_DIM)
    activation_shape = (batch, seq_len, heads, HEAD_DIM)
    q = bf16_normal(*activation_shape)
    k = bf16_normal(*activation_shape)
    v = bf16_normal(*activation_shape)
    if gate_mode == "log_decay":
        g = -0.5 + 0.5 * rng.standard_normal(activation_shape)
    else:
        g = gate_mean + rng.standard_normal(activation_shape)
    if beta_mode == "probabilities":
        beta = rng.uniform(-0.1, 1.1, (batch, seq_len, heads))
    else:
        beta = rng.standard_normal((batch, seq_len, heads))
    if gate_mode == "softplus":
        A_log = np.log(rng.uniform(1.0, 16.0, heads))
        dt_bias = np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(1e-1),
                                                     (heads, HEAD_DIM)))))
    else:
        A_log = rng.uniform(0.0, 1.0, heads)
        dt_bias = rng.uniform(0.0, 1.0, (heads, HEAD_DIM))
    with_gate_parameters = gate_mode != "log_decay"
    return Problem(
        q=q,
        k=k,
        v=v,
        g=as_dtype(g, g_dtype),
        beta=as_dtype(beta, beta_dtype),
        A_log=A_log.astype(np.float32) if with_A_log and with_gate_parameters else None,
        dt_bias=dt_bias.astype(np.float32) if with_dt_bias and with_gate_parameters else None,
        scale=HEAD_DIM ** -0.5,
        lower_bound=lower_bound if gate_mode == "bounded" else None,
        out=np.empty((batch, seq_len, heads, HEAD_DIM), dtype=np.uint16),
        initial_state=state(0.1 * rng.standard_normal(state_shape)) if with_initial_state else None,
        final_state=np.empty(state_shape, dtype=state_dtype) if with_final_state else None,
        cu_seqlens=cu_seqlens,
        gate_mode=gate_mode,
        beta_mode=beta_mode,
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
