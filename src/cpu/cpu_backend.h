// The CPU reference backend: the chunked algorithm of DESIGN §1 on host
// memory, rounding where docs/NUMERICS.md says the GPU kernels round.
#pragma once

#include "problem.h"

namespace fkda::cpu {

// Runs the forward pass on host memory. The problem has been validated,
// cu_seqlens contents included. May use several threads.
void fwd(const FwdProblem& problem);

}  // namespace fkda::cpu
