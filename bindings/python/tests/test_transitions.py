# SPDX-License-Identifier: MIT
"""flashkda.transitions and flashkda.apply_transitions (and the Plan methods)
on host arrays: against the fp64 recurrence, composed over a cut sequence,
in both state layouts, with errors naming the argument."""

import numpy as np
import pytest

import flashkda
from kda_testing import kda_recurrence_fp64, make_problem, rel_l2, widened

K = 128


def fp64_transitions(p):
    """(M, E) of each sequence, V-first: the recurrence from the identity
    with v = 0, and from zeros."""
    inputs = {name: widened(getattr(p, name)) for name in ("q", "k", "v", "g", "beta")}
    common = dict(A_log=p.A_log, dt_bias=p.dt_bias, scale=p.scale, lower_bound=p.lower_bound,
                  cu_seqlens=p.cu_seqlens, **p.modes())
    _, e = kda_recurrence_fp64(initial_state=None, **common, **inputs)
    heads = p.k.shape[2]
    identity = np.broadcast_to(np.eye(K), (e.shape[0], heads, K, K))
    inputs["v"] = np.zeros_like(inputs["v"])
    _, m = kda_recurrence_fp64(initial_state=identity, **common, **inputs)
    return m, e


def run_transitions(p, plan=None):
    n = p.initial_state.shape[0]
    heads = p.k.shape[2]
    m = np.full((n, heads, K, K), np.nan, dtype=np.float32)
    e = np.full((n, heads, K, K), np.nan, dtype=np.float32)
    if plan is None:
        flashkda.transitions(p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, p.lower_bound, m, e,
                             p.cu_seqlens, **p.modes())
    else:
        plan.transitions(p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, m, e, p.cu_seqlens)
    assert np.isfinite(m).all() and np.isfinite(e).all()
    return m, e


@pytest.mark.parametrize("gate_mode", ["bounded", "softplus", "log_decay"])
def test_transitions_match_the_fp64_recurrence(rng, gate_mode):
    p = make_problem(rng, seq_lens=[37, 0, 51], heads=2, gate_mean=-6.0 if gate_mode == "bounded" else 0.0,
                     gate_mode=gate_mode, lower_bound=-5.0 if gate_mode == "bounded" else None)
    m, e = run_transitions(p)
    m_ref, e_ref = fp64_transitions(p)
    assert rel_l2(m, m_ref) < 2e-3
    assert rel_l2(e, e_ref) < 3e-3
    assert (m[1] == np.eye(K, dtype=np.float32)).all() and (e[1] == 0).all()  # empty sequence


def test_plan_kv_layout_holds_the_transposes(rng):
    p = make_problem(rng, seq_lens=[29, 40], heads=2, gate_mean=-6.0)
    m_vk, e_vk = run_transitions(p)
    with flashkda.Plan(2, backend="cpu", state_layout="kv") as plan:
        m_kv, e_kv = run_transitions(p, plan)
    assert np.array_equal(m_kv, np.swapaxes(m_vk, -1, -2))
    assert np.array_equal(e_kv, np.swapaxes(e_vk, -1, -2))


@pytest.mark.parametrize("state_dtype", [np.float32, np.uint16])
def test_pieces_compose_to_the_sequence(rng, state_dtype):
    whole = make_problem(rng, seq_lens=[90], heads=2, gate_mean=-6.0)
    whole.initial_state = rng.normal(size=whole.initial_state.shape).astype(np.float32)
    pieces = make_problem(rng, seq_lens=[90], heads=2, gate_mean=-6.0)
    for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias"):
        setattr(pieces, name, getattr(whole, name))
    pieces.cu_seqlens = np.array([0, 33, 33, 90], dtype=np.int64)  # with an empty piece
    pieces.initial_state = np.zeros((3, 2, K, K), dtype=np.float32)
    m, e = run_transitions(pieces)
    initial = whole.initial_state if state_dtype == np.float32 else flashkda.to_bf16(whole.initial_state)
    final = np.full_like(initial, np.nan if state_dtype == np.float32 else 0x7FC0)
    flashkda.apply_transitions(m[:, None], e[:, None], final, initial)
    _, expected = whole.reference() if state_dtype == np.float32 else kda_recurrence_fp64(
        *(widened(getattr(whole, n)) for n in ("q", "k", "v", "g", "beta")), whole.A_log,
        whole.dt_bias, whole.scale, whole.lower_bound,
        initial_state=flashkda.from_bf16(initial), cu_seqlens=whole.cu_seqlens)
    got = final if state_dtype == np.float32 else flashkda.from_bf16(final)
    assert rel_l2(got, expected) < (1e-3 if state_dtype == np.float32 else 2e-3)
    # In place, with the pieces in the wrong order: far off.
    state = initial.copy()
    flashkda.apply_transitions(m[::-1, None].copy(), e[::-1, None].copy(), state, state)
    got = state if state_dtype == np.float32 else flashkda.from_bf16(state)
    assert rel_l2(got, expected) > 1e-2


def test_errors_name_the_argument(rng):
    p = make_problem(rng, seq_lens=[20, 12], heads=2)
    m = np.zeros((2, 2, K, K), dtype=np.float32)
    e = np.zeros((2, 2, K, K), dtype=np.float32)
    with pytest.raises(flashkda.FlashKDAError, match="^transition_m"):
        flashkda.transitions(p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, -5.0, m[:1], e, p.cu_seqlens)
    with pytest.raises(flashkda.FlashKDAError, match="^transition_e"):
        flashkda.transitions(p.k, p.v, p.g, p.beta, p.A_log, p.dt_bias, -5.0, m, e.astype(np.float64),
                             p.cu_seqlens)
    final = np.zeros((2, 2, K, K), dtype=np.float32)
    with pytest.raises(flashkda.FlashKDAError, match="^final_state"):
        flashkda.apply_transitions(m[None], e[None], final[:1])
