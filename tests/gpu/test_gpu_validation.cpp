// SPDX-License-Identifier: MIT
// Checks that need a GPU: where memory lives, alignment for the kernels'
// 16-byte accesses, and the device workspace size.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"
#include "prefill_harness.h"

namespace {

using fkda_ref::DeviceBuffer;

constexpr int64_t kB = 1, kT = 40, kH = 2, kD = 128;

fkda_ref::Plan make_plan(fkda_backend backend) {
  return fkda_ref::Plan(fkda_ref::plan_desc(kH, -5.0f, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, backend));
}

// Valid device-side arguments; each section breaks one thing.
struct DeviceCall {
  size_t act_bytes = size_t(kB * kT * kH * kD) * 2 + 64;  // room for misaligned views
  DeviceBuffer q{act_bytes}, k{act_bytes}, v{act_bytes}, g{act_bytes}, out{act_bytes};
  DeviceBuffer beta{size_t(kB * kT * kH) * 2}, A_log{kH * 4}, dt_bias{kH * kD * 4};
  fkda_fwd_args args = FKDA_FWD_ARGS_INIT;

  DeviceCall() {
    for (void* p : {q.get(), k.get(), v.get(), g.get(), out.get()}) REQUIRE(cudaMemset(p, 0x3c, act_bytes) == cudaSuccess);
    REQUIRE(cudaMemset(beta.get(), 0x3c, size_t(kB * kT * kH) * 2) == cudaSuccess);
    REQUIRE(cudaMemset(A_log.get(), 0, kH * 4) == cudaSuccess);
    REQUIRE(cudaMemset(dt_bias.get(), 0, kH * kD * 4) == cudaSuccess);
    args.q = fkda_ref::tensor(q.get(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    args.k = fkda_ref::tensor(k.get(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    args.v = fkda_ref::tensor(v.get(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    args.g = fkda_ref::tensor(g.get(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    args.out = fkda_ref::tensor(out.get(), FKDA_DTYPE_BF16, {kB, kT, kH, kD});
    args.beta = fkda_ref::tensor(beta.get(), FKDA_DTYPE_BF16, {kB, kT, kH});
    args.A_log = fkda_ref::tensor(A_log.get(), FKDA_DTYPE_F32, {kH});
    args.dt_bias = fkda_ref::tensor(dt_bias.get(), FKDA_DTYPE_F32, {kH, kD});
  }
};

}  // namespace

TEST_CASE("GPU plans reject host memory, CPU plans reject device memory", "[gpu][validation]") {
  DeviceCall call;
  const fkda_ref::Plan gpu = make_plan(FKDA_BACKEND_GPU);
  const fkda_ref::Plan cpu = make_plan(FKDA_BACKEND_CPU);
  size_t bytes = 0;
  REQUIRE(fkda_plan_workspace_size(gpu.get(), kB * kT, kB, &bytes) == FKDA_SUCCESS);
  DeviceBuffer workspace(bytes);

  REQUIRE(fkda_fwd(gpu.get(), &call.args, workspace.get(), bytes, nullptr) == FKDA_SUCCESS);
  CUDA_REQUIRE(cudaDeviceSynchronize());

  std::vector<uint16_t> host_q(size_t(kB * kT * kH * kD), 0x3c00);
  fkda_fwd_args with_host_q = call.args;
  with_host_q.q.data = host_q.data();
  expect_invalid(fkda_fwd(gpu.get(), &with_host_q, workspace.get(), bytes, nullptr),
                 "q: host memory passed to a GPU plan");

  expect_invalid(fkda_fwd(cpu.get(), &call.args, nullptr, 0, nullptr), "q: device memory passed to a CPU plan");

}

TEST_CASE("GPU plans need 16-byte aligned rows and enough workspace", "[gpu][validation]") {
  DeviceCall call;
  const fkda_ref::Plan gpu = make_plan(FKDA_BACKEND_GPU);
  size_t bytes = 0;
  REQUIRE(fkda_plan_workspace_size(gpu.get(), kB * kT, kB, &bytes) == FKDA_SUCCESS);
  REQUIRE(bytes > 0);
  DeviceBuffer workspace(bytes);

  fkda_fwd_args misaligned = call.args;
  misaligned.v.data = static_cast<char*>(call.v.get()) + 2;
  expect_invalid(fkda_fwd(gpu.get(), &misaligned, workspace.get(), bytes, nullptr), "v: GPU plans need 16-byte aligned data");

  fkda_fwd_args odd_stride = call.args;
  odd_stride.k.shape[1] = kT / 2;
  odd_stride.k.strides[1] = kH * kD + 4;  // rows 8 bytes apart from a 16-byte boundary
  for (fkda_tensor* t : {&odd_stride.q, &odd_stride.v, &odd_stride.g, &odd_stride.out}) t->shape[1] = kT / 2;
  odd_stride.beta.shape[1] = kT / 2;
  expect_invalid(fkda_fwd(gpu.get(), &odd_stride, workspace.get(), bytes, nullptr),
                 "k: GPU plans need strides that are multiples of 8 elements");

  CHECK(fkda_fwd(gpu.get(), &call.args, workspace.get(), bytes - 1, nullptr) == FKDA_ERROR_WORKSPACE_TOO_SMALL);
  CHECK(std::string(fkda_last_error()).rfind("workspace_bytes: ", 0) == 0);
  expect_invalid(fkda_fwd(gpu.get(), &call.args, nullptr, bytes, nullptr), "workspace: NULL");
  std::vector<unsigned char> host_workspace(bytes + 16);
  void* aligned = host_workspace.data() + (16 - reinterpret_cast<uintptr_t>(host_workspace.data()) % 16) % 16;
  expect_invalid(fkda_fwd(gpu.get(), &call.args, aligned, bytes, nullptr), "workspace: host memory passed to a GPU plan");

}

TEST_CASE("device queries describe the current device as the CUDA runtime sees it", "[gpu]") {
  // main() already skipped the suite unless the query found a device with
  // kernels; what is left to check is that it describes the right one.
  fkda_device_info info = FKDA_DEVICE_INFO_INIT;
  REQUIRE(fkda_query_device(-1, &info) == FKDA_SUCCESS);
  int device = -1, count = 0, driver = 0;
  CUDA_REQUIRE(cudaGetDevice(&device));
  CUDA_REQUIRE(cudaGetDeviceCount(&count));
  CUDA_REQUIRE(cudaDriverGetVersion(&driver));
  cudaDeviceProp properties{};
  CUDA_REQUIRE(cudaGetDeviceProperties(&properties, device));
  CHECK(info.device == device);
  CHECK(info.device_count == count);
  CHECK(info.driver_version == driver);
  CHECK(info.cc_major == properties.major);
  CHECK(info.cc_minor == properties.minor);
  CHECK(std::string(info.name) == properties.name);
  CHECK(fkda_query_device(info.device_count, &info) == FKDA_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(fkda_last_error()).rfind("device: ordinal", 0) == 0);
}

TEST_CASE("launch tuning is read at plan creation; bad values are errors naming the variable or field",
          "[gpu][validation]") {
  DeviceCall call;
  struct Bad {
    const char* variable;
    const char* value;
  };
  for (const Bad& bad : {Bad{"FKDA_VSPLIT", "3"}, Bad{"FKDA_VSPLIT", "16"}, Bad{"FKDA_VSPLIT", "two"},
                         Bad{"FKDA_VSPLIT", "4x"}, Bad{"FKDA_WINDOW_SLOTS", "0"}, Bad{"FKDA_WINDOW_SLOTS", "-3"},
                         Bad{"FKDA_WINDOW_SLOTS", "7 slots"}, Bad{"FKDA_WINDOW_SLOTS", "99999999999999999999"},
                         Bad{"FKDA_CHUNK_PARALLEL", "1"}, Bad{"FKDA_SEGMENT_CHUNKS", "0"}}) {
    CAPTURE(bad.variable, bad.value);
    const fkda_test::Tuning automatic(0, 0);
    fkda_test::ScopedEnv chunk_parallel("FKDA_CHUNK_PARALLEL", int64_t{0}), segment_chunks("FKDA_SEGMENT_CHUNKS", int64_t{0});
    REQUIRE(setenv(bad.variable, bad.value, 1) == 0);
    const fkda_plan_desc desc = fkda_ref::plan_desc(kH, -5.0f, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
    fkda_plan_t plan = nullptr;
    expect_invalid(fkda_plan_create(&desc, &plan), std::string(bad.variable) + ": ");
    CHECK(plan == nullptr);
  }
  fkda_plan_desc bad_field = fkda_ref::plan_desc(kH, -5.0f, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
  bad_field.vsplit = 3;
  fkda_plan_t plan = nullptr;
  expect_invalid(fkda_plan_create(&bad_field, &plan), "desc.vsplit: ");

  // Good values are taken and reported back, whatever the environment says
  // after the plan's creation.
  for (int64_t vsplit : {1, 2, 4, 8}) {
    CAPTURE(vsplit);
    const fkda_test::Tuning forced(vsplit, 1);
    const fkda_ref::Plan gpu = make_plan(FKDA_BACKEND_GPU);
    size_t forced_bytes = 0;
    REQUIRE(fkda_plan_workspace_size(gpu.get(), kB * kT, kB, &forced_bytes) == FKDA_SUCCESS);
    DeviceBuffer forced_workspace(forced_bytes);
    const fkda_test::Tuning later(vsplit == 8 ? 1 : 8, 0);
    size_t later_bytes = 0;
    REQUIRE(fkda_plan_workspace_size(gpu.get(), kB * kT, kB, &later_bytes) == FKDA_SUCCESS);
    CHECK(later_bytes == forced_bytes);
    REQUIRE(fkda_fwd(gpu.get(), &call.args, forced_workspace.get(), forced_bytes, nullptr) == FKDA_SUCCESS);
    CUDA_REQUIRE(cudaDeviceSynchronize());  // before the workspace is freed
    const fkda_launch_report launch = fkda_test::launch_report(gpu.get());
    CHECK(launch.vsplit == vsplit);
    CHECK(launch.slots_per_window == 1);
    CHECK(launch.windows >= kT / 16);
    CHECK(launch.chunk_parallel == 0);
  }
  // The desc's fields, ahead of the environment.
  const fkda_test::Tuning environment(8, 0);
  fkda_plan_desc desc = fkda_ref::plan_desc(kH, -5.0f, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
  desc.vsplit = 2;
  desc.window_slots = 2;
  const fkda_ref::Plan gpu(desc);
  size_t bytes = 0;
  REQUIRE(fkda_plan_workspace_size(gpu.get(), kB * kT, kB, &bytes) == FKDA_SUCCESS);
  DeviceBuffer workspace(bytes);
  // One byte short of the launch the plan computes: refused before any launch.
  CHECK(fkda_fwd(gpu.get(), &call.args, workspace.get(), bytes - 1, nullptr) == FKDA_ERROR_WORKSPACE_TOO_SMALL);
  REQUIRE(fkda_fwd(gpu.get(), &call.args, workspace.get(), bytes, nullptr) == FKDA_SUCCESS);
  CUDA_REQUIRE(cudaDeviceSynchronize());
  const fkda_launch_report launch = fkda_test::launch_report(gpu.get());
  CHECK(launch.vsplit == 2);
  CHECK(launch.slots_per_window == 2);
}
