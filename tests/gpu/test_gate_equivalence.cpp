// SPDX-License-Identifier: MIT
// The unbounded-gate kernels (any-decay chunk products, docs/NUMERICS.md)
// on decays the bounded kernels also take: a bounded problem's log-decays,
// computed on the host and passed as f32 g to a LOG_DECAY plan, must meet
// the bounded targets against the fp64 recurrence of the bounded problem,
// in the prefill and in the decode, on fast and slow decays.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"

namespace {

using namespace fkda_ref;

// lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) of every element, in
// fp64 from the bf16 g, then rounded to f32.
std::vector<float> bounded_log_decays(const Problem& p) {
  std::vector<float> a(p.g.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const int64_t k = int64_t(i) % p.K, h = (int64_t(i) / p.K) % p.H;
    const double x = std::exp(double(p.A_log[size_t(h)])) * (double(from_bf16(p.g[i])) + p.dt_bias[size_t(h * p.K + k)]);
    a[i] = float(double(p.lower_bound) / (1.0 + std::exp(-x)));
  }
  return a;
}

struct Run {
  std::vector<float> out, state;
};

// One fkda_fwd with the log-decays as f32 g on a LOG_DECAY plan (A_log and
// dt_bias absent), initial and final state f32 [N, H, V, K].
Run run_log_decay_prefill(const Problem& p, const std::vector<float>& log_decays) {
  fkda_plan_desc desc = plan_desc(p.H, -5.f, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
  desc.gate_mode = FKDA_GATE_LOG_DECAY;
  const Plan plan(desc);
  DeviceProblem d(p);
  const DeviceBuffer g(log_decays);
  const DeviceBuffer initial(p.initial_state);
  DeviceBuffer final_state(std::vector<float>(size_t(p.state_elems()), NAN));
  Buffers b = d.buffers();
  b.g = g.get();
  b.A_log = nullptr;
  b.dt_bias = nullptr;
  b.initial_state = p.initial_state.empty() ? nullptr : initial.get();
  b.final_state = final_state.get();
  fkda_fwd_args args = make_args(p, b, FKDA_DTYPE_F32);
  args.g.dtype = FKDA_DTYPE_F32;
  args.A_log = FKDA_TENSOR_NONE;
  args.dt_bias = FKDA_TENSOR_NONE;
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &bytes));
  DeviceBuffer workspace(bytes);
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), bytes, nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return {bf16_to_float(d.out.read<uint16_t>()), final_state.read<float>()};
}

// One fkda_decode of p's tokens (batched, a few per sequence) from a pool
// holding p's initial states at slots 0..N-1, as the prefill above.
Run run_log_decay_decode(const Problem& p, const std::vector<float>& log_decays) {
  fkda_plan_desc desc = plan_desc(p.H, -5.f, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
  desc.gate_mode = FKDA_GATE_LOG_DECAY;
  const Plan plan(desc);
  DeviceProblem d(p);
  const DeviceBuffer g(log_decays);
  DeviceBuffer pool(p.initial_state);
  std::vector<int32_t> slots(size_t(p.num_seqs()));
  for (size_t n = 0; n < slots.size(); ++n) slots[n] = int32_t(n);
  const DeviceBuffer indices(slots);
  Buffers b = d.buffers();
  b.g = g.get();
  fkda_decode_args args = make_decode_args(p, b);
  args.g.dtype = FKDA_DTYPE_F32;
  args.A_log = FKDA_TENSOR_NONE;
  args.dt_bias = FKDA_TENSOR_NONE;
  args.state_pool = tensor(pool.get(), FKDA_DTYPE_F32, {p.num_seqs(), p.H, p.V, p.K});
  args.state_indices = tensor(indices.get(), FKDA_DTYPE_I32, {p.num_seqs()});
  FKDA_REQUIRE(fkda_decode(plan.get(), &args, nullptr, 0, nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return {bf16_to_float(d.out.read<uint16_t>()), pool.read<float>()};
}

bool all_finite(const std::vector<float>& x) {
  for (float v : x)
    if (!std::isfinite(v)) return false;
  return true;
}

}  // namespace

TEST_CASE("log-decay gate: bounded decays through the any-decay prefill meet the bounded targets", "[gpu][gate]") {
  for (bool slow : {false, true}) {
    ProblemShape shape;
    shape.lengths = {300, 77, 0, 700, 16};
    shape.H = 4;
    if (slow) shape = slow_decay(shape);
    const Problem p = random_problem(shape, slow ? 902 : 901);
    const Reference ref = reference_recurrence(p);
    const Run gpu = run_log_decay_prefill(p, bounded_log_decays(p));
    REQUIRE(all_finite(gpu.out));
    REQUIRE(all_finite(gpu.state));
    const AccuracyTargets targets = accuracy_targets(FKDA_DTYPE_F32, slow);
    const double out_error = rel_l2(gpu.out, ref.out), state_error = rel_l2(gpu.state, ref.final_state);
    std::printf("log-decay prefill (%s decays): out %.3g (target %.3g), state %.3g (target %.3g)\n",
                slow ? "slow" : "fast", out_error, targets.out, state_error, targets.state);
    CHECK(out_error <= targets.out);
    CHECK(state_error <= targets.state);
  }
}

TEST_CASE("log-decay gate: bounded decays through the decode meet the decode targets", "[gpu][gate][decode]") {
  ProblemShape shape = slow_decay(ProblemShape{});
  shape.B = 6;
  shape.T = 3;
  shape.H = 3;
  const Problem p = random_problem(shape, 903);
  const Reference ref = reference_recurrence(p);
  const Run gpu = run_log_decay_decode(p, bounded_log_decays(p));
  REQUIRE(all_finite(gpu.out));
  const double out_error = rel_l2(gpu.out, ref.out), state_error = rel_l2(gpu.state, ref.final_state);
  std::printf("log-decay decode: out %.3g, f32 state %.3g\n", out_error, state_error);
  CHECK(out_error <= 2.0e-3);
  CHECK(state_error <= 1.0e-6);
}
