// SPDX-License-Identifier: MIT
// fkda_transitions and fkda_apply_transitions on the GPU: the transitions of
// every (sequence, head) against the fp64 recurrence from the identity and
// from zeros (gate modes, layouts, windows and short segments), and the
// context-parallel use of both: a sequence cut into pieces, each piece's
// transition computed alone, folded into the initial state and compared with
// the fp64 final state of the whole sequence (and shown to fail in the wrong
// order). Outputs are poisoned first and checked fully written.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"
#include "prefill_harness.h"

namespace {

using namespace fkda_ref;

constexpr int64_t kMatrix = 128 * 128;

struct GpuTransitions {
  std::vector<float> m, e;
};

fkda_plan_desc desc_of(const Problem& p, fkda_state_layout layout, fkda_dtype state_dtype = FKDA_DTYPE_F32) {
  fkda_plan_desc desc = plan_desc(p.H, p.gate_mode == FKDA_GATE_BOUNDED ? p.lower_bound : -5.f, state_dtype, layout);
  desc.gate_mode = p.gate_mode;
  desc.beta_mode = p.beta_mode;
  return desc;
}

GpuTransitions gpu_transitions(const Problem& p, fkda_state_layout layout) {
  const Plan plan(desc_of(p, layout));
  DeviceProblem device(p);
  const size_t elements = size_t(p.num_seqs() * p.H * kMatrix);
  DeviceBuffer m(std::vector<float>(elements, std::nanf(""))), e(std::vector<float>(elements, std::nanf("")));
  const fkda_transition_args args = make_transition_args(p, device.buffers(), m.get(), e.get());
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_transitions_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &bytes));
  DeviceBuffer workspace(bytes);
  FKDA_REQUIRE(fkda_transitions(plan.get(), &args, workspace.get(), bytes, nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  GpuTransitions t{m.read<float>(), e.read<float>()};
  if (layout == FKDA_STATE_LAYOUT_KV) {  // back to V-first, as the reference holds them
    for (std::vector<float>* x : {&t.m, &t.e}) {
      std::vector<float> vk(x->size());
      for (size_t b = 0; b < x->size(); b += kMatrix)
        for (int64_t r = 0; r < 128; ++r)
          for (int64_t c = 0; c < 128; ++c) vk[b + size_t(r * 128 + c)] = (*x)[b + size_t(c * 128 + r)];
      *x = vk;
    }
  }
  return t;
}

size_t count_nan(const std::vector<float>& x) {
  return size_t(std::count_if(x.begin(), x.end(), [](float v) { return std::isnan(v); }));
}

void check_transitions(const std::string& name, const Problem& p, fkda_state_layout layout) {
  INFO(name);
  const GpuTransitions t = gpu_transitions(p, layout);
  const ReferenceTransitions ref = reference_transitions(p);
  const double m_error = rel_l2(t.m, ref.m), e_error = rel_l2(t.e, ref.e);
  std::printf("%-52s M %.3e  E %.3e\n", name.c_str(), m_error, e_error);
  std::fflush(stdout);
  CHECK(count_nan(t.m) == 0);
  CHECK(count_nan(t.e) == 0);
  CHECK(m_error < 2e-3);
  CHECK(e_error < 3e-3);
}

}  // namespace

TEST_CASE("GPU transitions against the fp64 recurrence from the identity and from zeros",
          "[gpu][transitions][sanitize]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {37, 0, 300, 16, 1};
  const Problem bounded = random_problem(slow_decay(shape), 1801);
  const Problem softplus = random_problem(realistic_softplus(shape), 1802);
  for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
    const std::string l = layout == FKDA_STATE_LAYOUT_KV ? " KV" : " VK";
    check_transitions("bounded slow decay" + l, bounded, layout);
    check_transitions("softplus" + l, softplus, layout);
  }
  // The empty sequence (n = 1) is exactly (I, 0).
  const GpuTransitions t = gpu_transitions(bounded, FKDA_STATE_LAYOUT_VK);
  for (int64_t h = 0; h < bounded.H; ++h) {
    const size_t head = size_t((1 * bounded.H + h) * kMatrix);
    bool identity = true, zero = true;
    for (int64_t i = 0; i < kMatrix; ++i) {
      identity = identity && t.m[head + size_t(i)] == (i / 128 == i % 128 ? 1.f : 0.f);
      zero = zero && t.e[head + size_t(i)] == 0.f;
    }
    CHECK(identity);
    CHECK(zero);
  }
  SECTION("short segments and windows compose across their boundaries") {
    const fkda_test::Tuning tuning(-1, 5, -1, 2);
    check_transitions("segments of 2 chunks, windows of 5 slots", bounded, FKDA_STATE_LAYOUT_VK);
  }
}

TEST_CASE("GPU transitions of a sequence's pieces, applied in order, give its final state",
          "[gpu][transitions]") {
  ProblemShape shape;
  shape.H = 2;
  shape.T = 1000;
  const Problem whole = random_problem(slow_decay(shape), 1901);
  const std::vector<int64_t> cuts = {0, 333, 336, 336, 700, 1000};  // pieces of 333, 3, 0, 364, 300 tokens
  const int64_t R = int64_t(cuts.size()) - 1;
  std::vector<float> m, e;
  for (int64_t r = 0; r < R; ++r) {
    const Problem piece = token_range(whole, 0, cuts[size_t(r)], cuts[size_t(r) + 1]);
    const GpuTransitions t = gpu_transitions(piece, FKDA_STATE_LAYOUT_VK);
    m.insert(m.end(), t.m.begin(), t.m.end());
    e.insert(e.end(), t.e.begin(), t.e.end());
  }
  const Reference ref = reference_recurrence(whole);
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    for (bool in_place : {false, true}) {
      for (bool reversed : {false, true}) {
        INFO("dtype " << dtype << " in place " << in_place << " reversed " << reversed);
        std::vector<float> rm = m, re = e;
        if (reversed) {
          for (int64_t r = 0; r < R; ++r) {
            std::copy(m.begin() + (R - 1 - r) * whole.H * kMatrix, m.begin() + (R - r) * whole.H * kMatrix,
                      rm.begin() + r * whole.H * kMatrix);
            std::copy(e.begin() + (R - 1 - r) * whole.H * kMatrix, e.begin() + (R - r) * whole.H * kMatrix,
                      re.begin() + r * whole.H * kMatrix);
          }
        }
        const Plan plan(desc_of(whole, FKDA_STATE_LAYOUT_VK, dtype));
        const std::vector<unsigned char> initial = fkda_test::encode_state(whole.initial_state, dtype, FKDA_STATE_LAYOUT_VK);
        DeviceBuffer dm(rm), de(re), state(initial), final_state(std::vector<unsigned char>(initial.size(), 0xFF));
        fkda_apply_args args = FKDA_APPLY_ARGS_INIT;
        args.transition_m = tensor(dm.get(), FKDA_DTYPE_F32, {R, 1, whole.H, 128, 128});
        args.transition_e = tensor(de.get(), FKDA_DTYPE_F32, {R, 1, whole.H, 128, 128});
        args.initial_state = tensor(state.get(), dtype, {1, whole.H, 128, 128});
        args.final_state = tensor(in_place ? state.get() : final_state.get(), dtype, {1, whole.H, 128, 128});
        FKDA_REQUIRE(fkda_apply_transitions(plan.get(), &args, nullptr, 0, nullptr));
        CUDA_REQUIRE(cudaDeviceSynchronize());
        const std::vector<float> got =
            fkda_test::decode_state((in_place ? state : final_state).read<unsigned char>(), dtype, FKDA_STATE_LAYOUT_VK);
        const double error = rel_l2(got, ref.final_state);
        const double target = accuracy_targets(dtype, true).state;
        std::printf("apply %s%s%s: final state %.3e (target %.1e)\n", dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32",
                    in_place ? " in place" : "", reversed ? " REVERSED (must miss)" : "", error, target);
        std::fflush(stdout);
        if (reversed) {
          CHECK(error > 10 * target);
        } else {
          CHECK(error <= target);
        }
      }
    }
  }
}
