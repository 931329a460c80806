// What the [gpu] tests share: status checks that fail the test with the
// reason, and device memory that frees itself.
#pragma once

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "flashkda.h"

#define CUDA_REQUIRE(expr)                                                             \
  do {                                                                                 \
    const cudaError_t status_ = (expr);                                                \
    if (status_ != cudaSuccess) FAIL(#expr << ": " << cudaGetErrorString(status_));   \
  } while (0)

#define FKDA_REQUIRE(expr)                                                             \
  do {                                                                                 \
    const fkda_status status_ = (expr);                                                \
    if (status_ != FKDA_SUCCESS)                                                       \
      FAIL(#expr << ": " << fkda_status_string(status_) << ": " << fkda_last_error()); \
  } while (0)

namespace fkda_test {

class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    CUDA_REQUIRE(cudaMalloc(&data_, std::max<size_t>(bytes, 256)));
  }
  // A device copy of `host`.
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    upload(host.data());
  }
  ~DeviceBuffer() { cudaFree(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* host) { CUDA_REQUIRE(cudaMemcpy(data_, host, bytes_, cudaMemcpyHostToDevice)); }
  void download(void* host) const { CUDA_REQUIRE(cudaMemcpy(host, data_, bytes_, cudaMemcpyDeviceToHost)); }
  template <typename T>
  std::vector<T> read() const {
    std::vector<T> host(bytes_ / sizeof(T));
    download(host.data());
    return host;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

}  // namespace fkda_test
