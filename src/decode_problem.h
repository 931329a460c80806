/* SPDX-License-Identifier: MIT */
// The validated description of one decode call (fkda_decode), as the
// backends see it. validate_decode.cpp builds it from fkda_decode_args; backends
// trust its shapes and strides completely, and the GPU backend treats the
// device-side indices and offsets as untrusted (null when out of range).
#pragma once

#include <cstdint>

#include "prefill_problem.h"

namespace fkda {

// The most tokens one sequence may bring to a decode call (speculative
// verify: the accepted token plus the drafts).
constexpr int64_t kMaxDecodeTokens = 16;

struct DecodeProblem {
  int64_t batch = 0;      // B: N batched, 1 packed
  int64_t seq_len = 0;    // T: tokens per batch row (the packed total with cu_seqlens)
  int64_t num_seqs = 0;   // N
  int32_t num_heads = 0;  // H
  int32_t head_dim_k = 128;
  int32_t head_dim_v = 128;

  ActView q, k, v, g, beta;  // bf16 (g, beta: or f32, see gate)
  ActView out;               // bf16, written
  const float* A_log = nullptr;    // [H], optional (GateForm)
  const float* dt_bias = nullptr;  // [H, K], optional
  GateForm gate;

  PoolView pool;              // [slots, H, V, K] (or KV), the plan's state dtype
  int32_t state_dtype = 0;
  int32_t state_layout = 0;   // fkda_state_layout
  // [N] (cols == 1): start from and write back to one slot per sequence;
  // [N, W] (table): start from column num_accepted_tokens[n] - 1, write the
  // state after token t into column t.
  IndexView state_indices;
  bool indices_are_table = false;
  IndexView num_accepted_tokens;  // [N], with a table only; absent means 1
  int32_t null_slot_rule = 0;     // fkda_null_slot_rule

  SeqOffsets cu_seqlens;  // absent: sequence n is batch row n, seq_len tokens

  float scale = 0.f;
  float lower_bound = -5.f;
  bool debug_checks = false;
};

}  // namespace fkda
