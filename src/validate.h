/* SPDX-License-Identifier: MIT */
// Checks every argument of a call before any work starts and turns the
// ABI's descriptors into the problem the backends trust. Each failure names
// the argument and says what was expected and what came. One file per entry
// point (validate_fwd.cpp, validate_decode.cpp), on the generic checks of
// validate_checks.h and the content checks of validate_contents.h; none of
// them calls back into another entry point's file.
#pragma once

#include <cstddef>

#include "decode_problem.h"
#include "flashkda.h"
#include "plan.h"
#include "prefill_problem.h"

namespace fkda {

PrefillProblem validate_fwd(const Plan& plan, const fkda_fwd_args* args, const void* workspace,
                            size_t workspace_bytes);

DecodeProblem validate_decode(const Plan& plan, const fkda_decode_args* args, const void* workspace,
                              size_t workspace_bytes);

}  // namespace fkda
