/* SPDX-License-Identifier: MIT */
// Owners of what the tests, fkda-bench and fkda-demo acquire: an fkda plan
// and, for programs built with the CUDA runtime, device memory and a stream.
// Each releases what it holds when it goes out of scope, so an early return
// or a failed check leaks nothing; an acquisition that fails throws
// CallFailed naming the call and the reason.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "flashkda.h"

namespace fkda_ref {

struct CallFailed : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Throws CallFailed with the status and fkda_last_error() unless `status` is success.
inline void check_fkda(fkda_status status, const char* call) {
  if (status == FKDA_SUCCESS) return;
  // Read the thread-local message before another fkda_* call replaces it.
  const std::string detail = fkda_last_error();
  throw CallFailed(std::string(call) + " failed: " + fkda_status_string(status) +
                   (detail.empty() ? std::string() : ": " + detail));
}

// A plan destroyed with its owner.
class Plan {
 public:
  explicit Plan(const fkda_plan_desc& desc) { check_fkda(fkda_plan_create(&desc, &plan_), "fkda_plan_create"); }
  ~Plan() { fkda_plan_destroy(plan_); }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  fkda_plan_t get() const { return plan_; }

 private:
  fkda_plan_t plan_ = nullptr;
};

}  // namespace fkda_ref

// Only programs that use the CUDA runtime have its header on their include
// path; the others get the plan owner alone.
#if __has_include(<cuda_runtime_api.h>)
#include <cuda_runtime_api.h>

namespace fkda_ref {

inline void check_cuda(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return;
  throw CallFailed(std::string(call) + " failed: " + cudaGetErrorName(error) + ": " +
                   cudaGetErrorString(error));
}

// Device memory owned by one object. Every non-empty owner holds at least
// 256 bytes, so even a zero-byte buffer is a valid, aligned device pointer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    check_cuda(cudaMalloc(&data_, bytes < 256 ? 256 : bytes), "cudaMalloc");
  }
  // A device copy of `host`.
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    upload(host.data());
  }
  // A failing cudaFree means the context is already broken; the next
  // checked call reports it, as a destructor cannot.
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* host) { check_cuda(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice), "cudaMemcpy"); }
  void download(void* host) const {
    check_cuda(cudaMemcpy(host, data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  template <typename T>
  std::vector<T> read() const {
    std::vector<T> host(bytes_ / sizeof(T));
    download(host.data());
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A non-blocking stream, so that nothing on the legacy default stream
// serialises with the work on it.
class Stream {
 public:
  Stream() { check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace fkda_ref
#endif
