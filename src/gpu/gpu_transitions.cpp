// SPDX-License-Identifier: MIT
// Placeholders until the kernels of fkda_transitions and
// fkda_apply_transitions exist: GPU plans get FKDA_ERROR_UNSUPPORTED.
#include "gpu/gpu_transitions.h"

#include <string>

#include "error.h"

namespace fkda::gpu {

namespace {

[[noreturn]] void not_built(const char* call) {
  fail(FKDA_ERROR_UNSUPPORTED, std::string(call) + ": not built yet for GPU plans (CPU plans compute it)");
}

}  // namespace

size_t transitions_workspace_size(int64_t, int64_t, int32_t) { not_built("fkda_plan_transitions_workspace_size"); }

void transitions(const TransitionProblem&, void*, size_t, CUstream) { not_built("fkda_transitions"); }

void apply_transitions(const ApplyProblem&, void*, size_t, CUstream) { not_built("fkda_apply_transitions"); }

}  // namespace fkda::gpu
