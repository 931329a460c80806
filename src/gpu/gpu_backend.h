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

namespace fkda::gpu {

// Device workspace bytes for a call with these sizes (any state mode).
size_t workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads);

// Whether the embedded fatbin has an image that runs on compute capability major.minor.
bool has_kernels_for(int cc_major, int cc_minor);
// What to tell a caller whose device has none.
std::string unsupported_arch_message(int cc_major, int cc_minor);

// How a forward pass was launched (fkda_launch_report).
struct LaunchShape {
  int32_t vsplit = 0;            // blocks sharing the V rows of one (sequence, head)
  int64_t windows = 0;           // preparation + recurrence launch pairs
  int64_t slots_per_window = 0;  // chunk slots of each window; the last may hold fewer
  int64_t segment_chunks = 0;    // chunks per segment of the chunk-parallel path; 0: serial
};

// Enqueues the forward pass and says how it was launched. Throws
// fkda::Error: FKDA_ERROR_NO_DEVICE, FKDA_ERROR_UNSUPPORTED_ARCH,
// FKDA_ERROR_DRIVER, FKDA_ERROR_LAUNCH_FAILED, or FKDA_ERROR_INVALID_ARGUMENT
// for a bad tuning variable (FKDA_VSPLIT, FKDA_WINDOW_SLOTS).
// The workspace size has been checked by the caller.
LaunchShape fwd(const PrefillProblem& problem, void* workspace, size_t workspace_bytes, CUstream stream);

// Enqueues the decode step (no workspace). Same errors as fwd.
void decode(const DecodeProblem& problem, CUstream stream);

}  // namespace fkda::gpu
