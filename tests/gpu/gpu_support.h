/* SPDX-License-Identifier: MIT */
// What the [gpu] tests share: status checks that fail the test with the
// reason, device-side problems and plans (the owners of device memory are
// reference/resource_owners.h's).
#pragma once

#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"
#include "resource_owners.h"
#include "status_checks.h"

#define CUDA_REQUIRE(expr)                                                             \
  do {                                                                                 \
    const cudaError_t status_ = (expr);                                                \
    if (status_ != cudaSuccess) FAIL(#expr << ": " << cudaGetErrorString(status_));   \
  } while (0)

namespace fkda_ref {

// One library call captured on `stream` into a CUDA graph and instantiated;
// the call must succeed. The graph and its instance live as long as this.
class CapturedCall {
 public:
  template <typename Call>
  CapturedCall(cudaStream_t stream, cudaStreamCaptureMode mode, const Call& call) {
    CUDA_REQUIRE(cudaStreamBeginCapture(stream, mode));
    const fkda_status status = call();
    CUDA_REQUIRE(cudaStreamEndCapture(stream, &graph_));
    FKDA_REQUIRE(status);
    CUDA_REQUIRE(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedCall() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  CapturedCall(const CapturedCall&) = delete;
  CapturedCall& operator=(const CapturedCall&) = delete;

  // One replay on `stream`, waited for.
  void replay(cudaStream_t stream) const {
    CUDA_REQUIRE(cudaGraphLaunch(exec_, stream));
    CUDA_REQUIRE(cudaStreamSynchronize(stream));
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// How the plan's last call ran (flashkda.h, "Launch report and tuning").
inline fkda_launch_report launch_report(fkda_plan_t plan) {
  fkda_launch_report report = FKDA_LAUNCH_REPORT_INIT;
  FKDA_REQUIRE(fkda_plan_get_launch_report(plan, &report));
  return report;
}

// The current device's multiprocessors (the decode's kernel choice follows them).
inline int64_t multiprocessors() {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return sms;
}

// Approximately N(0, 1) bf16 values from a cheap generator (a sum of four
// 16-bit uniforms, scaled to unit variance): large problems need hundreds of
// millions of them, more than the reference generator makes quickly.
inline std::vector<uint16_t> quick_normals(size_t count, uint64_t seed) {
  std::vector<uint16_t> values(count);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < count; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float sum = float((x & 0xFFFF) + ((x >> 16) & 0xFFFF) + ((x >> 32) & 0xFFFF) + (x >> 48)) / 65536.0f;
    values[i] = to_bf16((sum - 2.0f) * 1.7320508f);
  }
  return values;
}

// A plan description: these heads, gate floor, state dtype and layout,
// backend and null-slot rule.
inline fkda_plan_desc plan_desc(int64_t heads, float lower_bound, fkda_dtype state_dtype, fkda_state_layout layout,
                                fkda_backend backend = FKDA_BACKEND_GPU,
                                fkda_null_slot_rule rule = FKDA_NULL_SLOT_NEGATIVE) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(heads);
  desc.backend = backend;
  desc.state_dtype = state_dtype;
  desc.state_layout = layout;
  desc.lower_bound = lower_bound;
  desc.null_slot_rule = rule;
  return desc;
}

// p's inputs on the device and an output poisoned with bf16 NaNs (0xFFFF).
struct DeviceProblem {
  DeviceBuffer q, k, v, g, beta, A_log, dt_bias, cu_seqlens, out;
  bool varlen;
  explicit DeviceProblem(const Problem& p)
      : q(p.q), k(p.k), v(p.v), g(p.g), beta(p.beta), A_log(p.A_log), dt_bias(p.dt_bias),
        cu_seqlens(p.cu_seqlens), out(std::vector<uint16_t>(p.q.size(), 0xFFFF)), varlen(!p.cu_seqlens.empty()) {}
  // The buffers for make_args, states left for the caller to set.
  Buffers buffers() const {
    Buffers b{q.get(), k.get(), v.get(), g.get(), beta.get(), A_log.get(), dt_bias.get(), out.get()};
    b.cu_seqlens = varlen ? cu_seqlens.get() : nullptr;
    return b;
  }
};

}  // namespace fkda_ref
