// SPDX-License-Identifier: MIT
// The checks of what indices, offsets and counts hold: slots inside the
// pool, checkpoint offsets on chunk boundaries within their sequence,
// decode lengths and accepted counts. They read host memory: CPU plans run
// them on every call, GPU plans under debug_checks on host copies
// (gpu/gpu_debug_checks.h). Only entries the call reads are checked;
// flashkda.h lists those it never reads. Every message names the element
// and the sequence.
#pragma once

#include "decode_problem.h"
#include "prefill_problem.h"

namespace fkda {

// With check_shared_slots, also that no two sequences write one slot, nor
// one reads a slot another writes.
void check_prefill_contents(const PrefillProblem& problem, bool check_shared_slots);
void check_decode_contents(const DecodeProblem& problem, bool check_shared_slots);

}  // namespace fkda
