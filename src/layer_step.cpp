// SPDX-License-Identifier: MIT
#include "layer_step.h"

#include <cstdint>
#include <limits>

#include "checked_arith.h"
#include "layer_params.h"

namespace fkda {
namespace {

size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

int32_t staged_projections(fkda_backend backend) { return backend == FKDA_BACKEND_GPU ? 1 : 3; }

bool stages_conv_weight_table(fkda_backend backend) { return backend == FKDA_BACKEND_GPU; }

namespace {

// One staged projection's bytes; SIZE_MAX when it cannot be counted.
size_t staged_projection_bytes(int64_t total_tokens, int32_t num_heads, int32_t head_dim) {
  int64_t elements = 0;
  if (mul_overflows(total_tokens, int64_t(num_heads) * head_dim, &elements) ||
      elements > std::numeric_limits<int64_t>::max() / 8) {
    return std::numeric_limits<size_t>::max();
  }
  return round_up_256(size_t(elements) * 2);
}

}  // namespace

size_t conv_weight_table_bytes(int32_t num_heads, int32_t head_dim) {
  return round_up_256(size_t(FKDA_CONV_TABLE_FLOATS_PER_CHANNEL) * sizeof(float) * size_t(num_heads) *
                      size_t(head_dim));
}

size_t conv_staging_bytes(int64_t total_tokens, int32_t num_heads, int32_t head_dim, fkda_backend backend) {
  if (total_tokens == 0) return 0;  // nothing to convolve: no table either
  const size_t one = staged_projection_bytes(total_tokens, num_heads, head_dim);
  if (one == std::numeric_limits<size_t>::max()) return one;
  const size_t table = stages_conv_weight_table(backend) ? conv_weight_table_bytes(num_heads, head_dim) : 0;
  return size_t(staged_projections(backend)) * one + table;
}

ActView ConvStaging::view_of(void* data) const {
  ActView view;
  view.data = data;
  view.stride_h = head_dim;
  view.stride_t = int64_t(num_heads) * head_dim;
  view.stride_b = seq_len * view.stride_t;
  return view;
}

ConvStaging conv_staging(const PrefillProblem& problem, void* workspace, size_t workspace_bytes) {
  ConvStaging s;
  s.seq_len = problem.seq_len;
  s.num_heads = problem.num_heads;
  s.head_dim = problem.head_dim_k;
  unsigned char* base = static_cast<unsigned char*>(workspace);
  const size_t total = problem.conv_staging_bytes;
  s.rest = total > 0 ? base + total : base;
  s.rest_bytes = workspace_bytes > total ? workspace_bytes - total : 0;
  const int32_t staged = problem.conv_staged_projections;
  if (staged == 0) return s;
  void** tensors[3] = {&s.q, &s.k, &s.v};
  const size_t one = staged_projection_bytes(problem.batch * problem.seq_len, problem.num_heads, problem.head_dim_k);
  for (int32_t i = 0; i < staged; ++i) *tensors[3 - staged + i] = base + size_t(i) * one;
  if (problem.conv_weight_table && total > 0) s.conv_weights = reinterpret_cast<float*>(base + size_t(staged) * one);
  return s;
}

}  // namespace fkda
