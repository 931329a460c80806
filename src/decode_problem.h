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

struct DecodeProblem : RecurrenceCall {
  PoolView pool;  // [slots, H, V, K] (or KV), in state_dtype
  // [N] (cols == 1): start from and write back to one slot per sequence;
  // [N, W] (table): start from column num_accepted_tokens[n] - 1, write the
  // state after token t into column t.
  IndexView state_indices;
  bool indices_are_table = false;
  IndexView num_accepted_tokens;  // [N], with a table only; absent means 1
};

}  // namespace fkda
