#include "plan.h"

#include <cmath>
#include <cstdlib>
#include <cstddef>
#include <mutex>
#include <new>
#include <string>
#include <unordered_set>

#include "abi_struct.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_driver.h"
#include "dtype_name.h"
#include "error.h"
#include "gpu/gpu_backend.h"
#include "gpu/gpu_transitions.h"

namespace fkda {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::unordered_set<const Plan*>& registry() {
  static std::unordered_set<const Plan*> live;
  return live;
}

// FKDA_DEBUG_CHECKS=1 turns the checks on for every plan created afterwards,
// without touching the program that creates them.
bool debug_checks_from_environment() {
  const char* value = std::getenv("FKDA_DEBUG_CHECKS");
  return value != nullptr && std::string(value) == "1";
}

}  // namespace

void check_lower_bound(float lower_bound) {
  if (std::isnan(lower_bound) || std::isinf(lower_bound)) {
    invalid("lower_bound: must be a finite number in [-5, 0], got " + std::to_string(lower_bound));
  }
  if (lower_bound < kMinLowerBound || lower_bound > kMaxLowerBound) {
    invalid("lower_bound: " + std::to_string(lower_bound) +
            " is outside [-5, 0]; below -5 the 16-token chunk's exp(16*|lower_bound|) key factor "
            "overflows bf16, and a positive floor is not a decay");
  }
}

const char* gate_mode_name(int32_t gate_mode) {
  switch (gate_mode) {
    case FKDA_GATE_BOUNDED: return "bounded";
    case FKDA_GATE_SOFTPLUS: return "softplus";
    case FKDA_GATE_LOG_DECAY: return "log-decay";
    default: return "unknown";
  }
}

void require_bounded_gate(const Plan& plan) {
  if (plan.gate_mode != FKDA_GATE_BOUNDED) {
    invalid(std::string("plan: lower_bound belongs to the bounded gate; this plan's gate is ") +
            gate_mode_name(plan.gate_mode) + ", which has no floor");
  }
}

fkda_status gpu_unusable_reason(std::string* reason) {
  const cuda::Driver* d = cuda::driver();
  if (d == nullptr) {
    *reason = "no usable CUDA driver: " + cuda::unavailable_reason();
    return FKDA_ERROR_NO_DEVICE;
  }
  int count = 0;
  if (d->cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) {
    *reason = "no CUDA device present";
    return FKDA_ERROR_NO_DEVICE;
  }
  CUdevice device = 0;
  cuda::current_or_first_device(*d, &device);
  int major = 0, minor = 0;
  d->cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device);
  d->cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device);
  if (!gpu::has_kernels_for(major, minor)) {
    *reason = gpu::unsupported_arch_message(major, minor);
    return FKDA_ERROR_UNSUPPORTED_ARCH;
  }
  reason->clear();
  return FKDA_SUCCESS;
}

size_t Plan::workspace_size(int64_t total_tokens, int64_t num_seqs) const {
  if (total_tokens < 0) invalid("total_tokens: must be >= 0, got " + std::to_string(total_tokens));
  if (num_seqs < 0) invalid("num_seqs: must be >= 0, got " + std::to_string(num_seqs));
  if (backend == FKDA_BACKEND_GPU) return gpu::workspace_size(total_tokens, num_seqs, num_heads);
  return cpu::workspace_size(total_tokens, num_seqs, num_heads, head_dim_k, head_dim_v, tuning);
}

size_t Plan::transitions_workspace_size(int64_t total_tokens, int64_t num_seqs) const {
  if (total_tokens < 0) invalid("total_tokens: must be >= 0, got " + std::to_string(total_tokens));
  if (num_seqs < 0) invalid("num_seqs: must be >= 0, got " + std::to_string(num_seqs));
  if (backend == FKDA_BACKEND_GPU) return gpu::transitions_workspace_size(total_tokens, num_seqs, num_heads);
  return cpu::transitions_workspace_size(total_tokens, num_seqs, num_heads, head_dim_k, head_dim_v);
}

fkda_plan_t create_plan(const fkda_plan_desc* desc) {
  if (desc == nullptr) invalid("desc: NULL");
  // 0.1 ended the struct after lower_bound, 0.2 after debug_checks: 0.2's
  // sizeof (48) holds gate_mode's place as padding, and 0.3's (56) vsplit's.
  const fkda_plan_desc read = read_versioned(*desc, fkda_plan_desc FKDA_PLAN_DESC_INIT,
                                             offsetof(fkda_plan_desc, lower_bound) + sizeof(float), "desc",
                                             "FKDA_PLAN_DESC_INIT",
                                             {offsetof(fkda_plan_desc, debug_checks) + sizeof(int32_t),
                                              offsetof(fkda_plan_desc, beta_mode) + sizeof(int32_t)});
  desc = &read;
  if (desc->num_heads <= 0) {
    invalid("desc.num_heads: must be > 0, got " + std::to_string(desc->num_heads));
  }
  if (desc->head_dim_k != kSupportedHeadDim) {
    fail(FKDA_ERROR_UNSUPPORTED, "desc.head_dim_k: only 128 is supported, got " +
                                     std::to_string(desc->head_dim_k));
  }
  if (desc->head_dim_v != kSupportedHeadDim) {
    fail(FKDA_ERROR_UNSUPPORTED, "desc.head_dim_v: only 128 is supported, got " +
                                     std::to_string(desc->head_dim_v));
  }
  if (desc->state_dtype != FKDA_DTYPE_BF16 && desc->state_dtype != FKDA_DTYPE_F32) {
    invalid("desc.state_dtype: expected bf16 or f32, got " + dtype_name(desc->state_dtype));
  }
  if (desc->state_layout != FKDA_STATE_LAYOUT_VK && desc->state_layout != FKDA_STATE_LAYOUT_KV) {
    invalid("desc.state_layout: expected FKDA_STATE_LAYOUT_VK (0) or FKDA_STATE_LAYOUT_KV (1), got " +
            std::to_string(desc->state_layout));
  }
  if (desc->null_slot_rule != FKDA_NULL_SLOT_NEGATIVE && desc->null_slot_rule != FKDA_NULL_SLOT_NONPOSITIVE) {
    invalid("desc.null_slot_rule: expected FKDA_NULL_SLOT_NEGATIVE (0) or FKDA_NULL_SLOT_NONPOSITIVE (1), got " +
            std::to_string(desc->null_slot_rule));
  }
  if (desc->debug_checks != 0 && desc->debug_checks != 1) {
    invalid("desc.debug_checks: expected 0 or 1, got " + std::to_string(desc->debug_checks));
  }
  if (desc->gate_mode != FKDA_GATE_BOUNDED && desc->gate_mode != FKDA_GATE_SOFTPLUS &&
      desc->gate_mode != FKDA_GATE_LOG_DECAY) {
    invalid("desc.gate_mode: expected FKDA_GATE_BOUNDED (0), _SOFTPLUS (1) or _LOG_DECAY (2), got " +
            std::to_string(desc->gate_mode));
  }
  if (desc->beta_mode != FKDA_BETA_LOGITS && desc->beta_mode != FKDA_BETA_PROBABILITIES) {
    invalid("desc.beta_mode: expected FKDA_BETA_LOGITS (0) or FKDA_BETA_PROBABILITIES (1), got " +
            std::to_string(desc->beta_mode));
  }
  const float default_lower_bound = fkda_plan_desc FKDA_PLAN_DESC_INIT.lower_bound;
  if (desc->gate_mode == FKDA_GATE_BOUNDED) {
    try {
      check_lower_bound(desc->lower_bound);
    } catch (Error& e) {
      e.message = "desc." + e.message;
      throw;
    }
  } else if (!(desc->lower_bound == default_lower_bound)) {
    invalid("desc.lower_bound: set to " + std::to_string(desc->lower_bound) + ", but the " +
            gate_mode_name(desc->gate_mode) +
            " gate has no floor (leave lower_bound at its FKDA_PLAN_DESC_INIT value, -5)");
  }

  if (desc->chunk_parallel != FKDA_CHUNK_PARALLEL_AUTO && desc->chunk_parallel != FKDA_CHUNK_PARALLEL_OFF &&
      desc->chunk_parallel != FKDA_CHUNK_PARALLEL_ON) {
    invalid("desc.chunk_parallel: expected FKDA_CHUNK_PARALLEL_AUTO (0), _OFF (1) or _ON (2), got " +
            std::to_string(desc->chunk_parallel));
  }
  if (desc->segment_chunks < 0) {
    invalid("desc.segment_chunks: must be 0 (automatic) or > 0, got " + std::to_string(desc->segment_chunks));
  }

  fkda_backend backend = FKDA_BACKEND_CPU;
  switch (desc->backend) {
    case FKDA_BACKEND_CPU: break;
    case FKDA_BACKEND_GPU: {
      std::string reason;
      fkda_status status = gpu_unusable_reason(&reason);
      if (status != FKDA_SUCCESS) fail(status, "desc.backend: GPU requested but " + reason);
      backend = FKDA_BACKEND_GPU;
      break;
    }
    case FKDA_BACKEND_AUTO: {
      std::string reason;
      backend = gpu_unusable_reason(&reason) == FKDA_SUCCESS ? FKDA_BACKEND_GPU : FKDA_BACKEND_CPU;
      break;
    }
    default:
      invalid("desc.backend: expected FKDA_BACKEND_AUTO, _CPU or _GPU, got " +
              std::to_string(desc->backend));
  }

  auto* plan = new (std::nothrow) fkda_plan_s();
  if (plan == nullptr) fail(FKDA_ERROR_OUT_OF_MEMORY, "plan: host allocation failed");
  plan->num_heads = desc->num_heads;
  plan->head_dim_k = desc->head_dim_k;
  plan->head_dim_v = desc->head_dim_v;
  plan->state_dtype = desc->state_dtype;
  plan->state_layout = desc->state_layout;
  plan->backend = backend;
  plan->lower_bound.store(desc->lower_bound);
  plan->null_slot_rule = desc->null_slot_rule;
  plan->debug_checks = desc->debug_checks == 1 || debug_checks_from_environment();
  plan->gate_mode = desc->gate_mode;
  plan->beta_mode = desc->beta_mode;
  plan->tuning.chunk_parallel = desc->chunk_parallel;
  plan->tuning.segment_chunks = desc->segment_chunks;
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().insert(plan);
  return plan;
}

void destroy_plan(fkda_plan_t plan) {
  if (plan == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    if (registry().erase(plan) == 0) {
      invalid("plan: not a live plan (already destroyed, or not from fkda_plan_create)");
    }
  }
  delete plan;
}

Plan& live_plan(fkda_plan_t handle) {
  if (handle == nullptr) invalid("plan: NULL");
  Plan* plan = handle;
  std::lock_guard<std::mutex> lock(registry_mutex());
  if (registry().count(plan) == 0) {
    invalid("plan: not a live plan (already destroyed, or not from fkda_plan_create)");
  }
  return *plan;
}

}  // namespace fkda
