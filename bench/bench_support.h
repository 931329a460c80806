// Error handling and RAII owners for fkda-bench: every cudart and fkda_* call
// goes through a check that turns a failure into an exception carrying the
// call, the error and fkda_last_error(), caught once in main().
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "flashkda.h"

namespace fkda_bench {

// Process exit codes, also listed by --help.
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,         // a library, CUDA or output check failed
  kExitUsage = 2,           // bad command line or cases file
  kExitNoGpu = 3,           // no usable GPU for a GPU run
  kExitAccuracyMissed = 4,  // an accuracy figure is above its target
};

// A failure with the exit code it should end the program with.
class BenchError : public std::runtime_error {
 public:
  BenchError(const std::string& message, int exit_code)
      : std::runtime_error(message), exit_code_(exit_code) {}
  int exit_code() const { return exit_code_; }

 private:
  int exit_code_;
};

void check_cuda(cudaError_t error, const char* call, const char* file, int line);
void check_fkda(fkda_status status, const char* call, const char* file, int line);

#define FKDA_BENCH_CUDA(call) ::fkda_bench::check_cuda((call), #call, __FILE__, __LINE__)
#define FKDA_BENCH_FKDA(call) ::fkda_bench::check_fkda((call), #call, __FILE__, __LINE__)

// Device memory owned by one object. Zero bytes is a null buffer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void release() noexcept;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// An fkda plan destroyed with its owner.
class Plan {
 public:
  explicit Plan(const fkda_plan_desc& desc);
  ~Plan() { fkda_plan_destroy(plan_); }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  fkda_plan_t get() const { return plan_; }

 private:
  fkda_plan_t plan_ = nullptr;
};

// A non-blocking stream, so that nothing on the legacy default stream
// serialises with the timed calls.
class Stream {
 public:
  Stream();
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// The device the benchmark runs on, opened once by open_device().
struct DeviceContext {
  int ordinal = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t l2_bytes = 0;
  size_t total_memory = 0;
  int driver_version = 0;
  int runtime_version = 0;
};

// Makes device 0 current (cudaSetDevice, cudaFree(0)) and checks that this
// build of the library has kernels for it. Throws BenchError with kExitNoGpu
// and the reason when there is no usable GPU.
DeviceContext open_device();

}  // namespace fkda_bench
