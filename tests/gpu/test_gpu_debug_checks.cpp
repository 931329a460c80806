// SPDX-License-Identifier: MIT
// The debug checks of GPU plans: device-side indices, counts and offsets are
// copied to the host and checked like a CPU plan's before anything is
// launched; without them the host never reads those values.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"

namespace {

using namespace fkda_ref;

constexpr int64_t kD = 128;

fkda_plan_t debug_plan(int32_t debug_checks) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = 1;
  desc.backend = FKDA_BACKEND_GPU;
  desc.debug_checks = debug_checks;
  fkda_plan_t plan = nullptr;
  FKDA_REQUIRE(fkda_plan_create(&desc, &plan));
  return plan;
}

// A valid packed decode of sequences of 1, 2 and 3 tokens on an 8-slot f32
// pool, everything on the device; `slots`, `table`, `accepted` and `cu` are
// uploaded by upload() after a test changed them.
struct DeviceDecode {
  Problem p;
  std::vector<int32_t> slots = {1, 3, 5};
  std::vector<int32_t> table = {0, -1, -1, -1, 1, 2, -1, -1, 3, 4, 5, -1};  // [3, 4]
  std::vector<int32_t> accepted = {1, 2, 3};
  std::vector<int32_t> cu = {0, 1, 3, 6};
  DeviceProblem device;
  DeviceBuffer pool{size_t(8 * kD * kD) * 4};
  DeviceBuffer slots_d{slots}, table_d{table}, accepted_d{accepted}, cu_d{cu};

  static Problem make() {
    ProblemShape shape;
    shape.lengths = {1, 2, 3};
    shape.with_initial_state = false;
    return random_problem(slow_decay(shape), 7);
  }
  // The pool holds 0x3c3c3c3c (about 0.0115) in every f32.
  DeviceDecode() : p(make()), device(p) { CUDA_REQUIRE(cudaMemset(pool.get(), 0x3c, pool.bytes())); }

  void upload() {
    slots_d.upload(slots.data());
    table_d.upload(table.data());
    accepted_d.upload(accepted.data());
    cu_d.upload(cu.data());
  }
  fkda_decode_args args(bool speculative) {
    fkda_decode_args a = make_decode_args(p, device.buffers());
    a.cu_seqlens = tensor(cu_d.get(), FKDA_DTYPE_I32, {4});
    a.state_pool = tensor(pool.get(), FKDA_DTYPE_F32, {8, 1, kD, kD});
    if (speculative) {
      a.state_indices = tensor(table_d.get(), FKDA_DTYPE_I32, {3, 4});
      a.num_accepted_tokens = tensor(accepted_d.get(), FKDA_DTYPE_I32, {3});
    } else {
      a.state_indices = tensor(slots_d.get(), FKDA_DTYPE_I32, {3});
    }
    return a;
  }
};

fkda_status decode(fkda_plan_t plan, const fkda_decode_args& args, cudaStream_t stream = nullptr) {
  return fkda_decode(plan, &args, nullptr, 0, stream);
}

}  // namespace

TEST_CASE("GPU debug checks: decode indices are read from the device and checked", "[gpu][debug]") {
  DeviceDecode d;
  fkda_plan_t checked = debug_plan(1), unchecked = debug_plan(0);

  SECTION("a valid call passes them") {
    const fkda_status status = decode(checked, d.args(false));
    INFO(fkda_last_error());
    CHECK(status != FKDA_ERROR_INVALID_ARGUMENT);
  }
  SECTION("a slot past the pool") {
    d.slots[1] = 8;
    d.upload();
    expect_invalid(decode(checked, d.args(false)), "state_indices[1]: slot 8 is outside the pool's 8 slots (sequence 1)");
    CHECK(decode(unchecked, d.args(false)) != FKDA_ERROR_INVALID_ARGUMENT);  // never read on the host
  }
  SECTION("two sequences writing one slot") {
    d.slots[2] = 1;
    d.upload();
    expect_invalid(decode(checked, d.args(false)), "state_indices[2]: slot 1 is also written by sequence 0");
  }
  SECTION("cu_seqlens that miss the token count") {
    d.cu[3] = 5;
    d.upload();
    expect_invalid(decode(checked, d.args(false)), "cu_seqlens: must end at T = 6");
  }
  SECTION("an accepted count outside the table") {
    d.accepted[0] = 0;
    d.upload();
    expect_invalid(decode(checked, d.args(true)), "num_accepted_tokens[0]: 0 is outside [1, 4]");
  }
  SECTION("values the stream writes just before the call") {
    const Stream stream;
    CUDA_REQUIRE(cudaMemsetAsync(d.slots_d.get(), 0x01, sizeof(int32_t), stream.get()));  // slot 0x01010101
    expect_invalid(decode(checked, d.args(false), stream.get()), "state_indices[0]: slot 16843009 is outside the pool");
  }
  SECTION("FKDA_DEBUG_CHECKS=1 turns them on") {
    setenv("FKDA_DEBUG_CHECKS", "1", 1);
    fkda_plan_t from_environment = debug_plan(0);
    unsetenv("FKDA_DEBUG_CHECKS");
    d.slots[0] = 9;
    d.upload();
    expect_invalid(decode(from_environment, d.args(false)), "state_indices[0]: slot 9");
    fkda_plan_destroy(from_environment);
  }
  fkda_plan_destroy(checked);
  fkda_plan_destroy(unchecked);
}

TEST_CASE("GPU debug checks: prefill slots and checkpoint offsets are checked", "[gpu][debug]") {
  ProblemShape shape;
  shape.lengths = {32, 16};
  shape.with_initial_state = false;
  const Problem p = random_problem(slow_decay(shape), 9);
  DeviceProblem device(p);
  DeviceBuffer pool{size_t(8 * kD * kD) * 4};
  CUDA_REQUIRE(cudaMemset(pool.get(), 0x3c, pool.bytes()));
  std::vector<int32_t> slots = {2, 4};
  std::vector<int64_t> offsets = {16, 32, 16, -1};
  std::vector<int32_t> checkpoint_slots = {5, 6, 7, -1};
  fkda_plan_t plan = debug_plan(1);
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan, p.T, 2, &bytes));
  DeviceBuffer workspace{bytes};

  std::string expected;
  SECTION("a checkpoint offset off the 16-token grid") {
    offsets[1] = 24;
    expected = "checkpoint_offsets[0][1]: 24 is not a multiple of 16";
  }
  SECTION("a checkpoint slot shared with another sequence's state") {
    checkpoint_slots[2] = 2;  // sequence 1's checkpoint after its 16 tokens
    expected = "checkpoint_slots[1][0]: slot 2 is also written by sequence 0";
  }
  SECTION("a state slot past the pool") {
    slots[1] = 8;
    expected = "state_indices[1]: slot 8 is outside the pool's 8 slots (sequence 1)";
  }
  DeviceBuffer slots_d{slots}, offsets_d{offsets}, checkpoint_slots_d{checkpoint_slots};
  fkda_fwd_args args = make_args(p, device.buffers(), FKDA_DTYPE_F32);
  args.state_pool = tensor(pool.get(), FKDA_DTYPE_F32, {8, 1, kD, kD});
  args.state_indices = tensor(slots_d.get(), FKDA_DTYPE_I32, {2});
  args.checkpoint_offsets = tensor(offsets_d.get(), FKDA_DTYPE_I64, {2, 2});
  args.checkpoint_slots = tensor(checkpoint_slots_d.get(), FKDA_DTYPE_I32, {2, 2});
  expect_invalid(fkda_fwd(plan, &args, workspace.get(), bytes, nullptr), expected);
  fkda_plan_destroy(plan);
}
