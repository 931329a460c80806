// Validation of the serving arguments: states in a pool addressed by slot
// indices, checkpoints for prefix caching (fkda_fwd), and fkda_decode.
// Shapes, strides, residency and aliasing are checked for every plan; the
// contents of indices, offsets and counts are read on the host for CPU
// plans, and for GPU plans only under debug_checks (gpu/gpu_debug_checks.h).
#pragma once

#include <cstddef>

#include "decode_problem.h"
#include "flashkda.h"
#include "plan.h"
#include "prefill_problem.h"

namespace fkda {

// The 0.2 fields of fkda_fwd_args, on top of the problem validate_fwd built
// from the 0.1 fields: checks them and fills the pool, index and checkpoint
// views of `problem`.
void validate_fwd_serving(const Plan& plan, const fkda_fwd_args& args, PrefillProblem& problem);

DecodeProblem validate_decode(const Plan& plan, const fkda_decode_args* args, const void* workspace,
                              size_t workspace_bytes);

// Content checks on host-readable views: slots inside the pool (naming the
// sequence), checkpoint offsets multiples of 16, ascending, within the
// sequence; decode lengths and accepted counts. With check_shared_slots,
// also that no two sequences write one slot, nor one reads a slot another
// writes.
void check_prefill_contents(const PrefillProblem& problem, bool check_shared_slots);
void check_decode_contents(const DecodeProblem& problem, bool check_shared_slots);

}  // namespace fkda
