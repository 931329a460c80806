// Checks every argument of a forward call before any work starts and turns
// the ABI's descriptors into the PrefillProblem the backends trust. Each failure
// names the argument and says what was expected and what came.
#pragma once

#include <cstddef>

#include "flashkda.h"
#include "plan.h"
#include "prefill_problem.h"

namespace fkda {

PrefillProblem validate_fwd(const Plan& plan, const fkda_fwd_args* args, const void* workspace,
                        size_t workspace_bytes);

}  // namespace fkda
