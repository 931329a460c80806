/* SPDX-License-Identifier: MIT */
// Accuracy mode: the accuracy and long-memory cases against the fp64
// token-by-token recurrence, for bf16 and f32 state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "cases.h"

namespace fkda_bench {

struct AccuracyResult {
  std::string id;
  std::string shape;
  fkda_dtype state_dtype = FKDA_DTYPE_F32;
  std::string backend;  // "GPU" or "CPU"
  double out_rel_l2 = 0;
  double state_rel_l2 = 0;
  AccuracyTarget target{};
  AccuracyTarget flashkda_figures{};
  AccuracyTarget fla_figures{};
  bool within_target() const {
    return out_rel_l2 <= target.out && state_rel_l2 <= target.final_state;
  }
};

// Runs each case with each state dtype. On the GPU (the current device,
// opened by the caller) unless `on_cpu`, which uses the CPU backend on host
// memory. `lower_bound` applies to the cases that do not fix their own.
// Throws BenchError when a call fails.
std::vector<AccuracyResult> run_accuracy(const std::vector<AccuracyCase>& cases, bool on_cpu,
                                         float lower_bound, uint64_t seed);

}  // namespace fkda_bench
