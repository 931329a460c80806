// SPDX-License-Identifier: MIT
#include "gpu/gpu_debug_checks.h"

#include <cstdint>
#include <string>
#include <vector>

#include "error.h"
#include "gpu/cuda_driver.h"
#include "validate_checks.h"
#include "validate_contents.h"

namespace fkda::gpu {
namespace {

size_t element_bytes(int32_t dtype) {
  return dtype == FKDA_DTYPE_I64 ? 8 : dtype == FKDA_DTYPE_I32 ? 4 : 1;
}

// Host copies of device-side views; the views handed to the content checks
// point into them, with the same strides.
class HostCopies {
 public:
  explicit HostCopies(CUstream stream) {
    const cuda::Driver* d = cuda::driver();
    if (d == nullptr) fail(FKDA_ERROR_NO_DEVICE, "no usable CUDA driver: " + cuda::unavailable_reason());
    driver_ = d;
    cuda::check(d->cuStreamSynchronize(stream), "debug checks: cuStreamSynchronize");
  }

  // `elements` from `data` on: the span a view's strides reach.
  const void* copy(const void* data, int32_t dtype, int64_t elements, const char* name) {
    if (data == nullptr || elements <= 0) return data;
    buffers_.emplace_back(size_t(elements) * element_bytes(dtype));
    std::vector<unsigned char>& host = buffers_.back();
    const CUresult result = driver_->cuMemcpyDtoH(host.data(), reinterpret_cast<CUdeviceptr>(data), host.size());
    cuda::check(result, (std::string("debug checks: copying ") + name + " to the host (cuMemcpyDtoH)").c_str());
    return host.data();
  }

  void mirror(IndexView& view, const char* name) {
    if (!view.present() || view.rows == 0 || view.cols == 0) return;
    view.data = copy(view.data, view.dtype, (view.rows - 1) * view.stride_row + (view.cols - 1) * view.stride_col + 1,
                     name);
  }

  // Copies cu_seqlens and checks them as a CPU plan would.
  void mirror_and_check(SeqOffsets& cu, int64_t num_seqs, int64_t total_tokens) {
    if (!cu.present()) return;
    cu.data = copy(cu.data, cu.dtype, num_seqs * cu.stride + 1, "cu_seqlens");
    fkda_tensor host = FKDA_TENSOR_NONE;
    host.data = const_cast<void*>(cu.data);
    host.dtype = cu.dtype;
    host.rank = 1;
    host.shape[0] = num_seqs + 1;
    host.strides[0] = cu.stride;
    checks::check_cu_seqlens_contents(host, total_tokens);
  }

 private:
  const cuda::Driver* driver_ = nullptr;
  std::vector<std::vector<unsigned char>> buffers_;
};

// Both problem kinds carry their device-side views under the same names.
template <typename Problem>
Problem host_mirror(const Problem& problem, HostCopies& copies) {
  Problem host = problem;
  copies.mirror_and_check(host.cu_seqlens, host.num_seqs, host.seq_len);
  copies.mirror(host.state_indices, "state_indices");
  return host;
}

}  // namespace

void debug_check(const PrefillProblem& problem, CUstream stream) {
  HostCopies copies(stream);
  PrefillProblem host = host_mirror(problem, copies);
  copies.mirror(host.checkpoint_offsets, "checkpoint_offsets");
  copies.mirror(host.checkpoint_slots, "checkpoint_slots");
  check_prefill_contents(host, true);
}

void debug_check(const DecodeProblem& problem, CUstream stream) {
  HostCopies copies(stream);
  DecodeProblem host = host_mirror(problem, copies);
  copies.mirror(host.num_accepted_tokens, "num_accepted_tokens");
  check_decode_contents(host, true);
}

}  // namespace fkda::gpu
