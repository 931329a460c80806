/* SPDX-License-Identifier: MIT */
// Error handling for fkda-bench: every cudart and fkda_* call goes through a
// check that turns a failure into an exception carrying the call, the error
// and fkda_last_error(), caught once in main(). The owners of plans, device
// memory and streams are the shared ones of reference/resource_owners.h.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "flashkda.h"
#include "resource_owners.h"

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

using fkda_ref::DeviceBuffer;
using fkda_ref::Plan;
using fkda_ref::Stream;

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
