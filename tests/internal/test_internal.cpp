// SPDX-License-Identifier: MIT
// Library internals that the C ABI cannot show: the CPU backend's worker
// count, the GPU backend's own workspace check, and a plan held by a call
// while another thread destroys it. Built from the library's sources (the
// shared library exports fkda_* only).
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <thread>

#include "cpu/cpu_backend.h"
#include "error.h"
#include "flashkda.h"
#include "gpu/gpu_backend.h"
#include "plan.h"
#include "prefill_problem.h"

namespace {

fkda::PrefillProblem problem_of(int64_t tokens, int32_t heads) {
  fkda::PrefillProblem p;
  p.batch = 1;
  p.seq_len = tokens;
  p.num_seqs = 1;
  p.num_heads = heads;
  return p;
}

}  // namespace

TEST_CASE("a CPU workspace of exactly the size asked for gets every worker it was sized for", "[internal]") {
  // 4 chunks in each of 32 heads: 128 chunks of work.
  const fkda::PrefillProblem p = problem_of(64, 32);
  const size_t bytes = fkda::cpu::workspace_size(64, 1, 32, 128, 128, fkda::Tuning{});
  const int64_t workers = fkda::cpu::fwd_workers(p, bytes);
  CHECK(workers == fkda::cpu::prefill_workers(64, 1, 32));
  if (std::thread::hardware_concurrency() > 1) {
    CHECK(workers > 1);
  } else {
    WARN("one hardware thread: the count cannot exceed 1 here");
  }
  // Less workspace, fewer workers, never none.
  CHECK(fkda::cpu::fwd_workers(p, bytes / size_t(workers)) == 1);
}

TEST_CASE("the GPU backend checks its launch shape against workspace_bytes before anything else",
          "[internal]") {
  fkda::PrefillProblem p = problem_of(160, 2);
  p.tuning.window_slots = 1;
  const size_t needed = fkda::gpu::workspace_size(160, 1, 2, p.tuning);
  try {
    fkda::gpu::fwd(p, nullptr, needed - 1, nullptr);
    FAIL("accepted a workspace one byte short");
  } catch (const fkda::Error& e) {
    CHECK(e.status == FKDA_ERROR_WORKSPACE_TOO_SMALL);
    CHECK(e.message.rfind("workspace_bytes: ", 0) == 0);
  }
  // The workspace sized under another tuning (what a setenv between sizing
  // and launching used to do): one window needs less than 12 of one slot.
  p.tuning.window_slots = 0;
  const size_t automatic = fkda::gpu::workspace_size(160, 1, 2, p.tuning);
  CHECK(automatic < needed);
  p.tuning.window_slots = 1;
  try {
    fkda::gpu::fwd(p, nullptr, automatic, nullptr);
    FAIL("accepted the workspace of another tuning");
  } catch (const fkda::Error& e) {
    CHECK(e.status == FKDA_ERROR_WORKSPACE_TOO_SMALL);
  }
}

TEST_CASE("a plan destroyed during a call lives until the call ends", "[internal]") {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = 2;
  desc.backend = FKDA_BACKEND_CPU;
  fkda_plan_t handle = nullptr;
  REQUIRE(fkda_plan_create(&desc, &handle) == FKDA_SUCCESS);
  // What every call does first: hold the plan.
  std::shared_ptr<fkda::Plan> in_call = fkda::hold_plan(handle);
  std::weak_ptr<fkda::Plan> watch = in_call;
  std::thread([&] { CHECK(fkda_plan_destroy(handle) == FKDA_SUCCESS); }).join();
  CHECK_FALSE(watch.expired());
  CHECK(in_call->num_heads == 2);
  fkda_backend backend = FKDA_BACKEND_AUTO;
  CHECK(fkda_plan_get_backend(handle, &backend) == FKDA_ERROR_INVALID_ARGUMENT);
  CHECK(std::string(fkda_last_error()).rfind("plan: not a live plan", 0) == 0);
  CHECK(fkda_plan_destroy(handle) == FKDA_ERROR_INVALID_ARGUMENT);
  in_call.reset();  // the call returns
  CHECK(watch.expired());
}
