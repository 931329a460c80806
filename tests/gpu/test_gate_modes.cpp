// SPDX-License-Identifier: MIT
// The gate and beta modes on the GPU (fkda_gate_mode, fkda_beta_mode): the
// softplus gate on Kimi-Linear's parameter distribution with realistic and
// extreme decays, precomputed log-decays in bf16 and f32, beta as
// probabilities, and hand-made edges (decays of 0, -1e4, -inf, a sequence
// that forgets everything), in the prefill and the decode, against the fp64
// recurrence and the CPU backend. Outputs start as NaN and must come back
// finite and fully written.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "flashkda.h"
#include "gpu_support.h"
#include "kda_reference.h"
#include "prefill_harness.h"

namespace {

using namespace fkda_ref;

// GPU against the CPU backend: the same contract, so ulp-level differences
// only; the softplus decays are slow on many channels, so the slow-decay bound.
constexpr double kCpuAgreement = 1.5e-3;
// How far a deliberately wrong reference must be missed.
constexpr double kWideMargin = 10.0;

struct Outcome {
  std::vector<float> out, state;
};

bool all_finite(const std::vector<float>& x) {
  for (float v : x)
    if (!std::isfinite(v)) return false;
  return true;
}

fkda_plan_desc desc_for(const Problem& p, fkda_dtype state_dtype, fkda_backend backend) {
  fkda_plan_desc desc = plan_desc(p.H, -5.f, state_dtype, FKDA_STATE_LAYOUT_VK, backend);
  desc.gate_mode = p.gate_mode;
  desc.beta_mode = p.beta_mode;
  if (p.gate_mode == FKDA_GATE_BOUNDED) desc.lower_bound = p.lower_bound;
  return desc;
}

// f32 [N, H, V, K] states to the state dtype's bytes and back.
std::vector<unsigned char> state_bytes(const std::vector<float>& values, fkda_dtype dtype) {
  std::vector<unsigned char> bytes(values.size() * (dtype == FKDA_DTYPE_BF16 ? 2 : 4));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == FKDA_DTYPE_BF16) {
      const uint16_t bits = to_bf16(values[i]);
      std::memcpy(bytes.data() + 2 * i, &bits, 2);
    } else {
      std::memcpy(bytes.data() + 4 * i, &values[i], 4);
    }
  }
  return bytes;
}
std::vector<float> state_values(const std::vector<unsigned char>& bytes, fkda_dtype dtype) {
  const size_t count = bytes.size() / (dtype == FKDA_DTYPE_BF16 ? 2 : 4);
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    if (dtype == FKDA_DTYPE_BF16) {
      uint16_t bits;
      std::memcpy(&bits, bytes.data() + 2 * i, 2);
      values[i] = from_bf16(bits);
    } else {
      std::memcpy(&values[i], bytes.data() + 4 * i, 4);
    }
  }
  return values;
}

// p's initial state as the state dtype holds it, so that the reference
// starts from exactly what the library reads.
Problem with_state_rounded(Problem p, fkda_dtype dtype) {
  p.initial_state = state_values(state_bytes(p.initial_state, dtype), dtype);
  return p;
}

// One fkda_fwd of p (prefill) with initial and final state, on the GPU or
// the CPU backend, inputs as p holds them (g, beta f32 where p says so;
// A_log, dt_bias absent where empty), out and final state poisoned first.
Outcome run_prefill(const Problem& p, fkda_dtype state_dtype, fkda_backend backend) {
  const Plan plan(desc_for(p, state_dtype, backend));
  const std::vector<uint16_t> out_poison(p.q.size(), 0xFFFF);
  const std::vector<unsigned char> initial = state_bytes(p.initial_state, state_dtype);
  const std::vector<unsigned char> final_poison(initial.size(), 0xFF);
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, p.num_seqs(), &bytes));
  if (backend == FKDA_BACKEND_CPU) {
    std::vector<uint16_t> out = out_poison;
    std::vector<unsigned char> final_state = final_poison, workspace(bytes);
    Buffers b{const_cast<uint16_t*>(p.q.data()), const_cast<uint16_t*>(p.k.data()),
              const_cast<uint16_t*>(p.v.data()),
              p.g_f32.empty() ? static_cast<void*>(const_cast<uint16_t*>(p.g.data()))
                              : static_cast<void*>(const_cast<float*>(p.g_f32.data())),
              p.beta_f32.empty() ? static_cast<void*>(const_cast<uint16_t*>(p.beta.data()))
                                 : static_cast<void*>(const_cast<float*>(p.beta_f32.data())),
              const_cast<float*>(p.A_log.data()), const_cast<float*>(p.dt_bias.data()), out.data()};
    b.initial_state = const_cast<unsigned char*>(initial.data());
    b.final_state = final_state.data();
    b.cu_seqlens = p.cu_seqlens.empty() ? nullptr : const_cast<int64_t*>(p.cu_seqlens.data());
    const fkda_fwd_args args = make_args(p, b, state_dtype);
    FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.data(), bytes, nullptr));
    return {bf16_to_float(out), state_values(final_state, state_dtype)};
  }
  const DeviceBuffer q(p.q), k(p.k), v(p.v), A_log(p.A_log), dt_bias(p.dt_bias), cu(p.cu_seqlens);
  const DeviceBuffer g = p.g_f32.empty() ? DeviceBuffer(p.g) : DeviceBuffer(p.g_f32);
  const DeviceBuffer beta = p.beta_f32.empty() ? DeviceBuffer(p.beta) : DeviceBuffer(p.beta_f32);
  DeviceBuffer out(out_poison), initial_device(initial), final_state(final_poison), workspace(bytes);
  Buffers b{q.get(), k.get(), v.get(), g.get(), beta.get(), A_log.get(), dt_bias.get(), out.get()};
  b.initial_state = initial_device.get();
  b.final_state = final_state.get();
  b.cu_seqlens = p.cu_seqlens.empty() ? nullptr : cu.get();
  const fkda_fwd_args args = make_args(p, b, state_dtype);
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.get(), bytes, nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return {bf16_to_float(out.read<uint16_t>()), state_values(final_state.read<unsigned char>(), state_dtype)};
}

// One fkda_decode of p (batched, B sequences of T tokens) on an f32 pool
// holding p's initial states at slots 0 .. B-1, on the GPU.
Outcome run_decode(const Problem& p) {
  const Plan plan(desc_for(p, FKDA_DTYPE_F32, FKDA_BACKEND_GPU));
  const DeviceBuffer q(p.q), k(p.k), v(p.v), A_log(p.A_log), dt_bias(p.dt_bias);
  const DeviceBuffer g = p.g_f32.empty() ? DeviceBuffer(p.g) : DeviceBuffer(p.g_f32);
  const DeviceBuffer beta = p.beta_f32.empty() ? DeviceBuffer(p.beta) : DeviceBuffer(p.beta_f32);
  DeviceBuffer out(std::vector<uint16_t>(p.q.size(), 0xFFFF)), pool(p.initial_state);
  std::vector<int32_t> slots(size_t(p.num_seqs()));
  for (size_t n = 0; n < slots.size(); ++n) slots[n] = int32_t(n);
  const DeviceBuffer indices(slots);
  const Buffers b{q.get(), k.get(), v.get(), g.get(), beta.get(), A_log.get(), dt_bias.get(), out.get()};
  fkda_decode_args args = make_decode_args(p, b);
  args.state_pool = tensor(pool.get(), FKDA_DTYPE_F32, {p.num_seqs(), p.H, p.V, p.K});
  args.state_indices = tensor(indices.get(), FKDA_DTYPE_I32, {p.num_seqs()});
  FKDA_REQUIRE(fkda_decode(plan.get(), &args, nullptr, 0, nullptr));
  CUDA_REQUIRE(cudaDeviceSynchronize());
  return {bf16_to_float(out.read<uint16_t>()), pool.read<float>()};
}

// GPU and CPU prefill of p: finite, within the long-memory targets of the
// fp64 recurrence, and in agreement with each other.
void check_prefill(const std::string& name, const Problem& input, fkda_dtype state_dtype) {
  const Problem p = with_state_rounded(input, state_dtype);
  const Reference ref = reference_recurrence(p);
  const Outcome gpu = run_prefill(p, state_dtype, FKDA_BACKEND_GPU);
  const Outcome cpu = run_prefill(p, state_dtype, FKDA_BACKEND_CPU);
  INFO(name << (state_dtype == FKDA_DTYPE_F32 ? ", f32 state" : ", bf16 state"));
  REQUIRE(all_finite(gpu.out));
  REQUIRE(all_finite(gpu.state));
  REQUIRE(all_finite(cpu.out));
  const AccuracyTargets targets = accuracy_targets(state_dtype, true);
  const double out_error = rel_l2(gpu.out, ref.out), state_error = rel_l2(gpu.state, ref.final_state);
  std::vector<double> cpu_out(cpu.out.begin(), cpu.out.end()), cpu_state(cpu.state.begin(), cpu.state.end());
  const double out_agreement = rel_l2(gpu.out, cpu_out), state_agreement = rel_l2(gpu.state, cpu_state);
  std::printf("%-46s %s: out %.2e state %.2e (targets %.1e, %.1e); GPU-CPU %.2e, %.2e\n", name.c_str(),
              state_dtype == FKDA_DTYPE_F32 ? "f32 " : "bf16", out_error, state_error, targets.out, targets.state,
              out_agreement, state_agreement);
  CHECK(out_error <= targets.out);
  CHECK(state_error <= targets.state);
  CHECK(out_agreement <= kCpuAgreement);
  CHECK(state_agreement <= kCpuAgreement);
}

ProblemShape accuracy_shape() {
  ProblemShape shape;
  shape.T = 2048;
  shape.H = 4;
  return shape;
}

ProblemShape varlen_shape() {
  ProblemShape shape;
  shape.lengths = {300, 77, 0, 700, 16, 1};
  shape.H = 3;
  return shape;
}

// LOG_DECAY problem with hand-made log-decays per channel: -1e4, exactly 0,
// -inf and moderate ones; sequence 1 forgets everything (-300 on
// every channel of every token).
Problem edge_problem(bool f32) {
  ProblemShape shape;
  shape.lengths = {70, 40, 33};
  shape.H = 2;
  Problem p = as_log_decay(random_problem(realistic_softplus(shape), 77), true);
  const int64_t forgetting_begin = p.cu_seqlens[1], forgetting_end = p.cu_seqlens[2];
  for (size_t i = 0; i < p.g_f32.size(); ++i) {
    const int64_t token = int64_t(i) / (p.H * p.K), k = int64_t(i) % p.K;
    if (token >= forgetting_begin && token < forgetting_end) p.g_f32[i] = -300.f;
    else if (k % 4 == 0) p.g_f32[i] = -1.0e4f;
    else if (k % 4 == 1) p.g_f32[i] = 0.f;
    else if (k % 4 == 2) p.g_f32[i] = -std::numeric_limits<float>::infinity();
  }
  if (!f32) {
    // The same decays as bf16 bits (all of them, -inf too, are bf16 values).
    p.g.resize(p.g_f32.size());
    for (size_t i = 0; i < p.g.size(); ++i) p.g[i] = to_bf16(p.g_f32[i]);
    p.g_f32.clear();
  }
  return p;
}

}  // namespace

TEST_CASE("softplus gate: realistic and extreme decays, prefill", "[gpu][gate]") {
  for (bool extreme : {false, true}) {
    for (const ProblemShape& base : {accuracy_shape(), varlen_shape()}) {
      const ProblemShape shape = extreme ? extreme_softplus(base) : realistic_softplus(base);
      const Problem p = random_problem(shape, extreme ? 31 : 32);
      const std::string name = std::string(extreme ? "softplus extreme " : "softplus realistic ") +
                               (base.lengths.empty() ? "T=2048 H=4" : "varlen H=3");
      for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) check_prefill(name, p, dtype);
    }
  }

  SECTION("mutation: the bounded gate's reference is missed by a wide margin") {
    const Problem p = random_problem(realistic_softplus(accuracy_shape()), 32);
    Problem bounded = p;
    bounded.gate_mode = FKDA_GATE_BOUNDED;
    const Outcome gpu = run_prefill(p, FKDA_DTYPE_F32, FKDA_BACKEND_GPU);
    const double error = rel_l2(gpu.out, reference_recurrence(bounded).out);
    std::printf("softplus output against the bounded gate's reference: %.2e\n", error);
    CHECK(error >= kWideMargin * accuracy_targets(FKDA_DTYPE_F32, true).out);
  }
}

TEST_CASE("softplus and log-decay gates through chunk-parallel prefill", "[gpu][gate][segments]") {
  // The transitions and the segments of any decay, down to total
  // forgetting, within the same targets as the serial path.
  const fkda_test::Tuning segments(-1, -1, FKDA_CHUNK_PARALLEL_ON, 5);
  for (const ProblemShape& base : {accuracy_shape(), varlen_shape()}) {
    const std::string shape_name = base.lengths.empty() ? "T=2048 H=4" : "varlen H=3";
    check_prefill("segments: softplus realistic " + shape_name, random_problem(realistic_softplus(base), 33),
                  FKDA_DTYPE_F32);
    check_prefill("segments: softplus extreme " + shape_name, random_problem(extreme_softplus(base), 34),
                  FKDA_DTYPE_BF16);
  }
  check_prefill("segments: log-decay f32 g", as_log_decay(random_problem(extreme_softplus(varlen_shape()), 42), true),
                FKDA_DTYPE_F32);
}

TEST_CASE("log-decay gate: bf16 and f32 log-decays; beta as probabilities", "[gpu][gate]") {
  const Problem softplus = random_problem(extreme_softplus(varlen_shape()), 41);
  for (bool f32 : {true, false}) {
    check_prefill(std::string("log-decay g ") + (f32 ? "f32" : "bf16") + ", extreme decays",
                  as_log_decay(softplus, f32), FKDA_DTYPE_F32);
    check_prefill(std::string("beta probabilities ") + (f32 ? "f32" : "bf16"), as_probabilities(softplus, f32),
                  FKDA_DTYPE_F32);
  }
  // The same decays as the softplus gate computes them (f32 g): the two
  // outputs differ by the gate's f32 rounding only.
  const Outcome direct = run_prefill(softplus, FKDA_DTYPE_F32, FKDA_BACKEND_GPU);
  const Outcome precomputed = run_prefill(as_log_decay(softplus, true), FKDA_DTYPE_F32, FKDA_BACKEND_GPU);
  std::vector<double> wide(precomputed.out.begin(), precomputed.out.end());
  CHECK(rel_l2(direct.out, wide) <= 1.0e-3);
}

TEST_CASE("unbounded gates: decays of 0, -1e4, -inf and total forgetting", "[gpu][gate]") {
  for (bool f32 : {true, false}) {
    check_prefill(std::string("edges, log-decay g ") + (f32 ? "f32" : "bf16"), edge_problem(f32), FKDA_DTYPE_F32);
  }
}

TEST_CASE("unbounded gates: decode against the fp64 recurrence", "[gpu][gate][decode]") {
  ProblemShape shape;
  shape.B = 5;
  shape.T = 3;
  shape.H = 3;
  for (bool extreme : {false, true}) {
    const Problem softplus = random_problem(extreme ? extreme_softplus(shape) : realistic_softplus(shape), 51);
    for (const Problem& p : {softplus, as_log_decay(softplus, false), as_probabilities(softplus, true)}) {
      const Reference ref = reference_recurrence(p);
      const Outcome gpu = run_decode(p);
      REQUIRE(all_finite(gpu.out));
      const double out_error = rel_l2(gpu.out, ref.out), state_error = rel_l2(gpu.state, ref.final_state);
      std::printf("decode gate %d beta %d %s: out %.2e, f32 pool %.2e\n", p.gate_mode, p.beta_mode,
                  extreme ? "extreme" : "realistic", out_error, state_error);
      CHECK(out_error <= 2.0e-3);
      CHECK(state_error <= 2.0e-6);
    }
  }
}

TEST_CASE("unbounded gates: small cases for compute-sanitizer", "[gpu][gate][sanitize]") {
  ProblemShape shape;
  shape.lengths = {17, 0, 33, 5};
  shape.H = 2;
  const Problem p = random_problem(extreme_softplus(shape), 61);
  for (const Problem& one : {p, as_log_decay(p, true), as_probabilities(p, false)}) {
    const Outcome gpu = run_prefill(one, FKDA_DTYPE_BF16, FKDA_BACKEND_GPU);
    CHECK(all_finite(gpu.out));
  }
  ProblemShape decode_shape;
  decode_shape.B = 3;
  decode_shape.T = 2;
  decode_shape.H = 2;
  CHECK(all_finite(run_decode(random_problem(extreme_softplus(decode_shape), 62)).out));
}
