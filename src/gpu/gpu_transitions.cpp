// SPDX-License-Identifier: MIT
// fkda_apply_transitions on the GPU: one launch of the fold kernel
// (kernels/prefill_scan.cuh). The transitions themselves are a form of
// chunk-parallel prefill and live with it in gpu_backend.cpp.
#include "gpu/gpu_transitions.h"

#include <cstring>
#include <limits>
#include <string>

#include "error.h"
#include "gpu/kernel_library.h"
#include "prefill_params.h"

namespace fkda::gpu {

void apply_transitions(const ApplyProblem& problem, void* /*workspace*/, size_t /*workspace_bytes*/,
                       CUstream stream) {
  if (problem.num_heads > 65535 || problem.num_seqs > std::numeric_limits<int32_t>::max()) {
    fail(FKDA_ERROR_UNSUPPORTED, "problem too large for one launch: " + std::to_string(problem.num_seqs) +
                                     " sequences, " + std::to_string(problem.num_heads) + " heads");
  }
  const LaunchContext context = launch_context();
  if (!context.facts.segment_scan_fits) {
    fail(FKDA_ERROR_UNSUPPORTED_ARCH, "fkda_apply_transitions needs " + std::to_string(FKDA_APPLY_SMEM_BYTES) +
                                          " bytes of shared memory per block; the device allows " +
                                          std::to_string(context.facts.max_dynamic_smem));
  }
  const ResolvedKernel kernel = resolve(context, context.kernels.apply_transitions);
  FkdaApplyParams params;
  std::memset(&params, 0, sizeof(params));
  params.m = problem.transition_m;
  params.e = problem.transition_e;
  params.num_transitions = problem.num_transitions;
  params.num_seqs = problem.num_seqs;
  params.num_heads = problem.num_heads;
  params.state_is_kv = problem.state_layout == FKDA_STATE_LAYOUT_KV;
  params.initial_state = problem.initial_state;
  params.final_state = problem.final_state;
  params.state_is_bf16 = problem.state_dtype == FKDA_DTYPE_BF16;
  launch(context, kernel, unsigned(problem.num_seqs), unsigned(problem.num_heads),
         unsigned(FKDA_HEAD_DIM / FKDA_SCAN_ROWS), FKDA_SCAN_THREADS, FKDA_APPLY_SMEM_BYTES, stream, &params);
}

}  // namespace fkda::gpu
