// SPDX-License-Identifier: MIT
// Runtimes keep states in a pool and update them in place: final_state may
// be the very buffer initial_state points to. Every block reads its rows of
// a state before it writes them, so the result must be bitwise the one of
// separate buffers and follow the fp64 recurrence, for every V split and
// window size (forced here for windows; gpu_check.sh's vsplit step reruns it
// under each FKDA_VSPLIT, and the sanitizers run it).
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"
#include "prefill_harness.h"

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

}  // namespace

TEST_CASE("the final state may overwrite the initial state in place", "[gpu][state][vsplit][sanitize]") {
  fkda_ref::ProblemShape shape;
  shape.H = 3;
  shape.lengths = {40, 0, 17, 1, 90};
  for (bool slow : {false, true}) {
    const fkda_ref::Problem given = fkda_ref::random_problem(slow ? fkda_ref::slow_decay(shape) : shape, 4242);
    // Windows of 2 slots; and segments of 2 chunks, whose last segment writes
    // the final state while the first may not have read the initial one yet.
    for (int64_t window_slots : {-1, 2, -2}) {
      const bool segments = window_slots == -2;
      const fkda_test::Tuning tuning(-1, segments ? -1 : window_slots,
                                     segments ? FKDA_CHUNK_PARALLEL_ON : FKDA_CHUNK_PARALLEL_OFF, segments ? 2 : -1);
      for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
        for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
          CAPTURE(slow, window_slots, layout, dtype);
          fkda_ref::Problem p = given;
          if (dtype == FKDA_DTYPE_BF16)
            for (float& x : p.initial_state) x = fkda_ref::from_bf16(fkda_ref::to_bf16(x));
          // make_args describes states as contiguous [N, H, V, K]; the KV
          // plan reads the same bytes transposed.
          const std::vector<unsigned char> initial = fkda_test::encode_state(p.initial_state, dtype, layout);

          DeviceBuffer separate_in(initial), separate_out(initial.size());
          const std::vector<uint16_t> out_separate = run(p, dtype, layout, separate_in, &separate_out);
          DeviceBuffer pooled(initial);
          const std::vector<uint16_t> out_in_place = run(p, dtype, layout, pooled, nullptr);

          CHECK(std::count(out_separate.begin(), out_separate.end(), uint16_t(0xFFFF)) == 0);  // all written
          CHECK(out_in_place == out_separate);
          const std::vector<unsigned char> in_place_state = pooled.read<unsigned char>();
          CHECK(in_place_state == separate_out.read<unsigned char>());

          const fkda_ref::Reference ref = fkda_ref::reference_recurrence(p);
          const fkda_ref::AccuracyTargets targets = fkda_ref::accuracy_targets(dtype, slow);
          CHECK(fkda_ref::rel_l2(fkda_ref::bf16_to_float(out_in_place), ref.out) <= targets.out);
          CHECK(fkda_ref::rel_l2(fkda_test::decode_state(in_place_state, dtype, layout), ref.final_state) <=
                targets.state);
        }
      }
    }
  }
}
