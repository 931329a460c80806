// SPDX-License-Identifier: MIT
// Launch code of the decode kernel (kernels/decode_recurrence.cuh): one
// launch, one block per (sequence, V slice) and head; with the layer step,
// a head's blocks as one cluster. Allocates nothing and
// never synchronises, so a call can be captured in a CUDA graph.
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "decode_params.h"
#include "error.h"
#include "gpu/gpu_backend.h"
#include "gpu/kernel_library.h"

namespace fkda::gpu {
namespace {

// Warps per block: 4 (64 rows, 2 blocks per head) unless that leaves fewer
// than two blocks per multiprocessor, then 2 or 1 (down to 8 blocks per
// head), so that a single sequence still spreads over the GPU.
int choose_warps(int64_t seqs_times_heads, int sm_count) {
  int warps = FKDA_DECODE_MAX_WARPS;
  while (warps > 1 &&
         seqs_times_heads * (FKDA_HEAD_DIM / (FKDA_DECODE_ROWS_PER_WARP * warps)) < 2 * int64_t(sm_count)) {
    warps /= 2;
  }
  return warps;
}

}  // namespace

void decode(const DecodeProblem& problem, CUstream stream) {
  // Without tokens every sequence has length zero and nothing is touched.
  if (problem.num_seqs == 0 || problem.batch * problem.seq_len == 0) return;
  const LaunchContext context = launch_context();

  FkdaDecodeParams params;
  std::memset(&params, 0, sizeof(params));
  params.call = kernel_call(problem);
  params.pool = problem.pool.data;
  params.pool_slots = problem.pool.slots;
  params.pool_slot_stride = problem.pool.slot_stride;
  params.state_indices = index_table(problem.state_indices);
  params.indices_are_table = problem.indices_are_table;
  if (problem.indices_are_table) params.num_accepted = index_table(problem.num_accepted_tokens);
  // The longest sequence the kernel serves: no sequence holds more tokens
  // than a row, and a table has a column for each token's state.
  int64_t max_tokens = std::min<int64_t>(FKDA_DECODE_MAX_TOKENS, problem.seq_len);
  if (problem.indices_are_table) max_tokens = std::min<int64_t>(max_tokens, problem.state_indices.cols);
  params.max_tokens = int32_t(max_tokens);
  // The layer step needs a head's blocks to work together (decode_params.h):
  // in a cluster where the kernel was compiled for sm_90 or later, else in
  // one block of all 128 rows.
  const bool layer = problem.layer.has_conv() || problem.layer.has_out_gate();
  const int index = decode_kernel_index(params.call.state_is_bf16 != 0, params.call.state_is_kv != 0);
  const ResolvedKernel kernel =
      resolve(context, layer ? context.kernels.decode_layer[index] : context.kernels.decode[index]);
  const bool clusters = layer && context.facts.decode_layer_clusters;
  params.warps = layer && !clusters ? FKDA_DECODE_LAYER_WARPS
                                    : choose_warps(problem.num_seqs * problem.num_heads, context.facts.sm_count);
  if (layer) params.layer = kernel_layer(problem.layer);

  const int64_t vsplit = FKDA_HEAD_DIM / (FKDA_DECODE_ROWS_PER_WARP * params.warps);
  if (problem.num_heads > 65535 || problem.num_seqs > std::numeric_limits<int32_t>::max() / vsplit) {
    fail(FKDA_ERROR_UNSUPPORTED, "decode too large for one launch: " + std::to_string(problem.num_seqs) +
                                     " sequences, " + std::to_string(problem.num_heads) + " heads");
  }
  const unsigned grid_x = unsigned(problem.num_seqs * vsplit), threads = unsigned(32 * params.warps);
  if (!layer) {
    launch(context, kernel, grid_x, unsigned(problem.num_heads), 1, threads,
           unsigned(fkda_decode_smem_bytes(params.max_tokens, params.warps)), stream, &params);
    return;
  }
  // The kernels that run in clusters also stage their state (decode_params.h).
  const unsigned smem = unsigned(fkda_decode_layer_smem_bytes(params.max_tokens, params.warps) +
                                 (clusters ? fkda_decode_staged_state_bytes(params.warps, params.call.state_is_bf16) : 0));
  if (clusters) {
    launch_clusters(context, kernel, unsigned(vsplit), grid_x, unsigned(problem.num_heads), threads, smem, stream,
                    &params);
  } else {
    launch(context, kernel, grid_x, unsigned(problem.num_heads), 1, threads, smem, stream, &params);
  }
}

}  // namespace fkda::gpu
