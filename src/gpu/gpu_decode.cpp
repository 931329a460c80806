// SPDX-License-Identifier: MIT
// Launch code of the decode kernels: one launch, either the streamed kernel
// (kernels/decode_streamed.cuh) in a persistent grid, or the plain one
// (kernels/decode_recurrence.cuh), a block per (sequence, V slice) and head;
// with the layer step, the plain kernel's blocks of a head as one cluster.
// Allocates nothing and never synchronises, so a call can be captured in a
// CUDA graph.
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

// The layer form of the streamed kernels bulk-copies the conv states of a
// head's channels: each projection's channels contiguous (stride_c = Wc,
// stride_w = 1) and every row 16-byte aligned.
bool conv_states_copyable(const FkdaLayerStep& layer) {
  if (layer.conv_state_width == 0) return true;  // none
  const int64_t element_bytes = layer.conv_state_is_f32 ? 4 : 2;
  for (const FkdaConv& conv : layer.conv) {
    if (conv.state_stride_c != layer.conv_state_width) return false;
    if (layer.conv_state_width > 1 && conv.state_stride_w != 1) return false;
    if (reinterpret_cast<uintptr_t>(conv.state) % 16 != 0 || (conv.state_stride_row * element_bytes) % 16 != 0) {
      return false;
    }
  }
  return true;
}

// The streamed kernels' launch (stages 0: the call is not theirs). They
// serve [N] indices on a V x K pool, with conv states they can copy, on
// devices that run their code, with the head's dt_bias 16-byte aligned for
// its bulk copy. A persistent grid (the plain form: two blocks a
// multiprocessor, each items of 64 rows; the layer form: one, each items of
// a whole head) pays off only when each block has several items to
// pipeline: below that, the plain kernel's blocks finish sooner.
constexpr int64_t kStreamMinItemsPerBlock = 2;
struct StreamShape {
  int stages = 0;
  int32_t warps = 0;  // consumers
  int64_t blocks = 0;
  unsigned threads = 0;
  int32_t smem_bytes = 0;
};
StreamShape stream_shape(const DeviceFacts& facts, const FkdaDecodeParams& params, bool layer, int64_t num_seqs,
                         int64_t num_heads) {
  if (!facts.runs_sm90_code || params.indices_are_table || params.call.state_is_kv) return {};
  if (layer && !conv_states_copyable(params.layer)) return {};
  if (reinterpret_cast<uintptr_t>(params.call.dt_bias) % 16 != 0) return {};
  const int32_t warps = layer ? FKDA_DECODE_STREAM_LAYER_WARPS : FKDA_DECODE_MAX_WARPS;
  const int32_t rows = warps * FKDA_DECODE_ROWS_PER_WARP;
  const int64_t blocks_per_multiprocessor = layer ? 1 : 2;
  const int64_t items = num_seqs * num_heads * (FKDA_HEAD_DIM / rows);
  const int64_t most_blocks = blocks_per_multiprocessor * facts.sm_count;
  if (items < kStreamMinItemsPerBlock * most_blocks) return {};
  // The driver reserves 1 KB of a multiprocessor's shared memory a block.
  const int64_t block_bytes = std::min<int64_t>(
      facts.max_dynamic_smem, facts.smem_per_multiprocessor / blocks_per_multiprocessor - 1024);
  const int32_t stage_bytes = fkda_decode_stream_stage_bytes(
      rows, params.call.state_is_bf16,
      fkda_decode_stream_conv_bytes(layer ? params.layer.conv_state_width : 0, params.layer.conv_state_is_f32));
  const int64_t stages = (block_bytes - fkda_decode_stream_stages_offset(warps)) / stage_bytes;
  if (stages < 2) return {};
  StreamShape shape;
  shape.stages = int(std::min<int64_t>(stages, FKDA_DECODE_STREAM_MAX_STAGES));
  shape.blocks = std::min<int64_t>(items, most_blocks);
  shape.warps = warps;
  shape.threads = unsigned(FKDA_DECODE_STREAM_THREADS(warps));
  shape.smem_bytes = fkda_decode_stream_smem_bytes(warps, shape.stages, stage_bytes);
  return shape;
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
  // The layer step needs all of a head's rows in one place (decode_params.h):
  // the streamed kernel's items are whole heads; where the kernel was compiled for sm_90 or later, two of the plain
  // kernel's blocks of a head form a cluster, else one block takes all 128 rows.
  const bool layer = problem.layer.has_conv() || problem.layer.has_out_gate();
  if (layer) params.layer = kernel_layer(problem.layer);
  const StreamShape streamed = stream_shape(context.facts, params, layer, problem.num_seqs, problem.num_heads);
  if (streamed.stages > 0) {
    params.stages = streamed.stages;
    params.warps = streamed.warps;
    const ResolvedKernel kernel = resolve(context, context.kernels.decode_streamed[layer][params.call.state_is_bf16]);
    launch(context, kernel, unsigned(streamed.blocks), 1, 1, streamed.threads, unsigned(streamed.smem_bytes), stream,
           &params);
    return;
  }
  const int index = decode_kernel_index(params.call.state_is_bf16 != 0, params.call.state_is_kv != 0);
  const ResolvedKernel kernel =
      resolve(context, layer ? context.kernels.decode_layer[index] : context.kernels.decode[index]);
  // The layer kernels' clusters are always 2 blocks of 4 warps: each block
  // pushes every convolved q and k value to all blocks of its head, and on
  // the H200 one sequence of 32 heads ran fastest in 2 blocks of 4 warps or
  // 4 of 2 (W2: 0.0083 ms both, 0.0087-0.0088 in 8 of 1), 4 sequences in 2
  // of 4 (0.0095-0.0097 against 0.0101).
  // A cluster of one block could not take the kernels' st.async pushes.
  // The kernels take this shape as a constant (kDecodeLayerWarps).
  static_assert(FKDA_DECODE_LAYER_HEAD_BLOCKS > 1, "the layer kernels' clusters have at least two blocks");
  const bool clusters = layer && context.facts.runs_sm90_code;
  params.warps = !layer ? choose_warps(problem.num_seqs * problem.num_heads, context.facts.sm_count)
                        : (clusters ? FKDA_DECODE_MAX_WARPS : FKDA_DECODE_LAYER_WARPS);

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
