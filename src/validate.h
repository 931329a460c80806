// Checks every argument of a forward call before any work starts and turns
// the ABI's descriptors into the FwdProblem the backends trust. Each failure
// names the argument and says what was expected and what came.
#pragma once

#include <cstddef>

#include "flashkda.h"
#include "plan.h"
#include "problem.h"

namespace fkda {

FwdProblem validate_fwd(const Plan& plan, const fkda_fwd_args* args, const void* workspace,
                        size_t workspace_bytes);

}  // namespace fkda
