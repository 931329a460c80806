// SPDX-License-Identifier: MIT
// The GPU side of fkda_transitions and fkda_apply_transitions: enqueued on
// the caller's stream with no allocation and no host synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda.h>

#include "transition_problem.h"

namespace fkda::gpu {

// Device workspace bytes fkda_transitions needs for these sizes.
size_t transitions_workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads);

// Enqueues the transitions of every (sequence, head). The workspace size has
// been checked by the caller. Throws fkda::Error like gpu::fwd.
void transitions(const TransitionProblem& problem, void* workspace, size_t workspace_bytes, CUstream stream);

// Enqueues S <- S M_r + E_r over r for every (sequence, head).
void apply_transitions(const ApplyProblem& problem, void* workspace, size_t workspace_bytes, CUstream stream);

}  // namespace fkda::gpu
