// SPDX-License-Identifier: MIT
#include "serving.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kda_reference.h"
#include "random_fill.h"
#include "run_memory.h"

namespace fkda_bench {
namespace {

constexpr int64_t kHeadDim = 128;
constexpr int64_t kCheckedSeqs = 4;
constexpr float kPoolStateStd = 0.1f;
// Streams of derive_seed beside the input sets' (set + 1, tensor).
constexpr uint64_t kSlotStream = 1u << 20;
constexpr uint64_t kLayoutStream = (1u << 20) + 1;

// One input set: activations and the slot tables of one call, all int32
// as runtimes pass them.
struct ServingSet {
  void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr, *out = nullptr;
  std::vector<int32_t> slots;               // the pool slots this set uses, in call order
  std::vector<int32_t> state_indices;       // [N] or [N, T] (speculative verify)
  std::vector<int32_t> num_accepted;        // [N], speculative verify
  std::vector<int32_t> checkpoint_offsets;  // [N, C], pool prefill
  std::vector<int32_t> checkpoint_slots;    // [N, C]
  void *indices_data = nullptr, *accepted_data = nullptr;
  void *offsets_data = nullptr, *checkpoint_slots_data = nullptr;
};

// Host copies of the first set's activations, for the check.
struct HostActivations {
  std::vector<uint16_t> q, k, v, g, beta;
};

class ServingSetup {
 public:
  ServingSetup(const ServingCase& c, const TimingOptions& options, RunMemory& memory)
      : c_(c), options_(options), memory_(memory) {}

  int64_t tokens() const { return c_.total_tokens(); }
  size_t activation_elems() const { return size_t(tokens()) * size_t(c_.H) * kHeadDim; }
  size_t slot_elems() const { return size_t(c_.H) * kHeadDim * kHeadDim; }
  size_t slot_bytes() const { return slot_elems() * state_dtype_bytes(c_.pool_dtype); }
  bool pool_f32() const { return c_.pool_dtype == FKDA_DTYPE_F32; }

  // Bytes of one input set: activations, plus its slots when the pool grows with the sets.
  size_t set_bytes() const {
    size_t bytes = 5 * activation_elems() * 2 + size_t(tokens()) * size_t(c_.H) * 2;
    if (c_.pool_slots == 0) bytes += size_t(c_.slots_per_call()) * slot_bytes();
    return bytes;
  }

  // Pool slots for `sets` input sets: slot 0 is the reserved null slot.
  int64_t pool_slots(int sets) const {
    return c_.pool_slots > 0 ? c_.pool_slots : 1 + c_.slots_per_call() * sets;
  }

  // The initial state of a slot, as the pool's bytes and as floats.
  std::vector<unsigned char> slot_state_bytes(int64_t slot) const {
    std::vector<unsigned char> bytes(slot_bytes());
    const uint64_t seed = derive_seed(options_.seed, kSlotStream, uint64_t(slot));
    if (pool_f32())
      fill_f32_normal(reinterpret_cast<float*>(bytes.data()), slot_elems(), kPoolStateStd, seed);
    else
      fill_bf16_normal(reinterpret_cast<uint16_t*>(bytes.data()), slot_elems(), kPoolStateStd, seed);
    return bytes;
  }

  void build(int sets) {
    slots_ = pool_slots(sets);
    const int64_t used = c_.slots_per_call() * sets;
    if (slots_ - 1 < used)
      throw BenchError(c_.id + ": a pool of " + std::to_string(slots_) + " slots cannot hold " +
                           std::to_string(used) + " distinct slots",
                       kExitFailure);
    pool_ = memory_.allocate(size_t(slots_) * slot_bytes());
    memory_.fill(pool_, 0, size_t(slots_) * slot_bytes());

    // Slots 1 .. slots-1 in a fixed random order: each set takes the next
    // slots_per_call of them, scattered over the pool.
    std::vector<int32_t> order(size_t(slots_ - 1));
    std::iota(order.begin(), order.end(), 1);
    std::mt19937_64 layout(derive_seed(options_.seed, kLayoutStream, 0));
    std::shuffle(order.begin(), order.end(), layout);

    std::vector<float> A_log(size_t(c_.H)), dt_bias(size_t(c_.H) * kHeadDim);
    fill_f32_uniform(A_log.data(), A_log.size(), 0.f, 1.f, derive_seed(options_.seed, 0, 1));
    fill_f32_uniform(dt_bias.data(), dt_bias.size(), 0.f, 1.f, derive_seed(options_.seed, 0, 2));
    A_log_host_ = A_log;
    dt_bias_host_ = dt_bias;
    A_log_ = memory_.place(A_log.data(), A_log.size() * 4);
    dt_bias_ = memory_.place(dt_bias.data(), dt_bias.size() * 4);
    std::vector<int32_t> cu_seqlens(size_t(c_.N) + 1);
    for (int64_t n = 0; n <= c_.N; ++n) cu_seqlens[size_t(n)] = int32_t(n * c_.tokens_per_seq);
    cu_seqlens_ = memory_.place(cu_seqlens.data(), cu_seqlens.size() * 4);

    std::vector<uint16_t> staging(activation_elems());
    sets_.resize(size_t(sets));
    for (size_t s = 0; s < sets_.size(); ++s) {
      ServingSet& set = sets_[s];
      void** tensors[] = {&set.q, &set.k, &set.v, &set.g};
      std::vector<uint16_t>* copies[] = {&first_.q, &first_.k, &first_.v, &first_.g};
      for (size_t t = 0; t < 4; ++t) {
        fill_bf16_normal(staging.data(), staging.size(), 1.f, derive_seed(options_.seed, s + 1, t));
        *tensors[t] = memory_.place(staging.data(), staging.size() * 2);
        if (s == 0 && keeps_copies()) *copies[t] = staging;
      }
      std::vector<uint16_t> beta(size_t(tokens()) * size_t(c_.H));
      fill_bf16_normal(beta.data(), beta.size(), 1.f, derive_seed(options_.seed, s + 1, 4));
      set.beta = memory_.place(beta.data(), beta.size() * 2);
      if (s == 0 && keeps_copies()) first_.beta = beta;
      // All-ones bytes are NaN in bf16: rows left unwritten show.
      set.out = memory_.allocate(activation_elems() * 2);
      memory_.fill(set.out, 0xFF, activation_elems() * 2);

      const auto begin = order.begin() + int64_t(s) * c_.slots_per_call();
      set.slots.assign(begin, begin + c_.slots_per_call());
      for (int32_t slot : set.slots) {
        const auto state = slot_state_bytes(slot);
        memory_.write(static_cast<unsigned char*>(pool_) + size_t(slot) * slot_bytes(),
                      state.data(), state.size());
      }
      fill_slot_tables(set, layout);
    }
  }

  int64_t slots() const { return slots_; }
  void* pool() const { return pool_; }
  const std::vector<ServingSet>& sets() const { return sets_; }
  const HostActivations& first_set() const { return first_; }
  const std::vector<float>& A_log() const { return A_log_host_; }
  const std::vector<float>& dt_bias() const { return dt_bias_host_; }

  fkda_decode_args decode_args(const ServingSet& set) const {
    fkda_decode_args args = FKDA_DECODE_ARGS_INIT;
    set_common_args(args, set);
    if (c_.kind == ServingKind::kSpecVerify) {
      args.state_indices =
          fkda_ref::tensor(set.indices_data, FKDA_DTYPE_I32, {c_.N, c_.tokens_per_seq});
      args.num_accepted_tokens = fkda_ref::tensor(set.accepted_data, FKDA_DTYPE_I32, {c_.N});
    } else {
      args.state_indices = fkda_ref::tensor(set.indices_data, FKDA_DTYPE_I32, {c_.N});
    }
    return args;
  }

  fkda_fwd_args prefill_args(const ServingSet& set) const {
    fkda_fwd_args args = FKDA_FWD_ARGS_INIT;
    set_common_args(args, set);
    args.state_indices = fkda_ref::tensor(set.indices_data, FKDA_DTYPE_I32, {c_.N});
    const int64_t checkpoints = c_.checkpoints_per_seq();
    if (checkpoints > 0) {
      args.checkpoint_offsets =
          fkda_ref::tensor(set.offsets_data, FKDA_DTYPE_I32, {c_.N, checkpoints});
      args.checkpoint_slots =
          fkda_ref::tensor(set.checkpoint_slots_data, FKDA_DTYPE_I32, {c_.N, checkpoints});
    }
    return args;
  }

 private:
  bool keeps_copies() const { return c_.kind != ServingKind::kPoolPrefill; }

  // The fields fkda_fwd_args and fkda_decode_args share: packed activations,
  // parameters, int32 cu_seqlens and the pool.
  template <class Args>
  void set_common_args(Args& args, const ServingSet& set) const {
    const auto activation = [&](void* data) {
      return fkda_ref::tensor(data, FKDA_DTYPE_BF16, {1, tokens(), c_.H, kHeadDim});
    };
    args.q = activation(set.q);
    args.k = activation(set.k);
    args.v = activation(set.v);
    args.g = activation(set.g);
    args.out = activation(set.out);
    args.beta = fkda_ref::tensor(set.beta, FKDA_DTYPE_BF16, {1, tokens(), c_.H});
    args.A_log = fkda_ref::tensor(A_log_, FKDA_DTYPE_F32, {c_.H});
    args.dt_bias = fkda_ref::tensor(dt_bias_, FKDA_DTYPE_F32, {c_.H, kHeadDim});
    args.cu_seqlens = fkda_ref::tensor(cu_seqlens_, FKDA_DTYPE_I32, {c_.N + 1});
    args.state_pool = fkda_ref::tensor(pool_, c_.pool_dtype, {slots_, c_.H, kHeadDim, kHeadDim});
  }

  void fill_slot_tables(ServingSet& set, std::mt19937_64& layout) {
    const int64_t N = c_.N;
    switch (c_.kind) {
      case ServingKind::kDecode:
        set.state_indices = set.slots;
        break;
      case ServingKind::kSpecVerify: {
        // Row n: the slots of draft positions 0 .. T-1; num_accepted in 1 .. T.
        set.state_indices = set.slots;
        std::uniform_int_distribution<int32_t> accepted(1, int32_t(c_.tokens_per_seq));
        set.num_accepted.resize(size_t(N));
        for (auto& count : set.num_accepted) count = accepted(layout);
        set.accepted_data = memory_.place(set.num_accepted.data(), size_t(N) * 4);
        break;
      }
      case ServingKind::kPoolPrefill: {
        // The first N slots hold the sequences' states, the rest their checkpoints.
        set.state_indices.assign(set.slots.begin(), set.slots.begin() + N);
        const int64_t C = c_.checkpoints_per_seq();
        for (int64_t n = 0; n < N; ++n)
          for (int64_t i = 0; i < C; ++i) {
            set.checkpoint_offsets.push_back(int32_t((i + 1) * c_.checkpoint_every));
            set.checkpoint_slots.push_back(set.slots[size_t(N + n * C + i)]);
          }
        if (C > 0) {
          set.offsets_data =
              memory_.place(set.checkpoint_offsets.data(), set.checkpoint_offsets.size() * 4);
          set.checkpoint_slots_data =
              memory_.place(set.checkpoint_slots.data(), set.checkpoint_slots.size() * 4);
        }
        break;
      }
    }
    set.indices_data = memory_.place(set.state_indices.data(), set.state_indices.size() * 4);
  }

  const ServingCase& c_;
  const TimingOptions& options_;
  RunMemory& memory_;
  int64_t slots_ = 0;
  void* pool_ = nullptr;
  void *A_log_ = nullptr, *dt_bias_ = nullptr, *cu_seqlens_ = nullptr;
  std::vector<float> A_log_host_, dt_bias_host_;
  std::vector<ServingSet> sets_;
  HostActivations first_;
};

// Tokens [begin, begin + count) of a [tokens, H, D] bf16 host tensor.
std::vector<uint16_t> token_rows(const std::vector<uint16_t>& all, int64_t begin, int64_t count,
                                 size_t row_elems) {
  return std::vector<uint16_t>(all.begin() + begin * int64_t(row_elems),
                               all.begin() + (begin + count) * int64_t(row_elems));
}

// The first call's out rows and written slots of the first sequences
// against the fp64 recurrence from the slots' seeded initial states.
void check_first_call(const ServingCase& c, const ServingSetup& setup, const RunMemory& memory,
                      const TimingOptions& options, ServingRun& run) {
  const ServingSet& set = setup.sets().front();
  const HostActivations& host = setup.first_set();
  const int64_t T = c.tokens_per_seq;
  const size_t row_elems = size_t(c.H) * kHeadDim;
  std::vector<float> out, states;
  std::vector<double> expected_out, expected_states;
  run.checked_seqs = std::min(c.N, kCheckedSeqs);
  for (int64_t n = 0; n < run.checked_seqs; ++n) {
    const bool verify = c.kind == ServingKind::kSpecVerify;
    const int32_t start_slot =
        verify ? set.state_indices[size_t(n * T + set.num_accepted[size_t(n)] - 1)]
               : set.state_indices[size_t(n)];
    const auto out_bytes = memory.read(
        static_cast<const unsigned char*>(set.out) + size_t(n * T) * row_elems * 2,
        size_t(T) * row_elems * 2);
    const auto out_values = widen_to_float(out_bytes, FKDA_DTYPE_BF16);
    out.insert(out.end(), out_values.begin(), out_values.end());

    fkda_ref::Problem p;
    p.H = c.H;
    p.A_log = setup.A_log();
    p.dt_bias = setup.dt_bias();
    p.lower_bound = options.lower_bound;
    p.initial_state = widen_to_float(setup.slot_state_bytes(start_slot), c.pool_dtype);
    // Decode writes the state after the last token; verify the state after
    // each token t into column t.
    const int64_t first_written = verify ? 1 : T;
    for (int64_t length = first_written; length <= T; ++length) {
      p.T = length;
      p.q = token_rows(host.q, n * T, length, row_elems);
      p.k = token_rows(host.k, n * T, length, row_elems);
      p.v = token_rows(host.v, n * T, length, row_elems);
      p.g = token_rows(host.g, n * T, length, row_elems);
      p.beta = token_rows(host.beta, n * T, length, size_t(c.H));
      const fkda_ref::Reference reference = fkda_ref::reference_recurrence(p);
      if (length == T) expected_out.insert(expected_out.end(), reference.out.begin(), reference.out.end());
      const int32_t slot = verify ? set.state_indices[size_t(n * T + length - 1)] : start_slot;
      const auto state = widen_to_float(
          memory.read(static_cast<const unsigned char*>(setup.pool()) + size_t(slot) * setup.slot_bytes(),
                      setup.slot_bytes()),
          c.pool_dtype);
      states.insert(states.end(), state.begin(), state.end());
      expected_states.insert(expected_states.end(), reference.final_state.begin(),
                             reference.final_state.end());
    }
  }
  run.out_rel_l2 = fkda_ref::rel_l2(out, expected_out);
  run.state_rel_l2 = fkda_ref::rel_l2(states, expected_states);
}

// Every set that ran wrote finite values to its out rows and its slots.
void check_finite(const ServingCase& c, const ServingSetup& setup, const RunMemory& memory,
                  size_t sets_run) {
  for (size_t s = 0; s < sets_run; ++s) {
    const ServingSet& set = setup.sets()[s];
    if (!all_finite(memory.read(set.out, setup.activation_elems() * 2), false))
      throw BenchError(c.id + ": out of input set " + std::to_string(s) +
                           " holds NaN/inf or unwritten elements",
                       kExitFailure);
    for (int32_t slot : set.slots) {
      const auto state = memory.read(
          static_cast<const unsigned char*>(setup.pool()) + size_t(slot) * setup.slot_bytes(),
          setup.slot_bytes());
      if (!all_finite(state, setup.pool_f32()))
        throw BenchError(c.id + ": state_pool slot " + std::to_string(slot) + " of input set " +
                             std::to_string(s) + " holds NaN/inf",
                         kExitFailure);
    }
  }
}

}  // namespace

ServingRun::ServingRun()
    : out_rel_l2(std::numeric_limits<double>::quiet_NaN()),
      state_rel_l2(std::numeric_limits<double>::quiet_NaN()) {}

bool ServingRun::checked() const { return !std::isnan(out_rel_l2); }

bool ServingRun::within_check() const {
  return !checked() ||
         (out_rel_l2 <= kServingCheckTolerance && state_rel_l2 <= kServingCheckTolerance);
}

ServingRun run_serving_case(const ServingCase& c, const TimingOptions& options,
                            const std::optional<DeviceContext>& device) {
  const auto setup_start = std::chrono::steady_clock::now();
  const bool on_gpu = device.has_value();
  const bool prefill = c.kind == ServingKind::kPoolPrefill;

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(c.H);
  desc.state_dtype = c.pool_dtype;
  desc.backend = on_gpu ? FKDA_BACKEND_GPU : FKDA_BACKEND_CPU;
  desc.lower_bound = options.lower_bound;
  desc.null_slot_rule = FKDA_NULL_SLOT_NONPOSITIVE;  // slot 0 reserved
  Plan plan(desc);

  RunMemory memory(on_gpu);
  ServingSetup setup(c, options, memory);
  ServingRun run;
  run.serving_case = c;
  run.timed = on_gpu;
  size_t workspace_bytes = 0;
  if (prefill)
    FKDA_BENCH_FKDA(fkda_plan_workspace_size(plan.get(), c.total_tokens(), c.N, &workspace_bytes));
  else
    FKDA_BENCH_FKDA(
        fkda_plan_decode_workspace_size(plan.get(), c.total_tokens(), c.N, &workspace_bytes));
  run.timing.workspace_bytes = workspace_bytes;
  run.timing.input_set_bytes = setup.set_bytes();
  const size_t fixed_bytes =
      workspace_bytes + size_t(setup.pool_slots(0)) * setup.slot_bytes();
  run.timing.input_sets =
      on_gpu ? choose_input_sets(setup.set_bytes(), fixed_bytes, *device, c.id) : 1;
  setup.build(run.timing.input_sets);
  run.pool_slots = setup.slots();
  void* workspace = memory.allocate(workspace_bytes);
  if (on_gpu) FKDA_BENCH_CUDA(cudaDeviceSynchronize());
  run.timing.setup_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();

  std::vector<fkda_decode_args> decode_args;
  std::vector<fkda_fwd_args> prefill_args;
  for (const ServingSet& set : setup.sets()) {
    if (prefill)
      prefill_args.push_back(setup.prefill_args(set));
    else
      decode_args.push_back(setup.decode_args(set));
  }
  std::optional<Stream> stream;
  if (on_gpu) stream.emplace();
  cudaStream_t raw_stream = on_gpu ? stream->get() : nullptr;
  const auto call = [&](int i) {
    const size_t set = size_t(i) % setup.sets().size();
    if (prefill)
      FKDA_BENCH_FKDA(
          fkda_fwd(plan.get(), &prefill_args[set], workspace, workspace_bytes, raw_stream));
    else
      FKDA_BENCH_FKDA(
          fkda_decode(plan.get(), &decode_args[set], workspace, workspace_bytes, raw_stream));
  };

  // The first call on the first set is checked before the pool moves on.
  call(0);
  if (on_gpu) FKDA_BENCH_CUDA(cudaStreamSynchronize(raw_stream));
  if (!prefill) check_first_call(c, setup, memory, options, run);

  size_t sets_run = 1;
  if (on_gpu) {
    static_cast<CallTimes&>(run.timing) = time_calls(call, options, raw_stream);
    // time_calls runs calls 0 .. warmup + iters - 1, after call(0) above.
    sets_run = std::min(setup.sets().size(), size_t(std::max(1, options.warmup + options.iters)));
    const double activation_bytes =
        double(setup.activation_elems()) * 2 * 5 + double(c.total_tokens()) * double(c.H) * 2;
    run.timing.bytes_moved = c.state_bytes_moved() + activation_bytes;
    run.timing.gbps = run.timing.bytes_moved / (run.timing.median_ms * 1e-3) / 1e9;
    run.state_gbps = c.state_bytes_moved() / (run.timing.median_ms * 1e-3) / 1e9;
  }
  check_finite(c, setup, memory, sets_run);
  return run;
}

}  // namespace fkda_bench
