// SPDX-License-Identifier: MIT
// Launch code of the decode kernels: one launch, either the streamed kernel
// (kernels/decode_streamed.cuh) in a persistent grid, or the plain one
// (kernels/decode_recurrence.cuh), a block per (sequence, V slice) and head;
// with the layer step, a head's blocks as one cluster. Allocates nothing and
// never synchronises, so a call can be captured in a CUDA graph.
#include <algorithm>
#include <cstdint>
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

// The streamed kernels' stages a block (0: the call is not theirs). They
// serve [N] indices on a V x K pool without the layer step, on devices that
// run their code, with the head's dt_bias 16-byte aligned for its bulk copy.
// A persistent grid of two blocks a multiprocessor pays off only when each
// block has several items to pipeline: below that, the plain kernel's blocks
// finish sooner.
constexpr int64_t kStreamBlocksPerMultiprocessor = 2;
constexpr int64_t kStreamMinItemsPerBlock = 2;
int stream_stages(const DeviceFacts& facts, const FkdaDecodeParams& params, bool layer, int64_t items) {
  if (!facts.runs_sm90_code || layer || params.indices_are_table || params.call.state_is_kv) return 0;
  if (reinterpret_cast<uintptr_t>(params.call.dt_bias) % 16 != 0) return 0;
  if (items < kStreamMinItemsPerBlock * kStreamBlocksPerMultiprocessor * facts.sm_count) return 0;
  // The driver reserves 1 KB of a multiprocessor's shared memory a block.
  const int64_t block_bytes = std::min<int64_t>(
      facts.max_dynamic_smem, facts.smem_per_multiprocessor / kStreamBlocksPerMultiprocessor - 1024);
  const int64_t room = block_bytes - fkda_decode_stream_stages_offset();
  const int64_t stages = room / fkda_decode_stream_stage_bytes(params.call.state_is_bf16);
  if (stages < 2) return 0;
  return int(std::min<int64_t>(stages, FKDA_DECODE_STREAM_MAX_STAGES));
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
  const int64_t stream_items = problem.num_seqs * problem.num_heads * (FKDA_HEAD_DIM / FKDA_DECODE_STREAM_ROWS);
  params.stages = stream_stages(context.facts, params, layer, stream_items);
  if (params.stages > 0) {
    params.warps = FKDA_DECODE_MAX_WARPS;
    const ResolvedKernel streamed = resolve(context, context.kernels.decode_streamed[params.call.state_is_bf16]);
    const int64_t blocks =
        std::min<int64_t>(stream_items, kStreamBlocksPerMultiprocessor * context.facts.sm_count);
    launch(context, streamed, unsigned(blocks), 1, 1, 32 * (FKDA_DECODE_MAX_WARPS + 1),
           unsigned(fkda_decode_stream_smem_bytes(params.stages, params.call.state_is_bf16)),
           stream, &params);
    return;
  }
  const int index = decode_kernel_index(params.call.state_is_bf16 != 0, params.call.state_is_kv != 0);
  const ResolvedKernel kernel =
      resolve(context, layer ? context.kernels.decode_layer[index] : context.kernels.decode[index]);
  const bool clusters = layer && context.facts.runs_sm90_code;
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
