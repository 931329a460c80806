/* SPDX-License-Identifier: MIT */
// The CPU reference backend: the chunked form (docs/ARCHITECTURE.md, section
// 2) on host memory, rounding where docs/NUMERICS.md says the GPU kernels round.
#pragma once

#include <cstddef>
#include <cstdint>

#include "decode_problem.h"
#include "prefill_problem.h"
#include "transition_problem.h"
#include "tuning.h"

namespace fkda::cpu {

// Host workspace bytes a call with these sizes needs: per-worker scratch
// for the state and one chunk's operands, one worker per core at most.
// With the chunk-parallel path forced on (use_chunk_parallel), also every
// segment's transition and incoming state.
size_t workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int32_t head_dim_k,
                      int32_t head_dim_v, const Tuning& tuning);

// Workers of a forward call with these sizes: one count for the workspace
// size and the run, so that a workspace of exactly workspace_size() bytes
// gets every worker it was sized for.
int64_t prefill_workers(int64_t total_tokens, int64_t num_seqs, int32_t num_heads);
// The workers fwd runs `problem` with in `workspace_bytes` (>= 1).
int64_t fwd_workers(const PrefillProblem& problem, size_t workspace_bytes);

// Runs the forward pass on host memory with its scratch in `workspace`
// (16-byte aligned, at least workspace_size() bytes: checked by the caller;
// on plans with layer_step the convolved q, k and v come first, then the
// scratch), and the problem's layer step around it (cpu_layer_step.h).
// The problem has been validated, cu_seqlens contents included. May use
// several threads.
void fwd(const PrefillProblem& problem, const Tuning& tuning, void* workspace, size_t workspace_bytes);

// Host workspace bytes fkda_transitions needs: per-worker chunk scratch.
size_t transitions_workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int32_t head_dim_k,
                                  int32_t head_dim_v);
// Each (sequence, head)'s M and E (cpu_transitions.cpp); validated problem.
void transitions(const TransitionProblem& problem, void* workspace, size_t workspace_bytes);
// S <- S M_r + E_r in f32 for r = 0 .. R-1, rounded once into final_state.
void apply_transitions(const ApplyProblem& problem);

// Runs the decode step on host memory, the token-by-token recurrence on the
// pool's states in place, with the problem's layer step around it.
// Indices, counts and offsets have been validated.
void decode(const DecodeProblem& problem);

}  // namespace fkda::cpu
