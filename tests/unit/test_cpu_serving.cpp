// SPDX-License-Identifier: MIT
// The serving paths of the CPU backend through the public API: decode on a
// state pool, speculative slot tables, prefill by slot, checkpoints and
// padding. Every test runs on slow-decay inputs (a lost or misplaced state
// shows), compares with the fp64 recurrence or with an equivalent call bit
// for bit, checks that nothing outside the written slots and rows changed,
// and shows its check failing on a deliberately wrong variant.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"
#include "serving_support.h"

namespace {

using namespace serving;

// Accuracy targets, relative L2 against the fp64 recurrence.
constexpr double kDecodeOut = 2.0e-3;
constexpr double kDecodeStateF32 = 1.0e-6;
constexpr double kStateBf16 = 2.0e-3;
constexpr double kPrefillOut = 3.0e-3;
constexpr double kPrefillStateF32 = 1.0e-3;

Problem slow_problem(ProblemShape shape, uint64_t seed, bool with_initial_state = false) {
  shape.H = 2;
  shape = slow_decay(shape);
  shape.with_initial_state = with_initial_state;
  return random_problem(shape, seed);
}

// Token t of every batch row: one decode step of a batched problem.
Problem step(const Problem& p, int64_t t) {
  Problem one = token_range(p, 0, t, t + 1);
  one.B = p.B;
  one.q.clear(), one.k.clear(), one.v.clear(), one.g.clear(), one.beta.clear();
  for (int64_t b = 0; b < p.B; ++b) {
    const Problem row = token_range(p, b, t, t + 1);
    one.q.insert(one.q.end(), row.q.begin(), row.q.end());
    one.k.insert(one.k.end(), row.k.begin(), row.k.end());
    one.v.insert(one.v.end(), row.v.begin(), row.v.end());
    one.g.insert(one.g.end(), row.g.begin(), row.g.end());
    one.beta.insert(one.beta.end(), row.beta.begin(), row.beta.end());
  }
  return one;
}

std::vector<uint16_t> poisoned_out(const Problem& p) { return std::vector<uint16_t>(size_t(p.B * p.T * p.H * p.V), kPoisonBf16); }

Buffers buffers_of(Problem& p, std::vector<uint16_t>& out) { return host_buffers(p, out.data()); }

// fkda_decode of p on the pool; cu_seqlens as i32, the runtimes' form.
std::vector<uint16_t> run_decode(const CpuPlan& plan, Problem p, Pool& pool, fkda_tensor indices,
                                 fkda_tensor accepted = FKDA_TENSOR_NONE) {
  std::vector<uint16_t> out = poisoned_out(p);
  fkda_decode_args args = make_decode_args(p, buffers_of(p, out));
  std::vector<int32_t> cu32(p.cu_seqlens.begin(), p.cu_seqlens.end());
  if (!cu32.empty()) args.cu_seqlens = tensor(cu32.data(), FKDA_DTYPE_I32, {int64_t(cu32.size())});
  args.state_pool = pool.tensor();
  args.state_indices = indices;
  args.num_accepted_tokens = accepted;
  FKDA_REQUIRE(plan.decode(args));
  return out;
}

// The extra serving arguments of a prefill; absent ones stay absent.
struct PrefillExtras {
  fkda_tensor state_indices = FKDA_TENSOR_NONE;
  fkda_tensor has_initial_state = FKDA_TENSOR_NONE;
  fkda_tensor checkpoint_offsets = FKDA_TENSOR_NONE;
  fkda_tensor checkpoints = FKDA_TENSOR_NONE;
  fkda_tensor checkpoint_slots = FKDA_TENSOR_NONE;
};

// fkda_fwd of p: on the pool when one is given, else from and into the
// contiguous states (in the plan's dtype, V-first).
std::vector<uint16_t> run_prefill(const CpuPlan& plan, Problem p, Pool* pool, const PrefillExtras& extras,
                                  void* initial_state = nullptr, void* final_state = nullptr,
                                  fkda_dtype state_dtype = FKDA_DTYPE_F32) {
  std::vector<uint16_t> out = poisoned_out(p);
  Buffers b = buffers_of(p, out);
  b.initial_state = initial_state;
  b.final_state = final_state;
  fkda_fwd_args args = make_args(p, b, state_dtype);
  if (pool != nullptr) args.state_pool = pool->tensor();
  args.state_indices = extras.state_indices;
  args.has_initial_state = extras.has_initial_state;
  args.checkpoint_offsets = extras.checkpoint_offsets;
  args.checkpoints = extras.checkpoints;
  args.checkpoint_slots = extras.checkpoint_slots;
  FKDA_REQUIRE(plan.fwd(args));
  return out;
}

// One sequence's [H, V, K] block of an [N, H, V, K] array.
template <typename T>
std::vector<T> block(const std::vector<T>& all, int64_t n, int64_t H) {
  const size_t size = size_t(H * kHeadState);
  return std::vector<T>(all.begin() + std::ptrdiff_t(n * size), all.begin() + std::ptrdiff_t((n + 1) * size));
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

double state_tolerance(fkda_dtype dtype, double f32_tolerance) {
  return dtype == FKDA_DTYPE_BF16 ? kStateBf16 : f32_tolerance;
}

// One fkda_decode of p from and into pool slots ([N] indices), and the fp64
// recurrence from the same states.
struct DecodeRun {
  std::vector<uint16_t> out;
  Problem as_run;  // p starting from the pool's states
  Reference ref;
  std::vector<float> states;       // the slots of the sequences with tokens, after the call
  std::vector<float> states_before;
  std::vector<double> expected;    // their fp64 final states

  double out_error() const { return rel_l2(bf16_to_float(out), ref.out); }
  double state_error() const { return rel_l2(states, expected); }
};

DecodeRun decode_against_reference(const CpuPlan& plan, const Problem& p, Pool& pool, std::vector<int32_t> slots) {
  const Pool before = pool;
  DecodeRun run;
  run.out = run_decode(plan, p, pool, tensor(slots.data(), FKDA_DTYPE_I32, {int64_t(slots.size())}));
  run.as_run = p;
  const std::vector<int64_t> slot_list(slots.begin(), slots.end());
  run.as_run.initial_state = before.states(slot_list, FKDA_NULL_SLOT_NEGATIVE);
  run.ref = reference_recurrence(run.as_run);
  for (int64_t n = 0; n < p.num_seqs(); ++n) {
    if (p.cu_seqlens[size_t(n) + 1] == p.cu_seqlens[size_t(n)]) continue;  // untouched
    const std::vector<float> got = pool.state(slots[size_t(n)]), old = before.state(slots[size_t(n)]);
    const std::vector<double> want = block(run.ref.final_state, n, p.H);
    run.states.insert(run.states.end(), got.begin(), got.end());
    run.states_before.insert(run.states_before.end(), old.begin(), old.end());
    run.expected.insert(run.expected.end(), want.begin(), want.end());
  }
  return run;
}

PlanOptions plan_options(fkda_dtype state_dtype, const Problem& p) {
  PlanOptions o;
  o.state_dtype = state_dtype;
  o.gate_mode = p.gate_mode;
  o.beta_mode = p.beta_mode;
  return o;
}

}  // namespace

TEST_CASE("CPU decode: 0 to 16 tokens per sequence against the fp64 recurrence", "[cpu][decode]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
      DYNAMIC_SECTION((dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32") << " pool, layout " << (layout == FKDA_STATE_LAYOUT_KV ? "KV" : "VK")) {
        ProblemShape shape;
        shape.lengths = {1, 4, 16, 0, 7};
        const Problem p = slow_problem(shape, 11);
        CpuPlan plan(p.H, {dtype, layout});
        Pool pool(8, p.H, dtype, 5, layout);
        const Pool before = pool;
        const DecodeRun run = decode_against_reference(plan, p, pool, {6, 0, 3, 2, 1});
        const double tolerance = state_tolerance(dtype, kDecodeStateF32);
        INFO("out rel L2 " << run.out_error() << ", state rel L2 " << run.state_error());
        CHECK(run.out_error() <= kDecodeOut);
        CHECK(run.state_error() <= tolerance);
        CHECK(inspect_rows(run.out, p.H, {}).poisoned == 0);
        // Sequence 3 is empty and its slot 2 untouched.
        CHECK(bytes_changed_outside(before, pool, {6, 0, 3, 1}) == 0);

        Problem from_zeros = p;
        from_zeros.initial_state.clear();
        require_mutation_caught("decode ignoring the pool's states",
                                rel_l2(bf16_to_float(run.out), reference_recurrence(from_zeros).out), kDecodeOut);
        require_mutation_caught("decode not writing the state back", rel_l2(run.states_before, run.expected),
                                tolerance);
      }
    }
  }
}

TEST_CASE("CPU decode: every gate and beta mode against the fp64 recurrence", "[cpu][decode][gate]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {1, 4, 16, 0, 7};
  shape.with_initial_state = false;  // the pool's states are the initial states
  std::vector<GateVariant> cases = gate_variants(shape, 51);
  const Problem realistic = random_problem(realistic_softplus(shape), 52);
  // Log-decays of -1e4, 0 and -inf by channel; sequences 2 and 4 forget everything.
  cases.push_back({"log-decay bf16 g: -1e4, 0, -inf, forgetting", with_edge_log_decays(as_log_decay(realistic, false), 2, 4)});
  cases.push_back({"log-decay f32 g: -1e4, 0, -inf, forgetting", with_edge_log_decays(as_log_decay(realistic, true), 2, 4)});
  for (const GateVariant& c : cases) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      INFO(c.name << ", " << (dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32") << " pool");
      const CpuPlan plan(c.p.H, plan_options(dtype, c.p));
      Pool pool(8, c.p.H, dtype, 7);
      const DecodeRun run = decode_against_reference(plan, c.p, pool, {6, 0, 3, 2, 1});
      std::printf("CPU decode %-44s %s pool: out %.3e  state %.3e\n", c.name.c_str(),
                  dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32 ", run.out_error(), run.state_error());
      std::fflush(stdout);
      CHECK(run.out_error() <= kDecodeOut);
      CHECK(run.state_error() <= state_tolerance(dtype, kDecodeStateF32));
      CHECK(inspect_rows(run.out, c.p.H, {}).poisoned == 0);
    }
  }

  // The same comparison against the problem read the wrong way.
  struct Misreading {
    const char* name;
    Problem p;
    int32_t read_gate_mode, read_beta_mode;
  };
  const Misreading misreadings[] = {
      {"softplus decode read as the bounded gate", realistic, FKDA_GATE_BOUNDED, FKDA_BETA_LOGITS},
      {"probabilities read as logits", as_probabilities(realistic, true), FKDA_GATE_SOFTPLUS, FKDA_BETA_LOGITS}};
  for (const Misreading& m : misreadings) {
    const CpuPlan plan(m.p.H, plan_options(FKDA_DTYPE_F32, m.p));
    Pool pool(8, m.p.H, FKDA_DTYPE_F32, 7);
    const DecodeRun run = decode_against_reference(plan, m.p, pool, {6, 0, 3, 2, 1});
    Problem misread = run.as_run;
    misread.gate_mode = m.read_gate_mode;
    misread.beta_mode = m.read_beta_mode;
    require_mutation_caught(m.name, rel_l2(bf16_to_float(run.out), reference_recurrence(misread).out), kDecodeOut);
  }
}

TEST_CASE("CPU decode: five one-token steps through the pool equal one prefill of the five tokens", "[cpu][decode]") {
  ProblemShape shape;
  shape.B = 3;
  shape.T = 5;
  const Problem p = slow_problem(shape, 21);
  CpuPlan plan(p.H);
  Pool pool(6, p.H, FKDA_DTYPE_F32, 8);
  const Pool before = pool;
  std::vector<int64_t> slots = {2, 5, 0};
  std::vector<float> chained_out(size_t(p.B * p.T * p.H * p.V));
  for (int64_t t = 0; t < p.T; ++t) {
    const std::vector<float> out = bf16_to_float(run_decode(plan, step(p, t), pool, tensor(slots.data(), FKDA_DTYPE_I64, {3})));
    const size_t row = size_t(p.H * p.V);
    for (int64_t b = 0; b < p.B; ++b)
      std::copy(out.begin() + std::ptrdiff_t(b * row), out.begin() + std::ptrdiff_t((b + 1) * row),
                chained_out.begin() + std::ptrdiff_t((b * p.T + t) * row));
  }
  const std::vector<float> chained_state = pool.states(slots, FKDA_NULL_SLOT_NEGATIVE);

  Problem as_run = p;
  as_run.initial_state = before.states(slots, FKDA_NULL_SLOT_NEGATIVE);
  const Reference ref = reference_recurrence(as_run, {4});
  const double out_error = rel_l2(chained_out, ref.out), state_error = rel_l2(chained_state, ref.final_state);
  INFO("out rel L2 " << out_error << ", state rel L2 " << state_error);
  CHECK(out_error <= kDecodeOut);
  CHECK(state_error <= kDecodeStateF32);
  CHECK(bytes_changed_outside(before, pool, {2, 5, 0}) == 0);

  Pool prefill_pool = before;
  PrefillExtras extras;
  extras.state_indices = tensor(slots.data(), FKDA_DTYPE_I64, {3});
  const std::vector<float> prefill_out = bf16_to_float(run_prefill(plan, p, &prefill_pool, extras));
  const double versus_prefill_out = rel_l2(chained_out, widen(prefill_out));
  const double versus_prefill_state = rel_l2(chained_state, widen(prefill_pool.states(slots, FKDA_NULL_SLOT_NEGATIVE)));
  INFO("decode vs prefill: out " << versus_prefill_out << ", state " << versus_prefill_state);
  CHECK(versus_prefill_out <= kPrefillOut);
  CHECK(versus_prefill_state <= kPrefillStateF32);

  require_mutation_caught("a chain that loses one step's state", rel_l2(chained_state, ref.states_after[0]),
                          kDecodeStateF32);
}

TEST_CASE("CPU decode: a speculative step with a slot table equals one-token steps column by column", "[cpu][decode][spec]") {
  ProblemShape shape;
  shape.lengths = {4, 2, 3};
  const Problem p = slow_problem(shape, 31);
  CpuPlan plan(p.H);
  Pool pool(16, p.H, FKDA_DTYPE_F32, 9);
  const Pool before = pool;
  const int64_t W = 4;
  std::vector<int32_t> table = {1, 2, -1, 3, /**/ 4, 5, 6, 7, /**/ 8, 9, 10, 11};
  std::vector<int64_t> accepted = {1, 3, 2};
  const std::vector<uint16_t> out = run_decode(plan, p, pool, tensor(table.data(), FKDA_DTYPE_I32, {3, W}),
                                               tensor(accepted.data(), FKDA_DTYPE_I64, {3}));
  CHECK(inspect_rows(out, p.H, {}).poisoned == 0);
  // Written: the columns of each sequence's tokens, null ones excepted; slot 6 is only read.
  CHECK(bytes_changed_outside(before, pool, {1, 2, 3, 4, 5, 8, 9, 10}) == 0);

  std::vector<int64_t> starts;
  for (int64_t n = 0; n < 3; ++n) starts.push_back(table[size_t(n * W + accepted[size_t(n)] - 1)]);
  Problem as_run = p;
  as_run.initial_state = before.states(starts, FKDA_NULL_SLOT_NEGATIVE);
  const Reference ref = reference_recurrence(as_run, {1, 2, 3, 4});

  size_t compared = 0, differing = 0;
  double worst_error = 0, neighbour_error = 1e300;
  for (int64_t n = 0; n < 3; ++n) {
    const int64_t begin = p.cu_seqlens[size_t(n)], length = p.cu_seqlens[size_t(n) + 1] - begin;
    Pool single = before;
    std::vector<int64_t> start = {starts[size_t(n)]};
    std::vector<std::vector<float>> single_states;
    for (int64_t t = 0; t < length; ++t) {
      const std::vector<uint16_t> single_out =
          run_decode(plan, token_range(p, 0, begin + t, begin + t + 1), single, tensor(start.data(), FKDA_DTYPE_I64, {1}));
      differing += token_rows(out, p.H, {begin + t}) != single_out;
      single_states.push_back(single.state(start[0]));
    }
    for (int64_t t = 0; t < length; ++t) {
      const int64_t slot = table[size_t(n * W + t)];
      if (slot < 0) continue;
      const std::vector<float> column = pool.state(slot);
      ++compared;
      differing += !same_bits(column, single_states[size_t(t)]);
      worst_error = std::max(worst_error, rel_l2(column, block(ref.states_after[size_t(t)], n, p.H)));
      if (t + 1 < length) neighbour_error = std::min(neighbour_error, rel_l2(column, widen(single_states[size_t(t) + 1])));
    }
  }
  INFO("worst column state rel L2 vs fp64 " << worst_error);
  CHECK(compared == 8);
  CHECK(differing == 0);
  CHECK(worst_error <= kDecodeStateF32);
  require_mutation_caught("a table shifted by one column", neighbour_error, kDecodeStateF32);
}

TEST_CASE("CPU prefill: states in pool slots equal contiguous states bit for bit", "[cpu][pool]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    DYNAMIC_SECTION((dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32") << " pool") {
      ProblemShape shape;
      shape.lengths = {40, 0, 17, 64, 5};
      const Problem p = slow_problem(shape, 41);
      CpuPlan plan(p.H, {dtype});
      Pool pool(8, p.H, dtype, 12);
      const Pool before = pool;
      std::vector<int32_t> slots = {4, 1, 7, 0, 2};
      std::vector<uint8_t> has_initial = {1, 1, 0, 1, 1};
      PrefillExtras extras;
      extras.state_indices = tensor(slots.data(), FKDA_DTYPE_I32, {5});
      extras.has_initial_state = tensor(has_initial.data(), FKDA_DTYPE_BOOL, {5});
      const std::vector<uint16_t> pool_out = run_prefill(plan, p, &pool, extras);

      const std::vector<int64_t> slot_list(slots.begin(), slots.end());
      States initial(dtype, before.states(slot_list, FKDA_NULL_SLOT_NEGATIVE));
      States final_state(dtype, std::vector<float>(size_t(5 * p.H * kHeadState), -1.f));
      PrefillExtras contiguous;
      contiguous.has_initial_state = extras.has_initial_state;
      const std::vector<uint16_t> contiguous_out =
          run_prefill(plan, p, nullptr, contiguous, initial.data(), final_state.data(), dtype);
      CHECK(pool_out == contiguous_out);
      CHECK(same_bits(pool.states(slot_list, FKDA_NULL_SLOT_NEGATIVE), final_state.values()));
      CHECK(bytes_changed_outside(before, pool, {4, 1, 7, 0, 2}) == 0);

      Problem as_run = p;
      as_run.initial_state = initial.values();
      std::fill(as_run.initial_state.begin() + 2 * p.H * kHeadState, as_run.initial_state.begin() + 3 * p.H * kHeadState, 0.f);
      const Reference ref = reference_recurrence(as_run);
      const double out_error = rel_l2(bf16_to_float(pool_out), ref.out);
      const double state_error = rel_l2(pool.states(slot_list, FKDA_NULL_SLOT_NEGATIVE), ref.final_state);
      const double tolerance = state_tolerance(dtype, kPrefillStateF32);
      INFO("out rel L2 " << out_error << ", state rel L2 " << state_error);
      CHECK(out_error <= kPrefillOut);
      CHECK(state_error <= tolerance);

      Problem ignoring_flags = as_run;
      ignoring_flags.initial_state = initial.values();
      const Reference wrong = reference_recurrence(ignoring_flags);
      require_mutation_caught("prefill ignoring has_initial_state",
                              rel_l2(block(pool.states(slot_list, FKDA_NULL_SLOT_NEGATIVE), 2, p.H), block(wrong.final_state, 2, p.H)),
                              tolerance);
    }
  }
}

namespace {

// Checkpoint destinations of the three runtime forms, filled by one call.
struct CheckpointCase {
  const char* name;
  std::vector<int64_t> offsets;  // [N, C]
  int64_t C;
  enum { kTensorF32, kTensorBf16, kSlots } destination;
  std::vector<int32_t> slots;    // [N, C] for kSlots
};

}  // namespace

TEST_CASE("CPU prefill: checkpoints equal the final states of prefills cut at their offsets", "[cpu][checkpoints]") {
  const std::vector<CheckpointCase> cases = {
      {"one interior checkpoint per sequence, [N, 1, H, V, K] f32", {48, 32, 16}, 1, CheckpointCase::kTensorF32, {}},
      {"every 64-token boundary, [N, NT, H, V, K] bf16 with a padded N stride",
       {64, 128, -1, 64, -1, -1, -1, -1, -1}, 3, CheckpointCase::kTensorBf16, {}},
      {"straight into pool slots", {16, 128, -1, 64, 16, -1}, 2, CheckpointCase::kSlots, {3, 5, -1, 6, 1, 0}},
  };
  for (const CheckpointCase& cc : cases) {
    SECTION(cc.name) {
      ProblemShape shape;
      shape.lengths = {130, 64, 20};
      const Problem p = slow_problem(shape, 51, true);
      const int64_t N = 3, C = cc.C, state = p.H * kHeadState;
      CpuPlan plan(p.H);
      Pool pool(8, p.H, FKDA_DTYPE_F32, 14);
      const Pool before = pool;

      std::vector<int64_t> offsets = cc.offsets;
      std::vector<int32_t> slots = cc.slots;
      const int64_t stride_n = C * state + 128;  // padded for the bf16 form
      std::vector<float> f32_checkpoints(size_t(N * C * state), std::numeric_limits<float>::quiet_NaN());
      std::vector<uint16_t> bf16_checkpoints(size_t(N * stride_n), kPoisonBf16);
      PrefillExtras extras;
      extras.checkpoint_offsets = tensor(offsets.data(), FKDA_DTYPE_I64, {N, C});
      if (cc.destination == CheckpointCase::kTensorF32) {
        extras.checkpoints = tensor(f32_checkpoints.data(), FKDA_DTYPE_F32, {N, C, p.H, kD, kD});
      } else if (cc.destination == CheckpointCase::kTensorBf16) {
        extras.checkpoints = tensor(bf16_checkpoints.data(), FKDA_DTYPE_BF16, {N, C, p.H, kD, kD});
        extras.checkpoints.strides[0] = stride_n;
      } else {
        extras.checkpoint_slots = tensor(slots.data(), FKDA_DTYPE_I32, {N, C});
      }
      std::vector<float> initial = p.initial_state, final_state(size_t(N * state));
      run_prefill(plan, p, cc.destination == CheckpointCase::kSlots ? &pool : nullptr, extras, initial.data(),
                  final_state.data());

      const Reference ref = reference_recurrence(p, {16, 48, 32, 64, 128});
      auto fp64_state = [&](int64_t n, int64_t offset) {
        const std::vector<int64_t> counts = {16, 48, 32, 64, 128};
        const size_t c = size_t(std::find(counts.begin(), counts.end(), offset) - counts.begin());
        return block(ref.states_after[c], n, p.H);
      };
      auto stored = [&](int64_t n, int64_t c) {
        if (cc.destination == CheckpointCase::kSlots) return pool.state(slots[size_t(n * C + c)]);
        if (cc.destination == CheckpointCase::kTensorF32) return block(f32_checkpoints, n * C + c, p.H);
        const auto first = bf16_checkpoints.begin() + std::ptrdiff_t(n * stride_n + c * state);
        return bf16_to_float(std::vector<uint16_t>(first, first + std::ptrdiff_t(state)));
      };
      // The prefix of sequence n through fkda_fwd, rounded like the destination.
      auto cut_state = [&](int64_t n, int64_t tokens) {
        const int64_t begin = p.cu_seqlens[size_t(n)];
        std::vector<float> cut_initial = block(p.initial_state, n, p.H), cut_final(static_cast<size_t>(state));
        run_prefill(plan, token_range(p, 0, begin, begin + tokens), nullptr, {}, cut_initial.data(), cut_final.data());
        if (cc.destination == CheckpointCase::kTensorBf16)
          for (float& x : cut_final) x = from_bf16(to_bf16(x));
        return cut_final;
      };

      size_t written = 0, differing = 0;
      double worst_error = 0, shifted_error = 1e300;
      std::set<int64_t> written_slots;
      for (int64_t n = 0; n < N; ++n) {
        const int64_t length = p.cu_seqlens[size_t(n) + 1] - p.cu_seqlens[size_t(n)];
        for (int64_t c = 0; c < C; ++c) {
          const int64_t offset = offsets[size_t(n * C + c)];
          const std::vector<float> got = stored(n, c);
          const bool skipped = offset < 0 || (cc.destination == CheckpointCase::kSlots && slots[size_t(n * C + c)] < 0);
          if (skipped) {
            if (cc.destination != CheckpointCase::kSlots)
              CHECK(std::all_of(got.begin(), got.end(), [](float x) { return std::isnan(x); }));
            continue;
          }
          if (cc.destination == CheckpointCase::kSlots) written_slots.insert(slots[size_t(n * C + c)]);
          ++written;
          differing += !same_bits(got, cut_state(n, offset));
          worst_error = std::max(worst_error, rel_l2(got, fp64_state(n, offset)));
          const int64_t shifted = offset + 16 <= length ? offset + 16 : offset - 16;
          if (shifted >= 16) shifted_error = std::min(shifted_error, rel_l2(got, widen(cut_state(n, shifted))));
        }
      }
      const double tolerance = cc.destination == CheckpointCase::kTensorBf16 ? kStateBf16 : kPrefillStateF32;
      INFO("worst checkpoint rel L2 vs fp64 " << worst_error);
      CHECK(written > 0);
      CHECK(differing == 0);
      CHECK(worst_error <= tolerance);
      CHECK(bytes_changed_outside(before, pool, written_slots) == 0);
      require_mutation_caught("checkpoints taken 16 tokens off", shifted_error, tolerance);
    }
  }
}

TEST_CASE("CPU padding: null slots and zero-length sequences touch nothing", "[cpu][padding]") {
  for (fkda_null_slot_rule rule : {FKDA_NULL_SLOT_NEGATIVE, FKDA_NULL_SLOT_NONPOSITIVE}) {
    const bool nonpositive = rule == FKDA_NULL_SLOT_NONPOSITIVE;
    const int32_t null_index = nonpositive ? 0 : -1;
    DYNAMIC_SECTION("decode, null_slot_rule " << rule) {
      // Sequence 0 is padding; 2 and 3 are the zero-length sequences a CUDA
      // graph appends (a repeated offset) and name real slots.
      ProblemShape shape;
      shape.lengths = {3, 2, 0, 0};
      const Problem p = slow_problem(shape, 61);
      CpuPlan plan(p.H, {FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, rule});
      Pool pool(8, p.H, FKDA_DTYPE_F32, 15);
      const Pool before = pool;
      std::vector<int32_t> slots = {null_index, 4, 5, nonpositive ? -2 : 6};
      const std::vector<uint16_t> out = run_decode(plan, p, pool, tensor(slots.data(), FKDA_DTYPE_I32, {4}));
      const OutputRows rows = inspect_rows(out, p.H, {0, 1, 2});
      CHECK(rows.nonzero_padding == 0);
      CHECK(rows.poisoned == 0);
      CHECK(bytes_changed_outside(before, pool, {4}) == 0);
      // The same checks with one real row or slot taken for padding do bite.
      CHECK(inspect_rows(out, p.H, {0, 1, 2, 3}).nonzero_padding > 0);
      CHECK(bytes_changed_outside(before, pool, {}) > 0);

      Pool alone = before;
      std::vector<int32_t> slot = {4};
      const std::vector<uint16_t> alone_out = run_decode(plan, token_range(p, 0, 3, 5), alone, tensor(slot.data(), FKDA_DTYPE_I32, {1}));
      CHECK(token_rows(out, p.H, {3, 4}) == alone_out);
      CHECK(same_bits(pool.state(4), alone.state(4)));
    }
    DYNAMIC_SECTION("prefill, null_slot_rule " << rule) {
      ProblemShape shape;
      shape.lengths = {20, 33, 0};
      const Problem p = slow_problem(shape, 71);
      CpuPlan plan(p.H, {FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, rule});
      Pool pool(8, p.H, FKDA_DTYPE_F32, 16);
      const Pool before = pool;
      std::vector<int32_t> slots = {null_index, 3, 5};
      // The padding sequence names a checkpoint slot too: it must stay unwritten.
      std::vector<int32_t> offsets = {16, 32, -1};
      std::vector<int32_t> checkpoint_slots = {6, 7, 2};
      PrefillExtras extras;
      extras.state_indices = tensor(slots.data(), FKDA_DTYPE_I32, {3});
      extras.checkpoint_offsets = tensor(offsets.data(), FKDA_DTYPE_I32, {3, 1});
      extras.checkpoint_slots = tensor(checkpoint_slots.data(), FKDA_DTYPE_I32, {3, 1});
      const std::vector<uint16_t> out = run_prefill(plan, p, &pool, extras);
      std::set<int64_t> padded_tokens;
      for (int64_t t = 0; t < 20; ++t) padded_tokens.insert(t);
      const OutputRows rows = inspect_rows(out, p.H, padded_tokens);
      CHECK(rows.nonzero_padding == 0);
      CHECK(rows.poisoned == 0);
      padded_tokens.insert(20);
      CHECK(inspect_rows(out, p.H, padded_tokens).nonzero_padding > 0);
      CHECK(bytes_changed_outside(before, pool, {3, 5}) > 0);  // misses the checkpoint in slot 7
      // Slot 5 belongs to the empty sequence: read and written back unchanged.
      CHECK(bytes_changed_outside(before, pool, {3, 5, 7}) == 0);
      CHECK(same_bits(pool.state(5), before.state(5)));

      Pool alone = before;
      std::vector<int32_t> slot = {3};
      std::vector<int32_t> alone_offsets = {32}, alone_checkpoint = {7};
      PrefillExtras alone_extras;
      alone_extras.state_indices = tensor(slot.data(), FKDA_DTYPE_I32, {1});
      alone_extras.checkpoint_offsets = tensor(alone_offsets.data(), FKDA_DTYPE_I32, {1, 1});
      alone_extras.checkpoint_slots = tensor(alone_checkpoint.data(), FKDA_DTYPE_I32, {1, 1});
      const std::vector<uint16_t> alone_out = run_prefill(plan, token_range(p, 0, 20, 53), &alone, alone_extras);
      std::vector<int64_t> real_tokens;
      for (int64_t t = 20; t < 53; ++t) real_tokens.push_back(t);
      CHECK(token_rows(out, p.H, real_tokens) == alone_out);
      CHECK(same_bits(pool.state(3), alone.state(3)));
      CHECK(same_bits(pool.state(7), alone.state(7)));
    }
  }
}
