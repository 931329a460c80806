// The CPU reference backend: the chunked form (docs/ARCHITECTURE.md, section
// 2) on host memory, rounding where docs/NUMERICS.md says the GPU kernels round.
#pragma once

#include <cstddef>
#include <cstdint>

#include "decode_problem.h"
#include "prefill_problem.h"

namespace fkda::cpu {

// Host workspace bytes a call with these sizes needs: per-worker scratch
// for the state and one chunk's operands, one worker per core at most.
size_t workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int32_t head_dim_k,
                      int32_t head_dim_v);

// Workers of a forward call with these sizes: one count for the workspace
// size and the run, so that a workspace of exactly workspace_size() bytes
// gets every worker it was sized for.
int64_t prefill_workers(int64_t total_tokens, int64_t num_seqs, int32_t num_heads);
// The workers fwd runs `problem` with in `workspace_bytes` (>= 1).
int64_t fwd_workers(const PrefillProblem& problem, size_t workspace_bytes);

// Runs the forward pass on host memory with its scratch in `workspace`
// (16-byte aligned, at least workspace_size() bytes: checked by the caller).
// The problem has been validated, cu_seqlens contents included. May use
// several threads.
void fwd(const PrefillProblem& problem, void* workspace, size_t workspace_bytes);

// Runs the decode step on host memory, the token-by-token recurrence on the
// pool's states in place. Indices, counts and offsets have been validated.
void decode(const DecodeProblem& problem);

}  // namespace fkda::cpu
