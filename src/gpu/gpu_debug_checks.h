/* SPDX-License-Identifier: MIT */
// The debug checks of GPU plans (fkda_plan_desc.debug_checks or
// FKDA_DEBUG_CHECKS=1): the device-side cu_seqlens, slot indices, accepted
// counts and checkpoint offsets are copied to the host and checked like a
// CPU plan's, duplicate write slots included. Synchronises `stream` first,
// so the values the launch would read are the ones checked; not for graph
// capture.
#pragma once

#include <cuda.h>

#include "decode_problem.h"
#include "prefill_problem.h"

namespace fkda::gpu {

void debug_check(const PrefillProblem& problem, CUstream stream);
void debug_check(const DecodeProblem& problem, CUstream stream);

}  // namespace fkda::gpu
