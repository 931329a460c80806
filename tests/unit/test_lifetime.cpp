// SPDX-License-Identifier: MIT
// Plan handles across destruction, and the thread's last error across a
// destroy (flashkda.h, "Plans" and fkda_last_error).
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "flashkda.h"

namespace {

fkda_plan_t cpu_plan(int32_t heads) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = heads;
  desc.backend = FKDA_BACKEND_CPU;
  fkda_plan_t plan = nullptr;
  REQUIRE(fkda_plan_create(&desc, &plan) == FKDA_SUCCESS);
  return plan;
}

}  // namespace

TEST_CASE("a destroyed plan's handle never reaches a plan created later", "[lifetime]") {
  // The allocator hands a freed block of the same size straight back: a
  // handle that were the plan's address would name the new plan.
  std::vector<fkda_plan_t> seen;
  for (int round = 0; round < 50; ++round) {
    fkda_plan_t old = cpu_plan(3);
    REQUIRE(fkda_plan_destroy(old) == FKDA_SUCCESS);
    fkda_plan_t later = cpu_plan(5);
    CHECK(later != old);
    size_t bytes = 0;
    CHECK(fkda_plan_workspace_size(old, 16, 1, &bytes) == FKDA_ERROR_INVALID_ARGUMENT);
    CHECK(std::string(fkda_last_error()).rfind("plan: not a live plan", 0) == 0);
    CHECK(fkda_plan_destroy(old) == FKDA_ERROR_INVALID_ARGUMENT);
    CHECK(fkda_plan_destroy(later) == FKDA_SUCCESS);
  }
}

TEST_CASE("fkda_plan_destroy keeps the message of the failing call before it", "[lifetime]") {
  fkda_plan_t plan = cpu_plan(2);
  fkda_plan_t collected = cpu_plan(4);
  size_t bytes = 0;
  REQUIRE(fkda_plan_workspace_size(plan, -1, 1, &bytes) == FKDA_ERROR_INVALID_ARGUMENT);
  const std::string message = fkda_last_error();
  CHECK(message.rfind("total_tokens: ", 0) == 0);
  // What a garbage collector may run between the failure and the read.
  REQUIRE(fkda_plan_destroy(collected) == FKDA_SUCCESS);
  CHECK(fkda_plan_destroy(nullptr) == FKDA_SUCCESS);
  CHECK(std::string(fkda_last_error()) == message);
  // Every other successful call empties it.
  REQUIRE(fkda_plan_workspace_size(plan, 16, 1, &bytes) == FKDA_SUCCESS);
  CHECK(std::string(fkda_last_error()).empty());
  REQUIRE(fkda_plan_destroy(plan) == FKDA_SUCCESS);
}
