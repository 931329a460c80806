// SPDX-License-Identifier: MIT
// Checks every argument of fkda_transitions and fkda_apply_transitions
// before any work starts, each failure naming the argument, and builds the
// problems the backends trust.
#pragma once

#include <cstddef>

#include "flashkda.h"
#include "plan.h"
#include "transition_problem.h"

namespace fkda {

TransitionProblem validate_transitions(const Plan& plan, const fkda_transition_args* args, const void* workspace,
                                       size_t workspace_bytes);

ApplyProblem validate_apply(const Plan& plan, const fkda_apply_args* args, const void* workspace,
                            size_t workspace_bytes);

}  // namespace fkda
