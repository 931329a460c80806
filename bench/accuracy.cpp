// SPDX-License-Identifier: MIT
#include "accuracy.h"

#include <cstring>
#include <vector>

#include "bench_support.h"
#include "kda_reference.h"
#include "run_memory.h"

namespace fkda_bench {
namespace {

// Host or device copies of one problem's tensors, as fkda_ref::Buffers.
fkda_ref::Buffers place_problem(RunMemory& memory, const fkda_ref::Problem& p,
                                const std::vector<unsigned char>& initial_state, size_t out_bytes,
                                size_t state_bytes) {
  fkda_ref::Buffers buffers{};
  buffers.q = memory.place(p.q.data(), p.q.size() * 2);
  buffers.k = memory.place(p.k.data(), p.k.size() * 2);
  buffers.v = memory.place(p.v.data(), p.v.size() * 2);
  buffers.g = memory.place(p.g.data(), p.g.size() * 2);
  buffers.beta = memory.place(p.beta.data(), p.beta.size() * 2);
  buffers.A_log = memory.place(p.A_log.data(), p.A_log.size() * 4);
  buffers.dt_bias = memory.place(p.dt_bias.data(), p.dt_bias.size() * 4);
  buffers.initial_state = memory.place(initial_state.data(), initial_state.size());
  if (!p.cu_seqlens.empty())
    buffers.cu_seqlens = memory.place(p.cu_seqlens.data(), p.cu_seqlens.size() * sizeof(int64_t));
  // All-ones bytes are NaN in bf16 and f32: anything left unwritten shows.
  buffers.out = memory.allocate(out_bytes);
  memory.fill(buffers.out, 0xFF, out_bytes);
  buffers.final_state = memory.allocate(state_bytes);
  memory.fill(buffers.final_state, 0xFF, state_bytes);
  return buffers;
}

AccuracyResult run_one(const AccuracyCase& c, fkda_dtype state_dtype, bool on_cpu,
                       float lower_bound, uint64_t seed) {
  lower_bound = c.lower_bound.value_or(lower_bound);
  fkda_ref::ProblemShape shape;
  shape.B = 1;
  shape.T = c.T;
  shape.H = c.H;
  shape.lengths = c.lengths;
  shape.with_initial_state = true;
  shape.lower_bound = lower_bound;
  shape.gate_mean = c.gate_mean;
  shape.gate_std = c.gate_std;
  shape.initial_state_std = c.initial_state_std;
  if (c.softplus) shape = c.extreme ? fkda_ref::extreme_softplus(shape) : fkda_ref::realistic_softplus(shape);
  fkda_ref::Problem p = fkda_ref::random_problem(shape, seed);

  // The library receives a bf16 initial state in that case; the reference
  // starts from exactly those values, so the figure measures the forward
  // pass and not the rounding of an input.
  std::vector<unsigned char> initial_state;
  if (state_dtype == FKDA_DTYPE_BF16) {
    std::vector<uint16_t> bits(p.initial_state.size());
    for (size_t i = 0; i < bits.size(); ++i) {
      bits[i] = fkda_ref::to_bf16(p.initial_state[i]);
      p.initial_state[i] = fkda_ref::from_bf16(bits[i]);
    }
    initial_state.resize(bits.size() * 2);
    std::memcpy(initial_state.data(), bits.data(), initial_state.size());
  } else {
    initial_state.resize(p.initial_state.size() * 4);
    std::memcpy(initial_state.data(), p.initial_state.data(), initial_state.size());
  }
  const fkda_ref::Reference reference = fkda_ref::reference_recurrence(p);

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(p.H);
  desc.state_dtype = state_dtype;
  desc.backend = on_cpu ? FKDA_BACKEND_CPU : FKDA_BACKEND_GPU;
  desc.gate_mode = p.gate_mode;
  if (p.gate_mode == FKDA_GATE_BOUNDED) desc.lower_bound = lower_bound;
  Plan plan(desc);

  const int64_t tokens = p.B * p.T;
  size_t workspace_bytes = 0;
  FKDA_BENCH_FKDA(fkda_plan_workspace_size(plan.get(), tokens, p.num_seqs(), &workspace_bytes));

  const size_t out_bytes = size_t(tokens * p.H * p.V) * 2;
  const size_t state_bytes = size_t(p.state_elems()) * state_dtype_bytes(state_dtype);
  RunMemory memory(!on_cpu);
  const fkda_ref::Buffers buffers = place_problem(memory, p, initial_state, out_bytes, state_bytes);
  const fkda_fwd_args args = fkda_ref::make_args(p, buffers, state_dtype);

  if (on_cpu) {
    std::vector<unsigned char> workspace(workspace_bytes);
    FKDA_BENCH_FKDA(fkda_fwd(plan.get(), &args, workspace.empty() ? nullptr : workspace.data(),
                             workspace_bytes, nullptr));
  } else {
    DeviceBuffer workspace(workspace_bytes);
    FKDA_BENCH_FKDA(fkda_fwd(plan.get(), &args, workspace.get(), workspace_bytes, nullptr));
    FKDA_BENCH_CUDA(cudaDeviceSynchronize());
  }

  const std::vector<float> out =
      widen_to_float(memory.read(buffers.out, out_bytes), FKDA_DTYPE_BF16);
  const std::vector<float> final_state =
      widen_to_float(memory.read(buffers.final_state, state_bytes), state_dtype);

  AccuracyResult result;
  result.id = c.id;
  result.shape = c.shape();
  result.state_dtype = state_dtype;
  result.backend = on_cpu ? "CPU" : "GPU";
  result.out_rel_l2 = fkda_ref::rel_l2(out, reference.out);
  result.state_rel_l2 = fkda_ref::rel_l2(final_state, reference.final_state);
  result.target = accuracy_target(c, state_dtype);
  result.flashkda_figures = c.flashkda_figures;
  result.fla_figures = c.fla_figures;
  return result;
}

}  // namespace

std::vector<AccuracyResult> run_accuracy(const std::vector<AccuracyCase>& cases, bool on_cpu,
                                         float lower_bound, uint64_t seed) {
  std::vector<AccuracyResult> results;
  const auto& all = accuracy_cases();
  for (const AccuracyCase& c : cases) {
    // Each case's inputs depend on the seed and its place in the full list,
    // not on which other cases run.
    uint64_t case_seed = seed + 1;
    for (const auto& known : all) {
      if (known.id == c.id) break;
      ++case_seed;
    }
    for (fkda_dtype state_dtype : {FKDA_DTYPE_BF16, FKDA_DTYPE_F32})
      results.push_back(run_one(c, state_dtype, on_cpu, lower_bound, case_seed));
  }
  return results;
}

}  // namespace fkda_bench
