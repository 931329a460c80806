// SPDX-License-Identifier: MIT
// The GPU side of fkda_transitions and fkda_apply_transitions: enqueued on
// the caller's stream with no allocation and no host synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda.h>

#include "transition_problem.h"
#include "tuning.h"

namespace fkda::gpu {

// Device workspace bytes fkda_transitions needs for these sizes under the
// plan's tuning (window_slots and segment_chunks apply; the call is always
// cut into segments).
size_t transitions_workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, const Tuning& tuning);

// Enqueues the transitions of every (sequence, head): the preparation, the
// transition pass of chunk-parallel prefill from zero states and the
// identity, and the scan composing every segment (gpu_backend.cpp, which
// owns the windows and segments). Throws fkda::Error like gpu::fwd,
// FKDA_ERROR_WORKSPACE_TOO_SMALL included.
void transitions(const TransitionProblem& problem, const Tuning& tuning, void* workspace, size_t workspace_bytes,
                 CUstream stream);

// Enqueues S <- S M_r + E_r over r for every (sequence, head).
void apply_transitions(const ApplyProblem& problem, void* workspace, size_t workspace_bytes, CUstream stream);

}  // namespace fkda::gpu
