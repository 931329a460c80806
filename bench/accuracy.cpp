#include "accuracy.h"

#include <cstring>
#include <vector>

#include "bench_support.h"
#include "kda_reference.h"

namespace fkda_bench {
namespace {

// Host or device copies of one problem's tensors, as fkda_ref::Buffers.
class ProblemMemory {
 public:
  ProblemMemory(const fkda_ref::Problem& p, const std::vector<unsigned char>& initial_state,
                size_t out_bytes, size_t state_bytes, bool on_device)
      : on_device_(on_device) {
    buffers_.q = place(p.q.data(), p.q.size() * 2);
    buffers_.k = place(p.k.data(), p.k.size() * 2);
    buffers_.v = place(p.v.data(), p.v.size() * 2);
    buffers_.g = place(p.g.data(), p.g.size() * 2);
    buffers_.beta = place(p.beta.data(), p.beta.size() * 2);
    buffers_.A_log = place(p.A_log.data(), p.A_log.size() * 4);
    buffers_.dt_bias = place(p.dt_bias.data(), p.dt_bias.size() * 4);
    buffers_.initial_state = place(initial_state.data(), initial_state.size());
    if (!p.cu_seqlens.empty())
      buffers_.cu_seqlens = place(p.cu_seqlens.data(), p.cu_seqlens.size() * sizeof(int64_t));
    // All-ones bytes are NaN in bf16 and f32: anything left unwritten shows.
    const std::vector<unsigned char> poison_out(out_bytes, 0xFF), poison_state(state_bytes, 0xFF);
    buffers_.out = place(poison_out.data(), out_bytes);
    buffers_.final_state = place(poison_state.data(), state_bytes);
  }

  const fkda_ref::Buffers& buffers() const { return buffers_; }

  std::vector<unsigned char> read(const void* data, size_t bytes) const {
    std::vector<unsigned char> bytes_out(bytes);
    if (on_device_)
      FKDA_BENCH_CUDA(cudaMemcpy(bytes_out.data(), data, bytes, cudaMemcpyDeviceToHost));
    else
      std::memcpy(bytes_out.data(), data, bytes);
    return bytes_out;
  }

 private:
  void* place(const void* src, size_t bytes) {
    if (on_device_) {
      device_.emplace_back(bytes);
      FKDA_BENCH_CUDA(cudaMemcpy(device_.back().get(), src, bytes, cudaMemcpyHostToDevice));
      return device_.back().get();
    }
    host_.emplace_back(static_cast<const unsigned char*>(src),
                       static_cast<const unsigned char*>(src) + bytes);
    return host_.back().data();
  }

  bool on_device_;
  fkda_ref::Buffers buffers_{};
  // Element addresses stay put when a std::vector of buffers grows by move.
  std::vector<DeviceBuffer> device_;
  std::vector<std::vector<unsigned char>> host_;
};

std::vector<float> widen(const std::vector<unsigned char>& bytes, fkda_dtype dtype) {
  if (dtype == FKDA_DTYPE_F32) {
    std::vector<float> values(bytes.size() / 4);
    std::memcpy(values.data(), bytes.data(), values.size() * 4);
    return values;
  }
  std::vector<uint16_t> bits(bytes.size() / 2);
  std::memcpy(bits.data(), bytes.data(), bits.size() * 2);
  return fkda_ref::bf16_to_float(bits);
}

AccuracyResult run_one(const AccuracyCase& c, fkda_dtype state_dtype, bool on_cpu,
                       float lower_bound, uint64_t seed) {
  fkda_ref::ProblemShape shape;
  shape.B = 1;
  shape.T = c.T;
  shape.H = c.H;
  shape.lengths = c.lengths;
  shape.with_initial_state = true;
  shape.lower_bound = lower_bound;
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
  desc.lower_bound = lower_bound;
  Plan plan(desc);

  const int64_t tokens = p.B * p.T;
  size_t workspace_bytes = 0;
  FKDA_BENCH_FKDA(fkda_plan_workspace_size(plan.get(), tokens, p.num_seqs(), &workspace_bytes));

  const size_t out_bytes = size_t(tokens * p.H * p.V) * 2;
  const size_t state_bytes = size_t(p.state_elems()) * state_dtype_bytes(state_dtype);
  ProblemMemory memory(p, initial_state, out_bytes, state_bytes, !on_cpu);
  const fkda_fwd_args args = fkda_ref::make_args(p, memory.buffers(), state_dtype);

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
      widen(memory.read(memory.buffers().out, out_bytes), FKDA_DTYPE_BF16);
  const std::vector<float> final_state =
      widen(memory.read(memory.buffers().final_state, state_bytes), state_dtype);

  AccuracyResult result;
  result.id = c.id;
  result.shape = c.shape();
  result.state_dtype = state_dtype;
  result.backend = on_cpu ? "CPU" : "GPU";
  result.out_rel_l2 = fkda_ref::rel_l2(out, reference.out);
  result.state_rel_l2 = fkda_ref::rel_l2(final_state, reference.final_state);
  result.target = accuracy_target(state_dtype);
  return result;
}

}  // namespace

std::vector<AccuracyResult> run_accuracy(bool on_cpu, float lower_bound, uint64_t seed) {
  std::vector<AccuracyResult> results;
  uint64_t case_seed = seed;
  for (const AccuracyCase& c : accuracy_cases()) {
    ++case_seed;
    for (fkda_dtype state_dtype : {FKDA_DTYPE_BF16, FKDA_DTYPE_F32})
      results.push_back(run_one(c, state_dtype, on_cpu, lower_bound, case_seed));
  }
  return results;
}

}  // namespace fkda_bench
