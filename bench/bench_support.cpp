// SPDX-License-Identifier: MIT
#include "bench_support.h"

#include <string>

namespace fkda_bench {

namespace {

// The shared check's message, with where the call was made.
template <typename Check>
void rethrow_with_place(Check check, const char* file, int line) {
  try {
    check();
  } catch (const fkda_ref::CallFailed& e) {
    throw BenchError(std::string(e.what()) + " (" + file + ":" + std::to_string(line) + ")", kExitFailure);
  }
}

}  // namespace

void check_cuda(cudaError_t error, const char* call, const char* file, int line) {
  rethrow_with_place([&] { fkda_ref::check_cuda(error, call); }, file, line);
}

void check_fkda(fkda_status status, const char* call, const char* file, int line) {
  rethrow_with_place([&] { fkda_ref::check_fkda(status, call); }, file, line);
}

namespace {

// The library's own account of why it cannot serve a GPU plan, if it gives one.
std::string gpu_refusal_reason() {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = 1;
  desc.backend = FKDA_BACKEND_GPU;
  fkda_plan_t plan = nullptr;
  std::string reason;
  if (fkda_plan_create(&desc, &plan) != FKDA_SUCCESS) reason = fkda_last_error();
  fkda_plan_destroy(plan);
  return reason;
}

}  // namespace

DeviceContext open_device() {
  // Ask the library first: it says plainly when the driver is missing,
  // where cudart would only report an "insufficient" driver version.
  fkda_device_info probe = FKDA_DEVICE_INFO_INIT;
  FKDA_BENCH_FKDA(fkda_query_device(0, &probe));
  if (!probe.driver_loaded || probe.device_count <= 0) {
    const std::string reason = gpu_refusal_reason();
    throw BenchError("no usable GPU: " +
                         (!reason.empty()           ? reason
                          : !probe.driver_loaded ? std::string("the CUDA driver could not be loaded")
                                                 : std::string("no CUDA device")),
                     kExitNoGpu);
  }

  int device_count = 0;
  const cudaError_t count_error = cudaGetDeviceCount(&device_count);
  if (count_error != cudaSuccess)
    throw BenchError(std::string("no usable GPU: cudaGetDeviceCount: ") +
                         cudaGetErrorName(count_error) + ": " + cudaGetErrorString(count_error),
                     kExitNoGpu);
  if (device_count == 0) throw BenchError("no usable GPU: no CUDA device found", kExitNoGpu);

  DeviceContext device;
  device.ordinal = 0;
  const cudaError_t set_error = cudaSetDevice(device.ordinal);
  if (set_error != cudaSuccess)
    throw BenchError(std::string("no usable GPU: cudaSetDevice(0): ") + cudaGetErrorString(set_error),
                     kExitNoGpu);
  // Creates the primary context now: the library works in the caller's
  // current context and never makes one itself.
  FKDA_BENCH_CUDA(cudaFree(nullptr));

  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  FKDA_BENCH_FKDA(fkda_query_device(-1, &info));
  device.name = info.name;
  device.cc_major = info.cc_major;
  device.cc_minor = info.cc_minor;
  if (!info.has_kernels)
    throw BenchError("no usable GPU: this build of libflashkda has no kernels for " + device.name +
                         " (sm_" + std::to_string(info.cc_major) + std::to_string(info.cc_minor) +
                         ")",
                     kExitNoGpu);

  int l2_bytes = 0;
  FKDA_BENCH_CUDA(cudaDeviceGetAttribute(&device.sm_count, cudaDevAttrMultiProcessorCount,
                                         device.ordinal));
  FKDA_BENCH_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device.ordinal));
  device.l2_bytes = size_t(l2_bytes);
  size_t free_bytes = 0;
  FKDA_BENCH_CUDA(cudaMemGetInfo(&free_bytes, &device.total_memory));
  FKDA_BENCH_CUDA(cudaDriverGetVersion(&device.driver_version));
  FKDA_BENCH_CUDA(cudaRuntimeGetVersion(&device.runtime_version));
  return device;
}

}  // namespace fkda_bench
