#include "bench_support.h"

#include <cstdio>
#include <utility>

namespace fkda_bench {

void check_cuda(cudaError_t error, const char* call, const char* file, int line) {
  if (error == cudaSuccess) return;
  throw BenchError(std::string(call) + " failed: " + cudaGetErrorName(error) + ": " +
                       cudaGetErrorString(error) + " (" + file + ":" + std::to_string(line) + ")",
                   kExitFailure);
}

void check_fkda(fkda_status status, const char* call, const char* file, int line) {
  if (status == FKDA_SUCCESS) return;
  // Read the thread-local message before any other fkda_* call replaces it.
  const std::string detail = fkda_last_error();
  throw BenchError(std::string(call) + " failed: " + fkda_status_string(status) +
                       (detail.empty() ? std::string() : ": " + detail) + " (" + file + ":" +
                       std::to_string(line) + ")",
                   kExitFailure);
}

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t error = cudaMalloc(&data_, bytes);
  if (error != cudaSuccess) {
    data_ = nullptr;
    throw BenchError("cudaMalloc of " + std::to_string(bytes) + " bytes failed: " +
                         cudaGetErrorName(error) + ": " + cudaGetErrorString(error),
                     kExitFailure);
  }
}

DeviceBuffer::~DeviceBuffer() { release(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::release() noexcept {
  if (!data_) return;
  // A destructor cannot throw; a failing cudaFree means the context is
  // already broken, which the next checked call reports.
  const cudaError_t error = cudaFree(data_);
  if (error != cudaSuccess)
    std::fprintf(stderr, "fkda-bench: warning: cudaFree failed: %s\n", cudaGetErrorString(error));
  data_ = nullptr;
  bytes_ = 0;
}

Plan::Plan(const fkda_plan_desc& desc) { FKDA_BENCH_FKDA(fkda_plan_create(&desc, &plan_)); }

Stream::Stream() { FKDA_BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }

Stream::~Stream() {
  const cudaError_t error = cudaStreamDestroy(stream_);
  if (error != cudaSuccess)
    std::fprintf(stderr, "fkda-bench: warning: cudaStreamDestroy failed: %s\n",
                 cudaGetErrorString(error));
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
