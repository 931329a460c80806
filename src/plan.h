/* SPDX-License-Identifier: MIT */
// The plan: a small host object holding the configuration fixed at creation
// (heads, head dims, state dtype and layout, resolved backend) and the one
// setting that may change later (lower_bound). It owns no device memory.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "flashkda.h"
#include "tuning.h"

namespace fkda {

// The chunk-16 path keeps exp(16·|lower_bound|) inside bf16/f32 range only
// for lower_bound >= -5 (docs/ARCHITECTURE.md, section 3).
constexpr float kMinLowerBound = -5.0f;
constexpr float kMaxLowerBound = 0.0f;
constexpr int32_t kSupportedHeadDim = 128;

struct Plan {
  int32_t num_heads = 0;
  int32_t head_dim_k = kSupportedHeadDim;
  int32_t head_dim_v = kSupportedHeadDim;
  int32_t state_dtype = FKDA_DTYPE_F32;
  int32_t state_layout = FKDA_STATE_LAYOUT_VK;
  fkda_backend backend = FKDA_BACKEND_CPU;  // resolved: CPU or GPU
  int32_t null_slot_rule = FKDA_NULL_SLOT_NEGATIVE;
  // GPU plans copy device-side indices and offsets to the host and check
  // them before each launch; CPU plans add the duplicate-slot check.
  bool debug_checks = false;
  int32_t gate_mode = FKDA_GATE_BOUNDED;  // fkda_gate_mode
  int32_t beta_mode = FKDA_BETA_LOGITS;   // fkda_beta_mode
  std::atomic<float> lower_bound{-5.0f};  // BOUNDED plans only
  Tuning tuning;  // GPU prefill's launch choices, fixed at creation
  // fkda_fwd may fuse the convolution of the layer step: its workspace
  // counts the projections the backend stages (layer_step.h).
  bool layer_step = false;
  // The launch shape of the last GPU fkda_fwd (fkda_plan_get_launch_report).
  mutable std::mutex launch_mutex;
  mutable fkda_launch_report last_launch = FKDA_LAUNCH_REPORT_INIT;

  size_t workspace_size(int64_t total_tokens, int64_t num_seqs) const;
  // fkda_plan_transitions_workspace_size.
  size_t transitions_workspace_size(int64_t total_tokens, int64_t num_seqs) const;
  // fkda_plan_decode_workspace_size.
  size_t decode_workspace_size(int64_t total_tokens, int64_t num_seqs) const;
};


// Throws fkda::Error naming the field when `desc` is unusable; resolves AUTO.
fkda_plan_t create_plan(const fkda_plan_desc* desc);
// NULL is a no-op; a handle that is not live is an error. Calls already
// running on the plan keep it (hold_plan); it is freed when the last ends.
void destroy_plan(fkda_plan_t plan);

// The live plan behind a handle, shared with the registry so that a
// concurrent destroy_plan cannot free it while the caller holds the pointer:
// every call on a plan keeps one for its whole duration. Throws
// FKDA_ERROR_INVALID_ARGUMENT for NULL, destroyed or foreign handles. A
// handle is a number never given out twice, not an address, so a stale
// handle cannot reach a plan created later.
std::shared_ptr<Plan> hold_plan(fkda_plan_t handle);

// The tuning of a new plan: the desc's 0.4 fields, those left at 0 from the
// environment (FKDA_VSPLIT, FKDA_CHUNK_PARALLEL, FKDA_WINDOW_SLOTS,
// FKDA_SEGMENT_CHUNKS). Throws naming the field or variable.
Tuning read_tuning(const fkda_plan_desc& desc);

void check_lower_bound(float lower_bound);
// "bounded", "softplus", "log-decay": how messages name a gate mode.
const char* gate_mode_name(int32_t gate_mode);
// Throws, naming `plan`, unless the plan's gate is BOUNDED (the only one
// with a floor).
void require_bounded_gate(const Plan& plan);

// Why the GPU backend cannot run here, or an empty string when it can.
// Looks at the current context's device, else device 0.
fkda_status gpu_unusable_reason(std::string* reason);

}  // namespace fkda
