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
    gate_rate = np.exp(A_log)[:, None]  # [H, 1]
    for n, (row, begin, end) in enumerate(sequences):
        state = (np.array(initial_state[n], dtype=np.float64) if initial_state is not None
                 else np.zeros((heads, dim_v, dim_k)))
        for t in range(begin, end):
            q_t, k_t = q[row, t], k[row, t]
            q_hat = q_t / np.sqrt(np.sum(q_t * q_t, axis=-1, keepdims=True) + 1e-6)
            k_hat = k_t / np.sqrt(np.sum(k_t * k_t, axis=-1, keepdims=True) + 1e-6)
            gate = lower_bound * sigmoid(gate_rate * (g[row, t] + dt_bias))  # [H, K]
            write_strength = sigmoid(beta[row, t])  # [H]
            state = state * np.exp(gate)[:, None, :]
            predicted = np.einsum("hvk,hk->hv", state, k_hat)
            correction = write_strength[:, None] * (v[row, t] - predicted)
            state = state + correction[:, :, None] * k_hat[:, None, :]
            out[row, t] = scale * np.einsum("hvk,hk->hv", state, q_hat)
        final_state[n] = state
    return out, final_state


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
                 lower_bound=-5.0):
    """Random inputs as in docs/BENCHMARKS.md: q, k, v, g, beta ~ N(0, 1) in bf16,
    A_log, dt_bias ~ U(0, 1), initial state ~ 0.1 N(0, 1).

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
        g=bf16_normal(batch, seq_len, heads, HEAD_DIM),
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
