/* SPDX-License-Identifier: MIT */
// How GPU prefill is launched, fixed when the plan is created: the 0.4
// fields of fkda_plan_desc, or for those left at 0 the environment read once
// by fkda_plan_create (flashkda.h, "Launch report and tuning"). Calls never
// read the environment, so a setenv cannot change a launch between the
// workspace check and the kernels.
#pragma once

#include <cstdint>

#include "flashkda.h"

namespace fkda {

struct Tuning {
  int32_t vsplit = 0;                                // 0: automatic; else 1, 2, 4, 8
  int32_t chunk_parallel = FKDA_CHUNK_PARALLEL_AUTO;  // fkda_chunk_parallel
  int64_t window_slots = 0;                          // 0: automatic
  int64_t segment_chunks = 0;                        // 0: automatic
};

}  // namespace fkda
