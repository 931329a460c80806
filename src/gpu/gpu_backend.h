/* SPDX-License-Identifier: MIT */
// The CUDA backend: loads the embedded fatbin once per process, picks the
// kernels for the current device and launches them on the caller's stream.
// No allocation, no host synchronisation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda.h>

#include "decode_problem.h"
#include "prefill_problem.h"
#include "tuning.h"

namespace fkda::gpu {

// Device workspace bytes for a call with these sizes (any state mode) under
// the plan's tuning.
size_t workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, const Tuning& tuning);

// Whether the embedded fatbin has an image that runs on compute capability major.minor.
bool has_kernels_for(int cc_major, int cc_minor);
// What to tell a caller whose device has none.
std::string unsupported_arch_message(int cc_major, int cc_minor);

// How a forward pass was launched (fkda_launch_report).
struct LaunchShape {
  int32_t vsplit = 0;            // blocks sharing the V rows of one (sequence, head)
  int64_t windows = 0;           // preparation + recurrence launch pairs
  int64_t slots_per_window = 0;  // chunk slots of each window; the last may hold fewer
  int64_t chunk_parallel = 0;    // 1 when the chunk-parallel path ran
  int64_t segment_chunks = 0;    // its chunks per segment, 0 when it did not run
};

// Enqueues the forward pass under problem.tuning and says how it was
// launched. Throws fkda::Error: FKDA_ERROR_WORKSPACE_TOO_SMALL when the
// launch shape needs more than workspace_bytes, FKDA_ERROR_NO_DEVICE,
// FKDA_ERROR_UNSUPPORTED_ARCH, FKDA_ERROR_DRIVER or FKDA_ERROR_LAUNCH_FAILED.
// Every kernel is resolved and every limit checked before the first launch,
// so any error but a launch the driver refuses after accepting earlier
// ones leaves the caller's memory untouched.
LaunchShape fwd(const PrefillProblem& problem, void* workspace, size_t workspace_bytes, CUstream stream);

// Enqueues the decode step (no workspace). Same errors as fwd.
void decode(const DecodeProblem& problem, CUstream stream);

}  // namespace fkda::gpu
