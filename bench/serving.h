/* SPDX-License-Identifier: MIT */
// The serving cases: decode and speculative verify (fkda_decode) and prefill
// on a state pool (fkda_fwd with state_pool), timed on the GPU or, with
// --cpu, run once on the CPU backend and checked.
#pragma once

#include <cstdint>
#include <optional>

#include "cases.h"
#include "timing.h"

namespace fkda_bench {

struct ServingRun {
  ServingCase serving_case;
  bool timed = false;  // false: one checked call on the CPU backend
  TimingResult timing;
  int64_t pool_slots = 0;
  double state_gbps = 0;  // ServingCase::state_bytes_moved() / median
  // Relative L2 errors of the first call's out rows and written states
  // against the fp64 recurrence, over the first `checked_seqs` sequences
  // (NaN when not checked: the pool prefill cases).
  double out_rel_l2;
  double state_rel_l2;
  int64_t checked_seqs = 0;
  ServingRun();
  bool checked() const;
  bool within_check() const;
};

// Loose bounds of the check: a wrong slot, column or padding rule gives
// errors near 1, rounding a few 1e-3.
constexpr double kServingCheckTolerance = 1e-2;

// Times `c` on `device`, or runs it once on the CPU backend without one.
// Inputs are random (never zeros) with a fixed seed; outputs and the pool's
// written slots are checked to be finite (poisoned outputs fail).
ServingRun run_serving_case(const ServingCase& c, const TimingOptions& options,
                            const std::optional<DeviceContext>& device);

}  // namespace fkda_bench
