// Launch code of the decode kernel (kernels/decode_*.cuh).
#include "error.h"
#include "gpu/gpu_backend.h"

namespace fkda::gpu {

void decode(const DecodeProblem&, CUstream) {
  fail(FKDA_ERROR_UNSUPPORTED, "fkda_decode: the GPU decode kernel is not in this build");
}

}  // namespace fkda::gpu
