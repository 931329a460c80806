/* SPDX-License-Identifier: MIT */
// The embedded kernels as the launch code sees them: the fatbin loaded once
// per process, each kernel fetched by name, what the launch code needs to
// know about the current device, and one launch call that turns driver
// failures into fkda::Error. Shared by the prefill (gpu_backend.cpp) and the
// decode (gpu_decode.cpp).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <cstring>

#include "flashkda.h"
#include "gpu/cuda_driver.h"
#include "layer_params.h"
#include "prefill_params.h"
#include "prefill_problem.h"

namespace fkda::gpu {

// One chunk recurrence kernel per V split (1, 2, 4, 8), indexed by log2(vsplit).
constexpr int kVsplitCount = 4;
constexpr int kMaxVsplit = 8;
inline int vsplit_index(int vsplit) { return vsplit == 1 ? 0 : vsplit == 2 ? 1 : vsplit == 4 ? 2 : 3; }

// The chunk-parallel passes exist for V splits 1 and 2.
constexpr int kSegmentVsplitCount = 2;

// One decode kernel per pool dtype and layout, indexed by decode_kernel_index.
constexpr int kDecodeKernelCount = 4;
inline int decode_kernel_index(bool bf16, bool kv) { return (bf16 ? 2 : 0) + (kv ? 1 : 0); }

// A kernel of the library and its extern "C" name (for messages).
struct NamedKernel {
  CUkernel kernel = nullptr;
  const char* name = "";
};

// The preparation kernels, each plain ([0]) and convolving q and k for
// the layer step ([1]).
constexpr int kPrepareForms = 2;

struct Kernels {
  NamedKernel prepare[kPrepareForms];               // bounded gate
  NamedKernel prepare_softplus[kPrepareForms];      // SOFTPLUS gate (g bf16)
  NamedKernel prepare_log_decay[2][kPrepareForms];  // LOG_DECAY gate: g bf16, g f32
  NamedKernel recurrence[kVsplitCount];          // contiguous states or none
  NamedKernel recurrence_serving[kVsplitCount];  // pool slots, has_initial_state, checkpoints
  // Chunk-parallel prefill: the transition and segment passes (V split 1
  // and 2, indexed by vsplit - 1) and the scan between them.
  NamedKernel segment_transitions[kSegmentVsplitCount];
  NamedKernel segment_recurrence[kSegmentVsplitCount];
  NamedKernel segment_scan;
  NamedKernel apply_transitions;  // fkda_apply_transitions
  NamedKernel decode[kDecodeKernelCount];
  NamedKernel decode_layer[kDecodeKernelCount];  // with the layer step
  // The streamed decode (V x K pools; sm_90 and later): [layer step][pool
  // f32 0, bf16 1].
  NamedKernel decode_streamed[2][2];
  // fkda_fwd's layer step (kernels/layer_step.cuh).
  NamedKernel layer_pack_conv_weights;
  NamedKernel layer_convolve;
  NamedKernel layer_conv_store;
  NamedKernel layer_gate;
};

// What the launch code needs to know about a device, read once per device.
struct DeviceFacts {
  int cc_major = 0;
  int cc_minor = 0;
  int sm_count = 0;
  int max_dynamic_smem = 0;  // opt-in limit per block
  bool segment_scan_fits = false;  // the chunk-parallel kernels' shared memory fits
  // The device runs the kernels' code compiled for compute 9.0 or later (a
  // compute_80-only build runs its sm_80 forms on any device): the decode's
  // layer kernels then run as clusters of a head's blocks, and the streamed
  // decode kernels, which need bulk copies, can run.
  bool runs_sm90_code = false;
  int smem_per_multiprocessor = 0;
};

// Everything a launch needs: the driver, the kernels and the current
// context's device. Throws FKDA_ERROR_NO_DEVICE without a current context,
// FKDA_ERROR_UNSUPPORTED_ARCH or FKDA_ERROR_DRIVER.
struct LaunchContext {
  const cuda::Driver& driver;
  const Kernels& kernels;
  const DeviceFacts& facts;
};
LaunchContext launch_context();

// The kernel's function in the current context.
CUfunction function_for_context(const LaunchContext& context, const NamedKernel& kernel);

// A kernel's function in the current context, ready to launch. Resolving
// is the step that fails on a missing or refused image; a call with several
// launches resolves them all before the first.
struct ResolvedKernel {
  CUfunction function = nullptr;
  const char* name = "";
};
ResolvedKernel resolve(const LaunchContext& context, const NamedKernel& kernel);

// Enqueues `kernel` with its single by-value argument; FKDA_ERROR_LAUNCH_FAILED
// when the driver refuses.
void launch(const LaunchContext& context, const ResolvedKernel& kernel, unsigned grid_x, unsigned grid_y,
            unsigned grid_z, unsigned threads, unsigned smem, CUstream stream, void* params);
void launch(const LaunchContext& context, const NamedKernel& kernel, unsigned grid_x, unsigned grid_y,
            unsigned grid_z, unsigned threads, unsigned smem, CUstream stream, void* params);
// The same as a programmatic dependent of the stream's previous kernel: it
// may start once every block of that kernel has allowed it
// (allow_dependent_launch, device_common.cuh), so it must neither read what
// that kernel writes nor write what it reads. Devices before sm_90 launch it
// in stream order.
void launch_dependent(const LaunchContext& context, const ResolvedKernel& kernel, unsigned grid_x, unsigned grid_y,
                      unsigned threads, unsigned smem, CUstream stream, void* params);
// The same in clusters of cluster_x blocks along x (grid_x a multiple of it).
void launch_clusters(const LaunchContext& context, const ResolvedKernel& kernel, unsigned cluster_x, unsigned grid_x,
                     unsigned grid_y, unsigned threads, unsigned smem, CUstream stream, void* params);

// Each kernel's parameters travel in the launch's 4 KB of parameter space.
static_assert(sizeof(FkdaPrefillParams) <= 4096, "FkdaPrefillParams exceeds the kernel parameter space");
static_assert(sizeof(FkdaLayerParams) <= 4096, "FkdaLayerParams exceeds the kernel parameter space");

// The kernels' views of an activation and of the output.
inline FkdaActivation kernel_view(const ActView& view) {
  return FkdaActivation{view.data, view.stride_b, view.stride_t, view.stride_h};
}
inline FkdaOutput output_view(const ActView& view) {
  return FkdaOutput{const_cast<void*>(view.data), view.stride_b, view.stride_t, view.stride_h};
}
// The kernels' view of device-side integers (absent: data NULL).
inline FkdaIndexTable index_table(const IndexView& view) {
  const int32_t bytes = view.dtype == FKDA_DTYPE_I64 ? 8 : view.dtype == FKDA_DTYPE_I32 ? 4 : 1;
  const int64_t cols = view.cols < INT32_MAX ? view.cols : INT32_MAX;
  return FkdaIndexTable{view.data, view.stride_row, view.stride_col, bytes, int32_t(cols)};
}

// The base-2 gate factor of docs/NUMERICS.md step 1, lower_bound * log2(e) in f32.
inline float gate_scale(float lower_bound) { return lower_bound * FKDA_LOG2E; }

// The kernels' shared fields (FkdaRecurrenceCall) from the validated
// problem's (RecurrenceCall).
inline FkdaRecurrenceCall kernel_call(const RecurrenceCall& problem) {
  FkdaRecurrenceCall call;
  std::memset(&call, 0, sizeof(call));
  call.q = kernel_view(problem.q);
  call.k = kernel_view(problem.k);
  call.v = kernel_view(problem.v);
  call.g = kernel_view(problem.g);
  call.beta = kernel_view(problem.beta);
  call.out = output_view(problem.out);
  call.A_log = problem.A_log;
  call.dt_bias = problem.dt_bias;
  static_assert(FKDA_KERNEL_GATE_BOUNDED == FKDA_GATE_BOUNDED && FKDA_KERNEL_GATE_SOFTPLUS == FKDA_GATE_SOFTPLUS &&
                    FKDA_KERNEL_GATE_LOG_DECAY == FKDA_GATE_LOG_DECAY && FKDA_KERNEL_BETA_LOGITS == FKDA_BETA_LOGITS &&
                    FKDA_KERNEL_BETA_PROBABILITIES == FKDA_BETA_PROBABILITIES,
                "kernels/prefill_params.h's gate and beta modes are flashkda.h's");
  call.gate.mode = problem.gate.gate_mode;
  call.gate.beta_mode = problem.gate.beta_mode;
  call.gate.g_is_f32 = problem.gate.g_is_f32;
  call.gate.beta_is_f32 = problem.gate.beta_is_f32;
  call.cu_seqlens = problem.cu_seqlens.data;
  call.cu_seqlens_stride = problem.cu_seqlens.stride;
  call.cu_seqlens_is_i64 = problem.cu_seqlens.dtype == FKDA_DTYPE_I64;
  call.num_heads = problem.num_heads;
  call.seq_len = problem.seq_len;
  call.num_seqs = problem.num_seqs;
  call.scale = problem.scale;
  call.gate_scale = gate_scale(problem.lower_bound);
  call.state_is_bf16 = problem.state_dtype == FKDA_DTYPE_BF16;
  call.state_is_kv = problem.state_layout == FKDA_STATE_LAYOUT_KV;
  call.first_real_slot = problem.null_slot_rule == FKDA_NULL_SLOT_NONPOSITIVE ? 1 : 0;
  return call;
}

// The kernels' view of the layer step.
inline FkdaLayerStep kernel_layer(const LayerStep& layer) {
  FkdaLayerStep k;
  std::memset(&k, 0, sizeof(k));
  for (int proj = 0; proj < 3; ++proj) {
    const ConvView& from = layer.conv[proj];
    FkdaConv& to = k.conv[proj];
    to.weight = from.weight;
    to.weight_stride_c = from.weight_stride_c;
    to.weight_stride_w = from.weight_stride_w;
    to.bias = from.bias;
    to.bias_stride = from.bias_stride;
    to.state = from.state;
    to.state_stride_row = from.state_stride_row;
    to.state_stride_c = from.state_stride_c;
    to.state_stride_w = from.state_stride_w;
  }
  k.conv_width = layer.conv_width;
  k.conv_state_width = layer.has_conv_state() ? layer.conv_state_width : 0;
  k.conv_is_f32 = layer.conv_dtype == FKDA_DTYPE_F32;
  k.conv_state_is_f32 = layer.conv_state_dtype == FKDA_DTYPE_F32;
  k.out_gate = kernel_view(layer.out_gate);
  k.norm_weight = layer.norm_weight;
  k.norm_weight_stride = layer.norm_weight_stride;
  k.norm_weight_is_f32 = layer.norm_weight_dtype == FKDA_DTYPE_F32;
  k.norm_eps = layer.norm_eps;
  return k;
}

}  // namespace fkda::gpu
