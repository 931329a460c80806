// SPDX-License-Identifier: MIT
// The CUDA backend's prefill: windows of chunk slots, the V split, and the
// two launches per window (kernels and launches through kernel_library.h).
// The launch path allocates nothing, never synchronises and never changes
// the current context, so a call can be captured in a CUDA graph.
#include "gpu/gpu_backend.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>

#include "checked_arith.h"
#include "error.h"
#include "gpu/gpu_transitions.h"
#include "gpu/kernel_library.h"
#include "layer_step.h"
#include "prefill_params.h"

namespace fkda::gpu {
namespace {

// The records of one window take at most kWindowBudgetBytes, unless the
// window must be larger to hold kWindowSlotsPerSequence slots for each
// sequence of the call. A quarter of a GB keeps docs/BENCHMARKS.md's P1 (8192
// tokens, 96 heads: 682 MB in one window) within its 340 MB workspace target
// in three windows, and smaller problems keep one window and their two
// launches. The floor per sequence is there because a window's recurrence
// runs only the sequences whose slots the window holds: with many sequences
// the recurrence has more blocks than the GPU runs at once and packs them
// into rounds, and cutting it into windows of few chunks per sequence breaks
// that packing (docs/BENCHMARKS.md's P7 and P8, 6 and 8 sequences of 96 heads, would
// lose 10-30% of their recurrence time), while with windows of 160 slots
// (2560 tokens) per sequence or more only calls whose sequences average more
// than that are cut, into windows that each keep many chunks per block.
constexpr int64_t kWindowBudgetBytes = int64_t(256) << 20;
constexpr int64_t kWindowSlotsPerSequence = 160;

struct Windows {
  int64_t total_slots = 0;
  int64_t slots = 0;  // per window; the last one may have fewer
  int64_t count = 0;
  int64_t buffers = 1;  // windows of records: 2 when consecutive windows overlap
};

// The windows of a call, from its sizes alone (the host never reads the
// offsets): as few windows as the budget allows, then equal slot counts, so
// that each launch pair has the same amount of work. forced_slots > 0 is the
// plan's window_slots.
Windows windows_for(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int64_t forced_slots) {
  Windows w;
  w.total_slots = fkda_num_chunk_slots(total_tokens, num_seqs);
  int64_t slots = forced_slots;
  if (slots == 0) {
    const int64_t most = std::max(saturating_mul(kWindowSlotsPerSequence, std::max<int64_t>(num_seqs, 1)),
                                  kWindowBudgetBytes / (int64_t(num_heads) * FKDA_WS_RECORD_BYTES));
    slots = ceil_div(w.total_slots, ceil_div(w.total_slots, most));
  }
  w.slots = std::min(slots, w.total_slots);
  w.count = ceil_div(w.total_slots, w.slots);
  return w;
}

// Serial windows overlap: window w + 1's preparation runs beside window w's
// recurrence, whose chain of chunks leaves most of each multiprocessor idle
// (launch_dependent), so consecutive windows write alternate halves of the
// records. Windows chosen from the call's sizes are halved, which keeps the
// records' bytes and leaves only the first, shorter, preparation alone on
// the GPU; a plan's window_slots is kept as given.
Windows overlapping(Windows w, int64_t forced_slots) {
  if (w.count < 2) return w;
  if (forced_slots == 0) {
    w.slots = ceil_div(w.total_slots, 2 * w.count);
    w.count = ceil_div(w.total_slots, w.slots);
  }
  w.buffers = 2;
  return w;
}

// Chunk-parallel prefill (docs/ARCHITECTURE.md, "Chunk-parallel prefill"):
// a transition pass (E and M of each segment: 2 * vsplit blocks per segment
// and head), the scan, and a segment pass (vsplit blocks). The passes do the
// serial recurrence's work three times over, spread over many more blocks,
// so they pay where the serial grid leaves the GPU idle: on an H200 the
// segments win from a few (sequence, head) pairs up to about 16 (bench/RESULTS.md,
// the L cases and their segment sweep) and lose from 24 on. The choice
// comes from the call's sizes alone (the host never reads the offsets) and
// not from the device, so that the workspace size does not depend on it.
constexpr int kSegmentVsplit = 2;
constexpr int64_t kMaxAutomaticPairs = 16;
// Segments of 128 chunks measured fastest on long sequences (shorter ones
// add scan steps, longer ones leave the passes fewer blocks); sequences of
// fewer than 1024 chunks get about 8 segments, of at least 16 chunks each,
// below which each segment's start and state store cost more than it saves.
constexpr int64_t kLongSegmentChunks = 128;
constexpr int64_t kSegmentsPerShortSequence = 8;
constexpr int64_t kMinAutomaticSegmentChunks = 16;
constexpr int64_t kMinSegmentsPerSequence = 4;
// And below 256 chunks (4096 tokens) per sequence the serial chain is short
// enough that the passes' fixed costs outweigh it: on an H200, T = 2048 with
// 12 heads takes 0.105 ms in segments and 0.090 ms serially.
constexpr int64_t kMinAutomaticChunksPerSequence = 256;

struct Segments {
  int64_t chunks = 0;    // per segment; 0: the serial path
  int64_t per_seq = 0;   // grid x = N * per_seq
  int64_t capacity = 0;  // records per head in each of seg_m and seg_e
};

Segments segments_for(int64_t window_slots, int64_t total_slots, int64_t num_seqs, int32_t num_heads,
                      const Tuning& tuning) {
  Segments seg;
  const int mode = tuning.chunk_parallel;
  if (mode == FKDA_CHUNK_PARALLEL_OFF || num_seqs <= 0) return seg;
  const int64_t chunks_per_seq = ceil_div(total_slots, num_seqs);
  int64_t chunks = tuning.segment_chunks;
  if (chunks == 0) {
    chunks = std::min(kLongSegmentChunks,
                      std::max(kMinAutomaticSegmentChunks, ceil_div(chunks_per_seq, kSegmentsPerShortSequence)));
  }
  // A segment longer than the call changes nothing, and a plan's value
  // (any positive count) must not overflow the sizes below.
  chunks = std::min(chunks, std::max<int64_t>(total_slots, 1));
  if (mode == FKDA_CHUNK_PARALLEL_AUTO &&
      (saturating_mul(num_seqs, int64_t(num_heads)) > kMaxAutomaticPairs || chunks_per_seq < kMinAutomaticChunksPerSequence ||
       chunks_per_seq < kMinSegmentsPerSequence * chunks)) {
    return seg;
  }
  seg.chunks = chunks;
  seg.per_seq = ceil_div(window_slots, chunks) + 1;
  seg.capacity = fkda_segment_capacity(window_slots, chunks, num_seqs);
  return seg;
}

// Enough blocks to fill the GPU: the largest power of two <= 8 with
// N * H * vsplit <= 2 * SMs, at least 1, and within the shared memory limit.
// forced > 0 is the plan's vsplit.
int choose_vsplit(int64_t seqs_times_heads, const DeviceFacts& facts, int forced) {
  int vsplit = forced;
  if (vsplit == 0) {
    vsplit = kMaxVsplit;
    while (vsplit > 1 && seqs_times_heads * vsplit > 2 * int64_t(facts.sm_count)) vsplit /= 2;
  }
  while (vsplit < kMaxVsplit && fkda_recurrence_smem_bytes(vsplit) > facts.max_dynamic_smem) vsplit *= 2;
  return vsplit;
}

// The preparation kernel of the gate form: one per form, and per g dtype
// under LOG_DECAY; conv: the one convolving q and k (the layer step).
const NamedKernel& prepare_kernel(const Kernels& kernels, const GateForm& gate, bool conv) {
  const int form = conv ? 1 : 0;
  switch (gate.gate_mode) {
    case FKDA_GATE_SOFTPLUS:
      return kernels.prepare_softplus[form];
    case FKDA_GATE_LOG_DECAY:
      return kernels.prepare_log_decay[gate.g_is_f32 ? 1 : 0][form];
    default:
      return kernels.prepare[form];
  }
}

// Floats of one f32 V x K matrix per head: a carry, or a segment record.
int64_t carry_step(int32_t num_heads) { return int64_t(num_heads) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM); }

// The workspace of these windows and segments: one window's records, then a
// carry matrix per head for each boundary between windows, then the
// segments' M and E records (prefill_params.h).
size_t launch_workspace(const Windows& w, const Segments& seg, int64_t total_tokens, int32_t num_heads) {
  // Each term below at most half the range, so neither they nor their sum overflow.
  const int64_t limit = std::numeric_limits<int64_t>::max() / 2;
  const int64_t per_slot = int64_t(num_heads) * FKDA_WS_RECORD_BYTES;
  const int64_t per_boundary = int64_t(num_heads) * FKDA_CARRY_BYTES_PER_HEAD;
  if (w.slots > limit / (w.buffers * per_slot) || w.count - 1 > limit / per_boundary ||
      seg.capacity > limit / (2 * per_boundary)) {
    fail(FKDA_ERROR_UNSUPPORTED, "workspace for " + std::to_string(total_tokens) + " tokens and " +
                                     std::to_string(num_heads) + " heads exceeds the address space");
  }
  return size_t(w.buffers * w.slots * per_slot + (w.count - 1) * per_boundary + 2 * seg.capacity * per_boundary);
}

// A call's windows and segments, computed once from its sizes and the
// plan's tuning and held against the caller's workspace: what runs is what
// is checked. size_call names the query that sizes this workspace.
struct Launch {
  Windows windows;
  Segments seg;
};

Launch launch_for(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, const Tuning& tuning) {
  Launch l;
  l.windows = windows_for(total_tokens, num_seqs, num_heads, tuning.window_slots);
  l.seg = segments_for(l.windows.slots, l.windows.total_slots, num_seqs, num_heads, tuning);
  if (l.seg.chunks == 0) l.windows = overlapping(l.windows, tuning.window_slots);
  return l;
}

Launch checked_launch(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, const Tuning& tuning,
                      size_t workspace_bytes, const char* size_call) {
  const Launch l = launch_for(total_tokens, num_seqs, num_heads, tuning);
  const size_t needed = launch_workspace(l.windows, l.seg, total_tokens, num_heads);
  if (workspace_bytes < needed) {
    fail(FKDA_ERROR_WORKSPACE_TOO_SMALL,
         "workspace_bytes: " + std::to_string(workspace_bytes) + " bytes given, the launch of " +
             std::to_string(l.windows.count) + " window(s) of " + std::to_string(l.windows.slots) +
             " chunk slots needs " + std::to_string(needed) + " (" + size_call + ")");
  }
  return l;
}

// Grids of one launch: heads along y, and along x the window's slots, the
// sequences and, with segments, their segment slots.
void check_grid_limits(const Launch& l, int64_t num_seqs, int32_t num_heads, int64_t total_tokens) {
  const int64_t max_grid_x = std::numeric_limits<int32_t>::max();
  if (num_heads > 65535 || l.windows.slots > max_grid_x || num_seqs > max_grid_x ||
      l.seg.per_seq > max_grid_x / std::max<int64_t>(num_seqs, 1)) {
    fail(FKDA_ERROR_UNSUPPORTED, "problem too large for one launch: " + std::to_string(num_seqs) +
                                     " sequences, " + std::to_string(total_tokens) + " tokens, " +
                                     std::to_string(num_heads) + " heads");
  }
}

// Bytes of one window's records.
int64_t window_records_bytes(const Launch& l, int32_t num_heads) {
  return l.windows.slots * int64_t(num_heads) * FKDA_WS_RECORD_BYTES;
}

// The workspace as launch_workspace lays it out: the windows' records (the
// first window's at params.workspace, the second's after them), the
// carries that follow them (a multiple of 16 bytes) and, with segments, the
// segments' M and E records after the carries, set in params. Returns the
// first carry; carry w is carry_step floats further.
float* place_workspace(const Launch& l, int32_t num_heads, unsigned char* workspace, FkdaPrefillParams& params) {
  params.workspace = workspace;
  params.num_slots = l.windows.total_slots;
  float* carry = reinterpret_cast<float*>(workspace + l.windows.buffers * window_records_bytes(l, num_heads));
  if (l.seg.chunks > 0) {
    const int64_t step = carry_step(num_heads);
    params.vsplit = kSegmentVsplit;
    params.segment_chunks = l.seg.chunks;
    params.segments_per_seq = l.seg.per_seq;
    params.segment_capacity = l.seg.capacity;
    params.seg_m = carry + (l.windows.count - 1) * step;
    params.seg_e = params.seg_m + l.seg.capacity * step;
  }
  return carry;
}

}  // namespace

size_t workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, const Tuning& tuning) {
  if (total_tokens < 0 || num_seqs < 0 || num_heads <= 0) return 0;
  const int64_t limit = std::numeric_limits<int64_t>::max() / 2;
  if (num_seqs >= limit) return launch_workspace(Windows{limit, limit, limit}, Segments{}, total_tokens, num_heads);
  const Launch l = launch_for(total_tokens, num_seqs, num_heads, tuning);
  return launch_workspace(l.windows, l.seg, total_tokens, num_heads);
}

// sm_80 machine code runs on every 8.x device, sm_90a on 9.0, and the
// compute_90 PTX is compiled by the driver for anything newer. A build whose
// fatbin is compute_80 PTX alone (FKDA_FATBIN_ARCHS=compute_80) runs on all of them too.
bool has_kernels_for(int cc_major, int /*cc_minor*/) { return cc_major >= 8; }

std::string unsupported_arch_message(int cc_major, int cc_minor) {
  return "compute capability " + std::to_string(cc_major) + "." + std::to_string(cc_minor) +
         ": this build has kernels for the sm_80 family and sm_90 (and later, through PTX)";
}

namespace {

// The windows of the recurrence, on the problem's q, k and v as they are
// (with the layer step's convolution: q and k raw, which the preparation
// kernel convolves, and v staged), in the launch checked against the
// caller's workspace. Everything else is checked, sized and resolved on
// construction too, so that a call that fails enqueues nothing; enqueue
// launches the windows.
struct RecurrenceLaunch {
  Launch l;
  FkdaPrefillParams params;
  ResolvedKernel prepare, recurrence, segment_transitions, segment_scan, segment_recurrence;
  unsigned char* records = nullptr;
  float* carry = nullptr;
  int64_t total_tokens = 0, num_seqs = 0;
  unsigned heads = 0;

  RecurrenceLaunch(const LaunchContext& context, const PrefillProblem& problem, const Launch& checked,
                   void* workspace, const float* conv_weights)
      : l(checked),
        total_tokens(problem.batch * problem.seq_len),
        num_seqs(problem.num_seqs),
        heads(unsigned(problem.num_heads)) {
    // Devices whose shared memory cannot hold the scan, and calls whose
    // segment grid would not fit, run the serial path (it needs no more
    // workspace than the segments would have).
    const int64_t max_grid_x = std::numeric_limits<int32_t>::max();
    if (!context.facts.segment_scan_fits || l.seg.per_seq > max_grid_x / std::max<int64_t>(problem.num_seqs, 1)) {
      l.seg = Segments{};
    }
    check_grid_limits(l, problem.num_seqs, problem.num_heads, total_tokens);

    std::memset(&params, 0, sizeof(params));
    params.call = kernel_call(problem);
    params.initial_state = problem.initial_state;
    params.final_state = problem.final_state;
    params.vsplit = choose_vsplit(problem.num_seqs * problem.num_heads, context.facts, problem.tuning.vsplit);
    params.state_pool = problem.pool.data;
    params.pool_slots = problem.pool.slots;
    params.pool_slot_stride = problem.pool.slot_stride;
    params.state_indices = index_table(problem.state_indices);
    params.has_initial_state = index_table(problem.has_initial_state);
    params.checkpoint_offsets = index_table(problem.checkpoint_offsets);
    params.checkpoints = problem.checkpoints;
    params.checkpoint_stride_n = problem.checkpoint_stride_n;
    params.checkpoint_stride_c = problem.checkpoint_stride_c;
    params.checkpoint_slots = index_table(problem.checkpoint_slots);
    params.checkpoint_is_bf16 = problem.checkpoint_dtype == FKDA_DTYPE_BF16;
    params.layer = kernel_layer(problem.layer);
    params.layer.conv_table = conv_weights;

    const bool serving = params.state_indices.data != nullptr || params.has_initial_state.data != nullptr ||
                         params.checkpoint_offsets.data != nullptr;
    // Resolved before the first launch: a kernel that fails to resolve must
    // not find earlier windows' pools already advanced.
    if (total_tokens > 0) {
      prepare = resolve(context, prepare_kernel(context.kernels, problem.gate, problem.layer.has_conv()));
    }
    recurrence = resolve(
        context,
        (serving ? context.kernels.recurrence_serving : context.kernels.recurrence)[vsplit_index(params.vsplit)]);
    if (l.seg.chunks > 0) {
      segment_transitions = resolve(context, context.kernels.segment_transitions[kSegmentVsplit - 1]);
      segment_scan = resolve(context, context.kernels.segment_scan);
      segment_recurrence = resolve(context, context.kernels.segment_recurrence[kSegmentVsplit - 1]);
    }
    // After the serial recurrence's kernel is chosen: with segments the V split is theirs.
    carry = place_workspace(l, problem.num_heads, static_cast<unsigned char*>(workspace), params);
    records = params.workspace;
  }

  LaunchShape enqueue(const LaunchContext& context, CUstream stream) {
    const Windows& windows = l.windows;
    const Segments& seg = l.seg;
    const int64_t step = carry_step(int32_t(heads));
    const unsigned segment_threads = unsigned(32 * fkda_recurrence_warps(kSegmentVsplit));
    const unsigned segment_smem = unsigned(fkda_recurrence_smem_bytes(kSegmentVsplit));
    const unsigned segment_grid_x = unsigned(num_seqs * seg.per_seq);
    // With one window of records, each window's preparation overwrites the
    // records the previous window's recurrence read, and the stream orders
    // them. With two, window w + 1's preparation writes the other half
    // beside window w's recurrence, and window w + 2's waits in stream order
    // for window w + 1's recurrence, which started after window w's ended.
    const bool overlap = windows.buffers == 2 && total_tokens > 0;
    for (int64_t w = 0; w < windows.count; ++w) {
      params.workspace = records + (w % windows.buffers) * window_records_bytes(l, int32_t(heads));
      params.window_first = w * windows.slots;
      params.window_end = std::min(params.window_first + windows.slots, windows.total_slots);
      params.carry_in = w > 0 ? carry + (w - 1) * step : nullptr;
      params.carry_out = w + 1 < windows.count ? carry + w * step : nullptr;
      params.overlap_next = overlap && w + 1 < windows.count ? 1 : 0;
      if (total_tokens > 0) {
        const unsigned slots = unsigned(params.window_end - params.window_first);
        if (overlap && w > 0) {
          launch_dependent(context, prepare, slots, heads, FKDA_PREPARE_THREADS, 0, stream, &params);
        } else {
          launch(context, prepare, slots, heads, 1, FKDA_PREPARE_THREADS, 0, stream, &params);
        }
      }
      if (seg.chunks > 0) {
        launch(context, segment_transitions, segment_grid_x, heads,
               unsigned(2 * kSegmentVsplit), segment_threads, segment_smem, stream, &params);
        launch(context, segment_scan, unsigned(num_seqs), heads,
               unsigned(FKDA_HEAD_DIM / FKDA_SCAN_ROWS), FKDA_SCAN_THREADS, FKDA_SCAN_SMEM_BYTES, stream, &params);
        launch(context, segment_recurrence, segment_grid_x, heads,
               unsigned(kSegmentVsplit), segment_threads, segment_smem, stream, &params);
        continue;
      }
      // Launched even without tokens: zero-length sequences still copy their
      // initial state (or zeros) to the final state.
      launch(context, recurrence, unsigned(num_seqs), heads, unsigned(params.vsplit),
             unsigned(32 * fkda_recurrence_warps(params.vsplit)),
             unsigned(fkda_recurrence_smem_bytes(params.vsplit)), stream, &params);
    }
    return LaunchShape{params.vsplit, windows.count, windows.slots, seg.chunks > 0 ? 1 : 0, seg.chunks};
  }
};

// fkda_fwd's layer step around the recurrence: before it the weight table
// and the convolution of v into the staging area (both write the workspace
// only), after it the conv states and the output gate. Checked, sized and
// resolved on construction, like the recurrence.
struct LayerLaunch {
  FkdaLayerParams params;
  ResolvedKernel pack_weights, convolve, store, gate;
  bool has_conv = false, has_state = false, has_gate = false;
  int64_t conv_tiles = 0, conv_groups = 0, gate_blocks = 0, table_groups = 0;

  LayerLaunch(const LaunchContext& context, const PrefillProblem& problem, const ConvStaging& staging) {
    const int64_t tokens = problem.batch * problem.seq_len;
    const bool any_tokens = tokens > 0 && problem.num_seqs > 0;
    has_conv = problem.layer.has_conv() && any_tokens;
    has_state = has_conv && problem.layer.has_conv_state();
    has_gate = problem.layer.has_out_gate() && any_tokens;
    conv_tiles = ceil_div(tokens, FKDA_CONV_TILE_TOKENS);
    conv_groups = ceil_div(int64_t(problem.num_heads) * FKDA_HEAD_DIM, FKDA_CONV_CHANNELS_PER_BLOCK);
    table_groups = ceil_div(int64_t(problem.num_heads) * FKDA_HEAD_DIM, FKDA_CONV_THREADS);
    gate_blocks = ceil_div(tokens * problem.num_heads, FKDA_GATE_ROWS_PER_BLOCK);
    const int64_t max_grid_x = std::numeric_limits<int32_t>::max();
    if ((has_conv && conv_tiles > max_grid_x) || (has_gate && gate_blocks > max_grid_x) ||
        (has_state && (problem.num_seqs > max_grid_x || problem.num_heads > 65535))) {
      fail(FKDA_ERROR_UNSUPPORTED, "layer step too large for one launch: " + std::to_string(tokens) +
                                       " tokens of " + std::to_string(problem.num_heads) + " heads");
    }

    std::memset(&params, 0, sizeof(params));
    params.call = kernel_call(problem);
    params.layer = kernel_layer(problem.layer);
    params.staged_v = staging.v;
    params.conv_table = staging.conv_weights;
    params.batch = problem.batch;
    params.state_indices = index_table(problem.state_indices);
    params.pool_slots = problem.pool.slots;
    params.has_initial_state = index_table(problem.has_initial_state);
    params.reads_state = problem.initial_state != nullptr || problem.state_indices.present();
    if (problem.checkpoint_slots.present()) {
      params.checkpoint_offsets = index_table(problem.checkpoint_offsets);
      params.checkpoint_slots = index_table(problem.checkpoint_slots);
    }
    if (has_conv) {
      pack_weights = resolve(context, context.kernels.layer_pack_conv_weights);
      convolve = resolve(context, context.kernels.layer_convolve);
    }
    if (has_state) store = resolve(context, context.kernels.layer_conv_store);
    if (has_gate) gate = resolve(context, context.kernels.layer_gate);
  }

  void before(const LaunchContext& context, CUstream stream) {
    if (!has_conv) return;
    launch(context, pack_weights, unsigned(table_groups), FKDA_CONV_TABLE_PROJECTIONS, 1, FKDA_CONV_THREADS, 0, stream,
           &params);
    launch(context, convolve, unsigned(conv_tiles), unsigned(conv_groups), 1, FKDA_CONV_THREADS, 0, stream, &params);
  }

  void after(const LaunchContext& context, CUstream stream) {
    if (has_state) {
      launch(context, store, unsigned(params.call.num_seqs), unsigned(params.call.num_heads), 3, FKDA_HEAD_DIM, 0,
             stream, &params);
    }
    if (has_gate) {
      launch(context, gate, unsigned(gate_blocks), 1, 1, 32 * FKDA_GATE_WARPS, 0, stream, &params);
    }
  }
};

}  // namespace

LaunchShape fwd(const PrefillProblem& problem, void* workspace, size_t workspace_bytes, CUstream stream) {
  // Plans with layer_step keep the staging area at the front of the
  // workspace whether or not the call convolves.
  const ConvStaging staging = conv_staging(problem, workspace, workspace_bytes);
  // The launch against the caller's workspace first, before the device.
  const Launch checked = checked_launch(problem.batch * problem.seq_len, problem.num_seqs, problem.num_heads,
                                        problem.tuning, staging.rest_bytes, "fkda_plan_workspace_size");
  const LaunchContext context = launch_context();
  PrefillProblem staged = problem;
  if (problem.layer.has_conv()) staged.v = staging.view_of(staging.v);
  RecurrenceLaunch recurrence(context, staged, checked, staging.rest, staging.conv_weights);
  LayerLaunch layer(context, problem, staging);
  layer.before(context, stream);
  const LaunchShape shape = recurrence.enqueue(context, stream);
  layer.after(context, stream);
  return shape;
}

// ------------------------------------------------------- transitions ---

namespace {

// fkda_transitions always cuts its sequences into segments: forced on,
// with the plan's segment length if it has one.
Tuning transitions_tuning(Tuning tuning) {
  tuning.chunk_parallel = FKDA_CHUNK_PARALLEL_ON;
  return tuning;
}

}  // namespace

size_t transitions_workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, const Tuning& tuning) {
  return workspace_size(total_tokens, num_seqs, num_heads, transitions_tuning(tuning));
}

void transitions(const TransitionProblem& problem, const Tuning& plan_tuning, void* workspace,
                 size_t workspace_bytes, CUstream stream) {
  const int64_t total_tokens = problem.batch * problem.seq_len;
  const Launch l = checked_launch(total_tokens, problem.num_seqs, problem.num_heads, transitions_tuning(plan_tuning),
                                  workspace_bytes, "fkda_plan_transitions_workspace_size");
  check_grid_limits(l, problem.num_seqs, problem.num_heads, total_tokens);
  const LaunchContext context = launch_context();
  if (!context.facts.segment_scan_fits) {
    fail(FKDA_ERROR_UNSUPPORTED_ARCH, "fkda_transitions needs " + std::to_string(FKDA_SCAN_SMEM_BYTES) +
                                          " bytes of shared memory per block; the device allows " +
                                          std::to_string(context.facts.max_dynamic_smem));
  }

  // The call as a prefill without q, out or states: q's view is k's (the
  // preparation forms Qd, which the transition pass never reads).
  PrefillProblem prefill = as_prefill(problem);
  prefill.q = problem.k;

  FkdaPrefillParams params;
  std::memset(&params, 0, sizeof(params));
  params.call = kernel_call(prefill);
  params.transitions_only = 1;
  params.trans_m = problem.transition_m;
  params.trans_e = problem.transition_e;
  place_workspace(l, problem.num_heads, static_cast<unsigned char*>(workspace), params);
  const Windows& windows = l.windows;
  const Segments& seg = l.seg;

  const ResolvedKernel prepare =
      total_tokens > 0 ? resolve(context, prepare_kernel(context.kernels, problem.gate, false)) : ResolvedKernel{};
  const ResolvedKernel segment_transitions = resolve(context, context.kernels.segment_transitions[kSegmentVsplit - 1]);
  const ResolvedKernel segment_scan = resolve(context, context.kernels.segment_scan);
  const unsigned heads = unsigned(problem.num_heads);
  for (int64_t w = 0; w < windows.count; ++w) {
    params.window_first = w * windows.slots;
    params.window_end = std::min(params.window_first + windows.slots, windows.total_slots);
    if (total_tokens > 0) {
      launch(context, prepare, unsigned(params.window_end - params.window_first), heads, 1, FKDA_PREPARE_THREADS,
             0, stream, &params);
      launch(context, segment_transitions, unsigned(problem.num_seqs * seg.per_seq), heads,
             unsigned(2 * kSegmentVsplit), unsigned(32 * fkda_recurrence_warps(kSegmentVsplit)),
             unsigned(fkda_recurrence_smem_bytes(kSegmentVsplit)), stream, &params);
    }
    // Also without tokens: zero-length sequences get (I, 0).
    launch(context, segment_scan, unsigned(problem.num_seqs), heads, unsigned(2 * FKDA_HEAD_DIM / FKDA_SCAN_ROWS),
           FKDA_SCAN_THREADS, FKDA_SCAN_SMEM_BYTES, stream, &params);
  }
}

}  // namespace fkda::gpu
