# SPDX-License-Identifier: MIT
"""The decode step as serving runtimes call it: a few tokens per sequence,
states in a pool updated in place."""

from . import _layer
from ._abi import DEFAULT_OUT_NORM_EPS, BetaMode, GateMode, NullSlotRule
from ._api import DECODE, run_derived


def decode(
    q,
    k,
    v,
    g,
    beta,
    scale,
    out,
    A_log,
    dt_bias,
    lower_bound,
    state_pool,
    state_indices,
    num_accepted_tokens=None,
    cu_seqlens=None,
    *,
    null_slot_rule=NullSlotRule.NEGATIVE,
    gate_mode=GateMode.BOUNDED,
    beta_mode=BetaMode.LOGITS,
    conv_weight=None,
    conv_bias=None,
    conv_state=None,
    out_gate=None,
    out_norm_weight=None,
    out_norm_eps=DEFAULT_OUT_NORM_EPS,
):
    """fkda_decode on a plan shared by every call of the same descriptor
    (flashkda.Plan.decode runs on a plan of your own).

    Writes `out` and updates `state_pool` in place. Host arrays run on the
    CPU backend, CUDA arrays on the GPU backend, on the current stream of
    their producer; the plan's state dtype is the pool's.

      q, k, g, v, out    bf16 [N, T, H, 128] (T <= 16), or packed
                         [1, total, H, 128] with cu_seqlens [N + 1]
                         (lengths 0 to 16)
      beta               bf16 or f32 [N, T, H] (or [1, total, H])
      A_log, dt_bias     f32 [H] and [H, 128], or None where gate_mode allows
      lower_bound        the bounded gate's floor; None (or -5) for the others
      state_pool         f32 or bf16 [slots, H, 128, 128]
      state_indices      int32/int64 [N]: read and write slot state_indices[n];
                         or [N, W] for speculative verify: start from column
                         num_accepted_tokens[n] - 1 and write the state after
                         token t to the slot in column t
      num_accepted_tokens  int32/int64 [N] in [1, W], with [N, W] indices only
      null_slot_rule     "negative" (index < 0 is padding) or "nonpositive"
                         (index <= 0 is padding, slot 0 reserved)
      gate_mode, beta_mode  as for flashkda.fwd ("bounded", "softplus" or
                         "log_decay"; "logits" or "probabilities")
      conv_weight, conv_bias, conv_state, out_gate, out_norm_weight,
      out_norm_eps       the layer step, as for flashkda.fwd (no plan flag
                         needed); conv_state rows are pool slots, read and
                         updated in place with the recurrent state (large GPU
                         batches are fastest with a contiguous conv_state).
                         Slot tables [N, W] take no convolution.
    A sequence whose starting slot is null is padding: its output rows are
    zero and no state is read or written.
    """
    run_derived(DECODE, (q, k, v, g, beta, A_log, dt_bias, out, state_pool, state_indices,
                         num_accepted_tokens, cu_seqlens)
                + _layer.arrays(conv_weight, conv_bias, conv_state, out_gate, out_norm_weight),
                scale, lower_bound, null_slot_rule, gate_mode, beta_mode,
                out_norm_eps=out_norm_eps)
