// SPDX-License-Identifier: MIT
// Every exported fkda_* function: each catches everything below it and maps
// it to a status plus the thread-local message, so no C++ exception ever
// crosses the C ABI.
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>

#include "abi_struct.h"
#include "cpu/cpu_backend.h"
#include "gpu/cuda_driver.h"
#include "error.h"
#include "fkda_build_info.h"
#include "flashkda.h"
#include "gpu/gpu_backend.h"
#include "gpu/gpu_debug_checks.h"
#include "gpu/gpu_transitions.h"
#include "plan.h"
#include "validate.h"
#include "validate_transitions.h"

namespace {

thread_local std::string last_error_message;

// Whether a successful call empties the thread's message. fkda_plan_destroy
// does not: garbage collectors and destructors run it between another call's
// failure and the caller's fkda_last_error.
enum class OnSuccess { kClearMessage, kKeepMessage };

template <typename Body>
fkda_status guarded(Body&& body, OnSuccess on_success = OnSuccess::kClearMessage) noexcept {
  try {
    if (on_success == OnSuccess::kClearMessage) last_error_message.clear();
    body();
    return FKDA_SUCCESS;
  } catch (const fkda::Error& e) {
    last_error_message = e.message;
    return e.status;
  } catch (const std::bad_alloc&) {
    last_error_message = "host allocation failed";
    return FKDA_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    last_error_message = std::string("internal error: ") + e.what();
    return FKDA_ERROR_INTERNAL;
  } catch (...) {
    last_error_message = "internal error: unknown exception";
    return FKDA_ERROR_INTERNAL;
  }
}

template <typename T>
void require_output(T* pointer, const char* name) {
  if (pointer == nullptr) fkda::invalid(std::string(name) + ": NULL output pointer");
}

}  // namespace

extern "C" {

FKDA_API const char* fkda_status_string(fkda_status status) {
  switch (status) {
    case FKDA_SUCCESS: return "success";
    case FKDA_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case FKDA_ERROR_UNSUPPORTED: return "unsupported";
    case FKDA_ERROR_NO_DEVICE: return "no usable CUDA device";
    case FKDA_ERROR_DRIVER: return "CUDA driver error";
    case FKDA_ERROR_UNSUPPORTED_ARCH: return "no kernels for this GPU architecture";
    case FKDA_ERROR_WORKSPACE_TOO_SMALL: return "workspace too small";
    case FKDA_ERROR_LAUNCH_FAILED: return "kernel launch failed";
    case FKDA_ERROR_OUT_OF_MEMORY: return "out of host memory";
    case FKDA_ERROR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

FKDA_API const char* fkda_last_error(void) { return last_error_message.c_str(); }

FKDA_API uint32_t fkda_version(void) { return FKDA_VERSION_NUMBER; }

#define FKDA_STRINGIFY_(x) #x
#define FKDA_STRINGIFY(x) FKDA_STRINGIFY_(x)
FKDA_API const char* fkda_version_string(void) {
  return FKDA_STRINGIFY(FKDA_VERSION_MAJOR) "." FKDA_STRINGIFY(FKDA_VERSION_MINOR) "." FKDA_STRINGIFY(
      FKDA_VERSION_PATCH);
}

FKDA_API fkda_status fkda_plan_create(const fkda_plan_desc* desc, fkda_plan_t* plan) {
  return guarded([&] {
    require_output(plan, "plan");
    *plan = nullptr;
    *plan = fkda::create_plan(desc);
  });
}

FKDA_API fkda_status fkda_plan_destroy(fkda_plan_t plan) {
  return guarded([&] { fkda::destroy_plan(plan); }, OnSuccess::kKeepMessage);
}

FKDA_API fkda_status fkda_plan_get_backend(fkda_plan_t plan, fkda_backend* backend) {
  return guarded([&] {
    require_output(backend, "backend");
    *backend = fkda::hold_plan(plan)->backend;
  });
}

FKDA_API fkda_status fkda_set_lower_bound(fkda_plan_t plan, float lower_bound) {
  return guarded([&] {
    const std::shared_ptr<fkda::Plan> held = fkda::hold_plan(plan);
    fkda::Plan& p = *held;
    fkda::require_bounded_gate(p);
    fkda::check_lower_bound(lower_bound);
    p.lower_bound.store(lower_bound);
  });
}

FKDA_API fkda_status fkda_get_lower_bound(fkda_plan_t plan, float* lower_bound) {
  return guarded([&] {
    require_output(lower_bound, "lower_bound");
    const std::shared_ptr<const fkda::Plan> held = fkda::hold_plan(plan);
    const fkda::Plan& p = *held;
    fkda::require_bounded_gate(p);
    *lower_bound = p.lower_bound.load();
  });
}

FKDA_API fkda_status fkda_plan_workspace_size(fkda_plan_t plan, int64_t total_tokens,
                                              int64_t num_seqs, size_t* bytes) {
  return guarded([&] {
    require_output(bytes, "bytes");
    *bytes = fkda::hold_plan(plan)->workspace_size(total_tokens, num_seqs);
  });
}

FKDA_API fkda_status fkda_fwd(fkda_plan_t plan, const fkda_fwd_args* args, void* workspace,
                              size_t workspace_bytes, fkda_stream_t stream) {
  return guarded([&] {
    const std::shared_ptr<const fkda::Plan> held = fkda::hold_plan(plan);
    const fkda::Plan& p = *held;
    fkda::PrefillProblem problem = fkda::validate_fwd(p, args, workspace, workspace_bytes);
    problem.tuning = p.tuning;
    if (problem.num_seqs == 0) return;  // nothing to compute, nothing to write
    if (p.backend == FKDA_BACKEND_GPU) {
      const CUstream cu_stream = reinterpret_cast<CUstream>(stream);
      if (problem.debug_checks) fkda::gpu::debug_check(problem, cu_stream);
      const fkda::gpu::LaunchShape shape = fkda::gpu::fwd(problem, workspace, workspace_bytes, cu_stream);
      std::lock_guard<std::mutex> lock(p.launch_mutex);
      p.last_launch = fkda_launch_report{sizeof(fkda_launch_report), shape.vsplit, shape.windows,
                                         shape.slots_per_window, shape.chunk_parallel, shape.segment_chunks};
    } else {
      fkda::cpu::fwd(problem, p.tuning, workspace, workspace_bytes);
    }
  });
}

FKDA_API fkda_status fkda_plan_decode_workspace_size(fkda_plan_t plan, int64_t total_tokens,
                                                     int64_t num_seqs, size_t* bytes) {
  return guarded([&] {
    require_output(bytes, "bytes");
    *bytes = fkda::hold_plan(plan)->decode_workspace_size(total_tokens, num_seqs);
  });
}

FKDA_API fkda_status fkda_decode(fkda_plan_t plan, const fkda_decode_args* args, void* workspace,
                                 size_t workspace_bytes, fkda_stream_t stream) {
  return guarded([&] {
    const std::shared_ptr<const fkda::Plan> held = fkda::hold_plan(plan);
    const fkda::Plan& p = *held;
    const fkda::DecodeProblem problem = fkda::validate_decode(p, args, workspace, workspace_bytes);
    if (problem.num_seqs == 0 || problem.seq_len == 0) return;  // no token: nothing read or written
    if (p.backend == FKDA_BACKEND_GPU) {
      const CUstream cu_stream = reinterpret_cast<CUstream>(stream);
      if (problem.debug_checks) fkda::gpu::debug_check(problem, cu_stream);
      fkda::gpu::decode(problem, cu_stream);
    } else {
      fkda::cpu::decode(problem);
    }
  });
}

FKDA_API fkda_status fkda_plan_transitions_workspace_size(fkda_plan_t plan, int64_t total_tokens,
                                                          int64_t num_seqs, size_t* bytes) {
  return guarded([&] {
    require_output(bytes, "bytes");
    *bytes = fkda::hold_plan(plan)->transitions_workspace_size(total_tokens, num_seqs);
  });
}

FKDA_API fkda_status fkda_transitions(fkda_plan_t plan, const fkda_transition_args* args, void* workspace,
                                      size_t workspace_bytes, fkda_stream_t stream) {
  return guarded([&] {
    const std::shared_ptr<const fkda::Plan> held = fkda::hold_plan(plan);
    const fkda::Plan& p = *held;
    const fkda::TransitionProblem problem = fkda::validate_transitions(p, args, workspace, workspace_bytes);
    if (problem.num_seqs == 0) return;
    if (p.backend == FKDA_BACKEND_GPU) {
      fkda::gpu::transitions(problem, p.tuning, workspace, workspace_bytes, reinterpret_cast<CUstream>(stream));
    } else {
      fkda::cpu::transitions(problem, workspace, workspace_bytes);
    }
  });
}

FKDA_API fkda_status fkda_apply_transitions(fkda_plan_t plan, const fkda_apply_args* args, void* workspace,
                                            size_t workspace_bytes, fkda_stream_t stream) {
  return guarded([&] {
    const std::shared_ptr<const fkda::Plan> held = fkda::hold_plan(plan);
    const fkda::Plan& p = *held;
    const fkda::ApplyProblem problem = fkda::validate_apply(p, args, workspace, workspace_bytes);
    if (problem.num_seqs == 0) return;
    if (p.backend == FKDA_BACKEND_GPU) {
      fkda::gpu::apply_transitions(problem, workspace, workspace_bytes, reinterpret_cast<CUstream>(stream));
    } else {
      fkda::cpu::apply_transitions(problem);
    }
  });
}

FKDA_API fkda_status fkda_query_device(int32_t device, fkda_device_info* info) {
  return guarded([&] {
    fkda::output_fields_end(info, "info");
    if (device < -1) fkda::invalid("device: expected an ordinal >= 0 or -1, got " + std::to_string(device));
    fkda_device_info result = FKDA_DEVICE_INFO_INIT;
    const fkda::cuda::Driver* d = fkda::cuda::driver();
    if (d == nullptr) {
      result.driver_version = fkda::cuda::found_driver_version();
      fkda::write_versioned(info, result, "info");
      if (fkda::cuda::driver_too_old()) fkda::fail(FKDA_ERROR_NO_DEVICE, fkda::cuda::unavailable_reason());
      return;
    }
    result.driver_loaded = 1;
    result.driver_version = d->version;
    int count = 0;
    fkda::cuda::check(d->cuDeviceGetCount(&count), "cuDeviceGetCount");
    result.device_count = count;
    if (count == 0) {
      fkda::write_versioned(info, result, "info");
      return;
    }
    CUdevice handle = 0;
    if (device == -1) {
      fkda::cuda::check(fkda::cuda::current_or_first_device(*d, &handle), "cuDeviceGet");
    } else {
      if (device >= count) {
        fkda::invalid("device: ordinal " + std::to_string(device) + " out of range, " +
                      std::to_string(count) + " device(s) present");
      }
      fkda::cuda::check(d->cuDeviceGet(&handle, device), "cuDeviceGet");
    }
    result.device = static_cast<int32_t>(handle);
    fkda::cuda::check(d->cuDeviceGetAttribute(&result.cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle),
                      "cuDeviceGetAttribute");
    fkda::cuda::check(d->cuDeviceGetAttribute(&result.cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle),
                      "cuDeviceGetAttribute");
    fkda::cuda::check(d->cuDeviceGetName(result.name, sizeof(result.name), handle), "cuDeviceGetName");
    result.has_kernels = fkda::gpu::has_kernels_for(result.cc_major, result.cc_minor) ? 1 : 0;
    fkda::write_versioned(info, result, "info");
  });
}

FKDA_API fkda_status fkda_plan_get_launch_report(fkda_plan_t plan, fkda_launch_report* report) {
  return guarded([&] {
    fkda::output_fields_end(report, "report");
    const std::shared_ptr<const fkda::Plan> held = fkda::hold_plan(plan);
    const fkda::Plan& p = *held;
    std::lock_guard<std::mutex> lock(p.launch_mutex);
    fkda::write_versioned(report, p.last_launch, "report");
  });
}

FKDA_API fkda_status fkda_get_build_info(fkda_build_info* info) {
  return guarded([&] {
    fkda::output_fields_end(info, "info");
    fkda_build_info result = FKDA_BUILD_INFO_INIT;
    result.cuda_version = FKDA_BUILD_CUDA_VERSION;
    result.min_driver_version = FKDA_BUILD_MIN_DRIVER_VERSION;
    static_assert(sizeof(FKDA_BUILD_ARCHITECTURES) <= sizeof(result.architectures),
                  "fkda_build_info.architectures too small for the fatbin's list");
    std::memcpy(result.architectures, FKDA_BUILD_ARCHITECTURES, sizeof(FKDA_BUILD_ARCHITECTURES));
    fkda::write_versioned(info, result, "info");
  });
}

}  // extern "C"
