// SPDX-License-Identifier: MIT
// Entry point of the [gpu] tests. Without a usable GPU that this build has
// kernels for, it prints why and exits with 77, which CTest reports as
// skipped; otherwise it makes device 0's primary context current (the
// library works in the caller's context) and runs Catch2.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "flashkda.h"

namespace {

constexpr int kSkipped = 77;

int skip(const char* reason, const char* detail = "") {
  std::printf("SKIPPED: %s%s\n", reason, detail);
  return kSkipped;
}

}  // namespace

int main(int argc, char** argv) {
  // Listing tests or tags needs no GPU.
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--list", 6) == 0) return Catch::Session().run(argc, argv);
  }
  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  if (fkda_query_device(0, &info) != FKDA_SUCCESS) {
    return skip("fkda_query_device failed: ", fkda_last_error());
  }
  if (!info.driver_loaded) return skip("no CUDA driver could be loaded");
  if (info.device_count == 0) return skip("the CUDA driver reports no device");
  if (!info.has_kernels) {
    std::printf("SKIPPED: %s (compute capability %d.%d) has no kernel image in this build\n", info.name,
                info.cc_major, info.cc_minor);
    return kSkipped;
  }
  cudaError_t status = cudaSetDevice(0);
  if (status == cudaSuccess) status = cudaFree(nullptr);  // creates the primary context
  if (status != cudaSuccess) return skip("the CUDA runtime cannot use device 0: ", cudaGetErrorString(status));
  std::printf("device 0: %s, compute capability %d.%d, driver %d\n", info.name, info.cc_major, info.cc_minor,
              info.driver_version);
  std::fflush(stdout);
  return Catch::Session().run(argc, argv);
}
