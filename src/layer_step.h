// SPDX-License-Identifier: MIT
// What both backends share of the layer step (flashkda.h, "The layer step
// around the recurrence"): fkda_fwd stages convolved projections, bf16, at
// the front of its workspace and runs the recurrence on them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "prefill_problem.h"

namespace fkda {

// How many projections a backend's fkda_fwd stages, the last ones of q, k,
// v: the CPU backend all three; the GPU backend v alone, its preparation
// kernel convolving q and k as it loads them.
int32_t staged_projections(fkda_backend backend);

// Whether a backend's staging area ends with the conv weight table: the
// GPU's, whose preparation kernel reads q's and k's weights from it.
bool stages_conv_weight_table(fkda_backend backend);

// The staging area: the backend's staged projections, packed
// [total_tokens, H, K] bf16 tensors, then on the GPU the conv weight table
// (conv_weight_table_bytes), each rounded up to 256 bytes; nothing for no
// tokens. SIZE_MAX when it cannot be counted.
size_t conv_staging_bytes(int64_t total_tokens, int32_t num_heads, int32_t head_dim, fkda_backend backend);

// The GPU's table of q's and k's conv weights, f32, in the order the
// preparation kernel reads them (FKDA_CONV_TABLE_*, kernels/layer_params.h).
size_t conv_weight_table_bytes(int32_t num_heads, int32_t head_dim);

// The staged projections of a problem whose workspace starts with the
// staging area (problem.conv_staging_bytes, laid out as counted above), as
// [B, T, H, K] views (the problem's B and T; NULL: not staged), the weight
// table (NULL on the CPU), and the workspace left for the backend after it.
struct ConvStaging {
  void* q = nullptr;
  void* k = nullptr;
  void* v = nullptr;
  float* conv_weights = nullptr;
  ActView view_of(void* data) const;  // [B, T, H, K], packed
  int64_t seq_len = 0;
  int32_t num_heads = 0, head_dim = 0;
  unsigned char* rest = nullptr;
  size_t rest_bytes = 0;
};
ConvStaging conv_staging(const PrefillProblem& problem, void* workspace, size_t workspace_bytes);

}  // namespace fkda
