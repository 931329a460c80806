// SPDX-License-Identifier: MIT
#include "plan.h"
#include "layer_step.h"

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstddef>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

#include "abi_struct.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_driver.h"
#include "dtype_name.h"
#include "error.h"
#include "gpu/gpu_backend.h"
#include "gpu/gpu_transitions.h"

namespace fkda {
namespace {

// Live plans by handle. A handle is the next value of a counter, never an
// address: a destroyed plan's handle matches no later plan, even one the
// allocator places where the old one was.
struct Registry {
  std::mutex mutex;
  std::unordered_map<uintptr_t, std::shared_ptr<Plan>> live;
  uintptr_t last_handle = 0;
};

Registry& registry() {
  // Never destroyed: calls from threads still running at exit may reach it.
  static Registry* r = new Registry;
  return *r;
}

[[noreturn]] void not_live() {
  invalid("plan: not a live plan (already destroyed, or not from fkda_plan_create)");
}

// An environment variable of the tuning, or nullptr when unset or empty.
const char* tuning_variable(const char* name) {
  const char* text = std::getenv(name);
  return text != nullptr && *text != '\0' ? text : nullptr;
}

// A positive integer variable; 0 when unset.
int64_t positive_variable(const char* name) {
  const char* text = tuning_variable(name);
  if (text == nullptr) return 0;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || value <= 0) {
    invalid(std::string(name) + ": expected a positive integer (or unset for the automatic choice), got \"" +
            text + "\"");
  }
  return int64_t(value);
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

Tuning read_tuning(const fkda_plan_desc& desc) {
  Tuning t;
  if (desc.vsplit != 0 && desc.vsplit != 1 && desc.vsplit != 2 && desc.vsplit != 4 && desc.vsplit != 8) {
    invalid("desc.vsplit: expected 0 (automatic), 1, 2, 4 or 8, got " + std::to_string(desc.vsplit));
  }
  if (desc.chunk_parallel != FKDA_CHUNK_PARALLEL_AUTO && desc.chunk_parallel != FKDA_CHUNK_PARALLEL_OFF &&
      desc.chunk_parallel != FKDA_CHUNK_PARALLEL_ON) {
    invalid("desc.chunk_parallel: expected FKDA_CHUNK_PARALLEL_AUTO (0), _OFF (1) or _ON (2), got " +
            std::to_string(desc.chunk_parallel));
  }
  if (desc.window_slots < 0) {
    invalid("desc.window_slots: expected 0 (automatic) or a positive count, got " + std::to_string(desc.window_slots));
  }
  if (desc.segment_chunks < 0) {
    invalid("desc.segment_chunks: expected 0 (automatic) or a positive count, got " +
            std::to_string(desc.segment_chunks));
  }
  t.vsplit = desc.vsplit;
  if (t.vsplit == 0) {
    if (const char* text = tuning_variable("FKDA_VSPLIT")) {
      const std::string value(text);
      if (value != "1" && value != "2" && value != "4" && value != "8") {
        invalid("FKDA_VSPLIT: expected 1, 2, 4 or 8 (or unset for the automatic choice), got \"" + value + "\"");
      }
      t.vsplit = std::stoi(value);
    }
  }
  t.chunk_parallel = desc.chunk_parallel;
  if (t.chunk_parallel == FKDA_CHUNK_PARALLEL_AUTO) {
    if (const char* text = tuning_variable("FKDA_CHUNK_PARALLEL")) {
      const std::string value(text);
      if (value == "off") {
        t.chunk_parallel = FKDA_CHUNK_PARALLEL_OFF;
      } else if (value == "on") {
        t.chunk_parallel = FKDA_CHUNK_PARALLEL_ON;
      } else if (value != "auto") {
        invalid("FKDA_CHUNK_PARALLEL: expected \"auto\", \"off\" or \"on\" (or unset), got \"" + value + "\"");
      }
    }
  }
  t.window_slots = desc.window_slots != 0 ? desc.window_slots : positive_variable("FKDA_WINDOW_SLOTS");
  t.segment_chunks = desc.segment_chunks != 0 ? desc.segment_chunks : positive_variable("FKDA_SEGMENT_CHUNKS");
  return t;
}

namespace {

// The sizes every workspace query takes.
void check_call_sizes(int64_t total_tokens, int64_t num_seqs) {
  if (total_tokens < 0) invalid("total_tokens: must be >= 0, got " + std::to_string(total_tokens));
  if (num_seqs < 0) invalid("num_seqs: must be >= 0, got " + std::to_string(num_seqs));
}

}  // namespace

size_t Plan::workspace_size(int64_t total_tokens, int64_t num_seqs) const {
  check_call_sizes(total_tokens, num_seqs);
  const size_t backend_bytes = backend == FKDA_BACKEND_GPU
                                   ? gpu::workspace_size(total_tokens, num_seqs, num_heads, tuning)
                                   : cpu::workspace_size(total_tokens, num_seqs, num_heads, head_dim_k, head_dim_v, tuning);
  if (!layer_step) return backend_bytes;
  const size_t staging = conv_staging_bytes(total_tokens, num_heads, head_dim_k, backend);
  if (staging > std::numeric_limits<size_t>::max() - backend_bytes) {
    fail(FKDA_ERROR_UNSUPPORTED, "total_tokens: the convolution's workspace for " + std::to_string(total_tokens) +
                                     " tokens cannot be counted");
  }
  return staging + backend_bytes;
}

size_t Plan::transitions_workspace_size(int64_t total_tokens, int64_t num_seqs) const {
  check_call_sizes(total_tokens, num_seqs);
  if (backend == FKDA_BACKEND_GPU) return gpu::transitions_workspace_size(total_tokens, num_seqs, num_heads, tuning);
  return cpu::transitions_workspace_size(total_tokens, num_seqs, num_heads, head_dim_k, head_dim_v);
}

size_t Plan::decode_workspace_size(int64_t total_tokens, int64_t num_seqs) const {
  check_call_sizes(total_tokens, num_seqs);
  return 0;  // both backends decode straight from and into the pool
}

fkda_plan_t create_plan(const fkda_plan_desc* desc) {
  if (desc == nullptr) invalid("desc: NULL");
  const fkda_plan_desc read = read_versioned(desc, "desc");
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
  const Tuning tuning = read_tuning(*desc);

  if (desc->chunk_parallel != FKDA_CHUNK_PARALLEL_AUTO && desc->chunk_parallel != FKDA_CHUNK_PARALLEL_OFF &&
      desc->chunk_parallel != FKDA_CHUNK_PARALLEL_ON) {
    invalid("desc.chunk_parallel: expected FKDA_CHUNK_PARALLEL_AUTO (0), _OFF (1) or _ON (2), got " +
            std::to_string(desc->chunk_parallel));
  }
  if (desc->segment_chunks < 0) {
    invalid("desc.segment_chunks: must be 0 (automatic) or > 0, got " + std::to_string(desc->segment_chunks));
  }
  if (desc->layer_step != 0 && desc->layer_step != 1) {
    invalid("desc.layer_step: expected 0 or 1, got " + std::to_string(desc->layer_step));
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

  std::shared_ptr<Plan> plan = std::make_shared<Plan>();
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
  plan->tuning = tuning;
  plan->layer_step = desc->layer_step == 1;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const uintptr_t handle = ++r.last_handle;
  r.live.emplace(handle, std::move(plan));
  return reinterpret_cast<fkda_plan_t>(handle);
}

void destroy_plan(fkda_plan_t plan) {
  if (plan == nullptr) return;
  std::shared_ptr<Plan> released;  // freed after the lock, unless a call still holds it
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto found = r.live.find(reinterpret_cast<uintptr_t>(plan));
  if (found == r.live.end()) not_live();
  released = std::move(found->second);
  r.live.erase(found);
}

std::shared_ptr<Plan> hold_plan(fkda_plan_t handle) {
  if (handle == nullptr) invalid("plan: NULL");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto found = r.live.find(reinterpret_cast<uintptr_t>(handle));
  if (found == r.live.end()) not_live();
  return found->second;
}

}  // namespace fkda
