// SPDX-License-Identifier: MIT
// The validated descriptions of fkda_transitions and fkda_apply_transitions
// as the backends see them (validate_transitions.cpp builds them; backends
// trust them completely).
#pragma once

#include <cstdint>

#include "flashkda.h"
#include "prefill_problem.h"

namespace fkda {

// fkda_transitions: for each (sequence, head), M (K x K) and E (V x K) of
// the sequence's tokens (flashkda.h, "Segment transitions").
// q and out are empty, scale unused.
struct TransitionProblem : RecurrenceCall {
  // f32, packed. VK plans: M [N, H, K, K] with S_out = S_in M, E [N, H, V, K].
  // KV plans: the transposes, M^T [N, H, K, K] and E^T [N, H, K, V].
  float* transition_m = nullptr;
  float* transition_e = nullptr;
};

// The transition problem as a forward problem without q, out or states, so
// that both backends run their forward pass's chunk steps on its inputs.
inline PrefillProblem as_prefill(const TransitionProblem& t) {
  PrefillProblem p;
  static_cast<RecurrenceCall&>(p) = t;
  p.scale = 1.f;
  p.state_dtype = FKDA_DTYPE_F32;  // M and E are f32 whatever the plan's states are
  return p;
}

// fkda_apply_transitions: S <- S M_r + E_r for r = 0 .. R-1, per (sequence, head).
struct ApplyProblem {
  int64_t num_transitions = 0;  // R (>= 0)
  int64_t num_seqs = 0;         // N
  int32_t num_heads = 0;        // H
  int32_t head_dim_k = 128;
  int32_t head_dim_v = 128;

  // f32, packed, [R, N, H, K, K] and [R, N, H, V, K] (KV plans transposed,
  // as in TransitionProblem).
  const float* transition_m = nullptr;
  const float* transition_e = nullptr;

  // Packed [N, H, V, K] (or [N, H, K, V]) in state_dtype. initial_state NULL:
  // zeros. final_state may equal initial_state (in place).
  const void* initial_state = nullptr;
  void* final_state = nullptr;
  int32_t state_dtype = 0;
  int32_t state_layout = 0;
};

}  // namespace fkda
