// SPDX-License-Identifier: MIT
#include "layer_step.h"

#include <cstdint>
#include <limits>

#include "checked_arith.h"

namespace fkda {
namespace {

size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

size_t conv_staging_bytes(int64_t total_tokens, int32_t num_heads, int32_t head_dim) {
  int64_t elements = 0;
  if (mul_overflows(total_tokens, int64_t(num_heads) * head_dim, &elements) ||
      elements > std::numeric_limits<int64_t>::max() / 8) {
    return std::numeric_limits<size_t>::max();
  }
  return 3 * round_up_256(size_t(elements) * 2);
}

ActView ConvStaging::view_of(void* data) const {
  ActView view;
  view.data = data;
  view.stride_h = head_dim;
  view.stride_t = int64_t(num_heads) * head_dim;
  view.stride_b = seq_len * view.stride_t;
  return view;
}

ConvStaging conv_staging(const RecurrenceCall& call, void* workspace, size_t workspace_bytes) {
  ConvStaging s;
  s.seq_len = call.seq_len;
  s.num_heads = call.num_heads;
  s.head_dim = call.head_dim_k;
  const size_t total = conv_staging_bytes(call.batch * call.seq_len, call.num_heads, call.head_dim_k);
  const size_t one = total / 3;
  unsigned char* base = static_cast<unsigned char*>(workspace);
  s.q = base;
  s.k = base + one;
  s.v = base + 2 * one;
  s.rest = total > 0 ? base + total : base;
  s.rest_bytes = workspace_bytes - total;
  return s;
}

}  // namespace fkda
