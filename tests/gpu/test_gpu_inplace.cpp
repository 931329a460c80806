// Runtimes keep states in a pool and update them in place: final_state may
// be the very buffer initial_state points to. Every block reads its rows of
// a state before it writes them, so the result must be bitwise the one of
// separate buffers, for every V split and window size (run under FKDA_VSPLIT
// and FKDA_WINDOW_SLOTS by gpu_check.sh).
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"

namespace {

using fkda_ref::DeviceBuffer;

// Runs p on the GPU with its initial state in `state`; the final state goes
// to `final_state`, or back into `state` when final_state is null.
std::vector<uint16_t> run(const fkda_ref::Problem& p, fkda_dtype dtype, fkda_state_layout layout, DeviceBuffer& state,
                          DeviceBuffer* final_state) {
  const fkda_ref::Plan plan(fkda_ref::plan_desc(p.H, p.lower_bound, dtype, layout));
  fkda_ref::DeviceProblem device(p);
  fkda_ref::Buffers buffers = device.buffers();
  buffers.initial_state = state.get();
  buffers.final_state = final_state != nullptr ? final_state->get() : state.get();
  const fkda_fwd_args args = fkda_ref::make_args(p, buffers, dtype);
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &bytes));
  DeviceBuffer workspace(bytes);
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), bytes, nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return device.out.read<uint16_t>();
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace

TEST_CASE("the final state may overwrite the initial state in place", "[gpu][state][vsplit][window]") {
  fkda_ref::ProblemShape shape;
  shape.H = 3;
  shape.lengths = {40, 0, 17, 1};
  const fkda_ref::Problem p = fkda_ref::random_problem(shape, 4242);
  for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      CAPTURE(layout, dtype);
      std::vector<float> initial_f32 = p.initial_state;
      std::vector<uint16_t> initial_bf16;
      for (float x : initial_f32) initial_bf16.push_back(fkda_ref::to_bf16(x));
      const bool f32 = dtype == FKDA_DTYPE_F32;

      DeviceBuffer separate_in = f32 ? DeviceBuffer(initial_f32) : DeviceBuffer(initial_bf16);
      DeviceBuffer separate_out(separate_in.bytes());
      const std::vector<uint16_t> out_separate = run(p, dtype, layout, separate_in, &separate_out);

      DeviceBuffer pooled = f32 ? DeviceBuffer(initial_f32) : DeviceBuffer(initial_bf16);
      const std::vector<uint16_t> out_in_place = run(p, dtype, layout, pooled, nullptr);

      CHECK(std::count(out_separate.begin(), out_separate.end(), uint16_t(0xFFFF)) == 0);  // all written
      CHECK(same_bits(out_in_place, out_separate));
      if (f32) {
        CHECK(same_bits(pooled.read<float>(), separate_out.read<float>()));
        CHECK_FALSE(same_bits(pooled.read<float>(), initial_f32));  // the state did move
      } else {
        CHECK(same_bits(pooled.read<uint16_t>(), separate_out.read<uint16_t>()));
        CHECK_FALSE(same_bits(pooled.read<uint16_t>(), initial_bf16));
      }
    }
  }
}
