// SPDX-License-Identifier: MIT
// Segment transitions (fkda_transitions, fkda_apply_transitions) and the
// chunk-parallel forward pass on the CPU backend, through the public API,
// against the fp64 token-by-token recurrence. Inputs decay slowly (g ~
// N(-6, 1) at lower_bound -5, initial state ~ N(0, 1)) unless a gate
// variant says otherwise, so that a lost state or a misplaced segment shows.
// Each property is also checked to fail on a deliberately broken variant of
// the computation (a wrong composition order, a dropped E, a segment
// boundary off by one token), so that the tolerances cannot hide such bugs.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"
#include "resource_owners.h"
#include "status_checks.h"

namespace {

using namespace fkda_ref;

constexpr int64_t kDim = 128;
constexpr int64_t kHeadElems = kDim * kDim;

float poison() {
  const uint32_t bits = 0x7FC00001u;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

bool all_finite(const std::vector<float>& values) {
  return std::all_of(values.begin(), values.end(), [](float x) { return std::isfinite(x); });
}

// Transposes every [kDim][kDim] matrix of `values` (KV storage <-> V-first).
std::vector<float> transpose_heads(const std::vector<float>& values) {
  std::vector<float> out(values.size());
  for (size_t head = 0; head < values.size() / kHeadElems; ++head)
    for (int64_t r = 0; r < kDim; ++r)
      for (int64_t c = 0; c < kDim; ++c) out[head * kHeadElems + r * kDim + c] = values[head * kHeadElems + c * kDim + r];
  return out;
}

fkda_plan_desc desc_for(const Problem& p, fkda_dtype state_dtype, fkda_state_layout layout,
                        int32_t chunk_parallel = FKDA_CHUNK_PARALLEL_OFF, int64_t segment_chunks = 0) {
  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = int32_t(p.H);
  desc.state_dtype = state_dtype;
  desc.state_layout = layout;
  desc.backend = FKDA_BACKEND_CPU;
  desc.chunk_parallel = chunk_parallel;
  desc.segment_chunks = segment_chunks;
  apply_gate(p, &desc);
  return desc;
}

// M and E of every (sequence, head) of p, V-first (transposed back on KV plans).
struct Transitions {
  std::vector<float> m, e;
};

Transitions run_transitions(Problem& p, fkda_state_layout layout = FKDA_STATE_LAYOUT_VK) {
  const Plan plan(desc_for(p, FKDA_DTYPE_F32, layout));
  const int64_t N = p.num_seqs();
  Transitions t;
  t.m.assign(size_t(N * p.H * kHeadElems), poison());
  t.e.assign(size_t(N * p.H * kHeadElems), poison());
  std::vector<uint16_t> unused_out(1);
  fkda_transition_args args = make_transition_args(p, host_buffers(p, unused_out.data()), t.m.data(), t.e.data());
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_transitions_workspace_size(plan.get(), p.B * p.T, N, &bytes));
  std::vector<float> workspace(bytes / sizeof(float) + 4);
  FKDA_REQUIRE(fkda_transitions(plan.get(), &args, workspace.data(), bytes, nullptr));
  REQUIRE(all_finite(t.m));  // every element written
  REQUIRE(all_finite(t.e));
  if (layout == FKDA_STATE_LAYOUT_KV) {
    t.m = transpose_heads(t.m);
    t.e = transpose_heads(t.e);
  }
  return t;
}

// The state after R transitions [R, N, H, ...] (V-first) applied in order to
// `initial` (V-first f32 values, empty for none), through fkda_apply_transitions
// on a plan of this state dtype and layout; returned V-first in f32.
std::vector<float> run_apply(const Problem& p, int64_t R, int64_t N, const std::vector<float>& m_vk,
                             const std::vector<float>& e_vk, const std::vector<float>& initial, fkda_dtype dtype,
                             fkda_state_layout layout, bool in_place = false) {
  const Plan plan(desc_for(p, dtype, layout));
  std::vector<float> m = layout == FKDA_STATE_LAYOUT_KV ? transpose_heads(m_vk) : m_vk;
  std::vector<float> e = layout == FKDA_STATE_LAYOUT_KV ? transpose_heads(e_vk) : e_vk;
  const std::vector<float> init = layout == FKDA_STATE_LAYOUT_KV ? transpose_heads(initial) : initial;
  const size_t count = size_t(N * p.H * kHeadElems);
  std::vector<float> init_f32 = init, final_f32(count, poison());
  std::vector<uint16_t> init_bf16, final_bf16(count, 0x7FC1);
  for (float x : init) init_bf16.push_back(to_bf16(x));
  const bool bf16 = dtype == FKDA_DTYPE_BF16;
  fkda_apply_args args = FKDA_APPLY_ARGS_INIT;
  args.transition_m = tensor(m.data(), FKDA_DTYPE_F32, {R, N, p.H, kDim, kDim});
  args.transition_e = tensor(e.data(), FKDA_DTYPE_F32, {R, N, p.H, kDim, kDim});
  void* init_data = bf16 ? static_cast<void*>(init_bf16.data()) : init_f32.data();
  if (!initial.empty()) args.initial_state = tensor(init_data, dtype, {N, p.H, kDim, kDim});
  void* final_data = in_place ? init_data : bf16 ? static_cast<void*>(final_bf16.data()) : final_f32.data();
  args.final_state = tensor(final_data, dtype, {N, p.H, kDim, kDim});
  FKDA_REQUIRE(fkda_apply_transitions(plan.get(), &args, nullptr, 0, nullptr));
  std::vector<float> result(count);
  for (size_t i = 0; i < count; ++i) {
    result[i] = bf16 ? from_bf16(static_cast<const uint16_t*>(final_data)[i]) : static_cast<const float*>(final_data)[i];
  }
  REQUIRE(all_finite(result));
  return layout == FKDA_STATE_LAYOUT_KV ? transpose_heads(result) : result;
}

// Problems of one sequence cut into pieces: the pieces as the sequences of a
// varlen problem over the same packed tokens.
Problem cut_into(const Problem& whole, const std::vector<int64_t>& cuts) {
  Problem pieces = whole;
  pieces.cu_seqlens = {0};
  for (int64_t cut : cuts) pieces.cu_seqlens.push_back(cut);
  pieces.cu_seqlens.push_back(whole.T);
  pieces.initial_state.clear();
  return pieces;
}

// V-first state of one sequence (N = 1) from `initial` through the pieces'
// transitions in the order given: what fkda_apply_transitions composes.
std::vector<float> compose(const Problem& whole, const Transitions& pieces, const std::vector<int64_t>& order,
                           const std::vector<float>& initial, bool drop_e = false) {
  const size_t per_piece = size_t(whole.H * kHeadElems);
  std::vector<float> m, e;
  for (int64_t r : order) {
    m.insert(m.end(), pieces.m.begin() + long(r * per_piece), pieces.m.begin() + long((r + 1) * per_piece));
    e.insert(e.end(), pieces.e.begin() + long(r * per_piece), pieces.e.begin() + long((r + 1) * per_piece));
  }
  if (drop_e) std::fill(e.begin(), e.end(), 0.f);
  return run_apply(whole, int64_t(order.size()), 1, m, e, initial, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
}

std::vector<int64_t> in_order(int64_t count) {
  std::vector<int64_t> order(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) order[size_t(i)] = i;
  return order;
}

ProblemShape slow(ProblemShape shape) { return slow_decay(shape); }

}  // namespace

TEST_CASE("transitions match the fp64 recurrence from the identity and from zeros", "[transitions]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {37, 0, 80, 16};
  for (GateVariant& variant : gate_variants(shape, 1700)) {
    for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
      INFO(variant.name << ", layout " << (layout == FKDA_STATE_LAYOUT_KV ? "KV" : "VK"));
      const ReferenceTransitions ref = reference_transitions(variant.p);
      const Transitions t = run_transitions(variant.p, layout);
      CHECK(rel_l2(t.m, ref.m) < 2e-3);
      CHECK(rel_l2(t.e, ref.e) < 3e-3);
      // The empty sequence (n = 1) is the identity map: M = I, E = 0 exactly.
      for (int64_t h = 0; h < variant.p.H; ++h) {
        const size_t head = size_t((1 * variant.p.H + h) * kHeadElems);
        bool identity = true, zero = true;
        for (int64_t i = 0; i < kHeadElems; ++i) {
          identity = identity && t.m[head + size_t(i)] == (i / kDim == i % kDim ? 1.f : 0.f);
          zero = zero && t.e[head + size_t(i)] == 0.f;
        }
        CHECK(identity);
        CHECK(zero);
      }
    }
  }
}

TEST_CASE("transitions of random cuts compose to the whole sequence", "[transitions]") {
  ProblemShape shape;
  shape.H = 2;
  shape.T = 203;
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 4; ++trial) {
    Problem whole = random_problem(slow(shape), 900 + uint64_t(trial));
    // Cuts anywhere, in or between chunks, with empty pieces (repeated cuts)
    // and pieces of one token.
    std::vector<int64_t> cuts;
    std::uniform_int_distribution<int64_t> position(0, whole.T);
    for (int i = 0; i < 5; ++i) cuts.push_back(position(rng));
    cuts.push_back(cuts[0]);
    cuts.push_back(std::min<int64_t>(cuts[1] + 1, whole.T));
    std::sort(cuts.begin(), cuts.end());
    INFO("trial " << trial << ", cuts " << ::Catch::Detail::stringify(cuts));
    Problem pieces = cut_into(whole, cuts);
    const Transitions t = run_transitions(pieces);
    const int64_t count = pieces.num_seqs();
    const Reference ref = reference_recurrence(whole);
    const double target = accuracy_targets(FKDA_DTYPE_F32, true).state;

    SECTION("applied in order to the initial state: the sequence's final state") {
      const std::vector<float> state = compose(whole, t, in_order(count), whole.initial_state);
      CHECK(rel_l2(state, ref.final_state) < target);
      // A broken composition: the same pieces in reverse order.
      std::vector<int64_t> reversed = in_order(count);
      std::reverse(reversed.begin(), reversed.end());
      CHECK(rel_l2(compose(whole, t, reversed, whole.initial_state), ref.final_state) > 10 * target);
      // A broken composition: E dropped (only the initial state carried).
      CHECK(rel_l2(compose(whole, t, in_order(count), whole.initial_state, true), ref.final_state) > 10 * target);
    }
    SECTION("composed: the whole sequence's own transitions") {
      Problem single = whole;
      single.initial_state.clear();
      const Transitions full = run_transitions(single);
      // Applying the pieces to the identity with zero E gives the product of
      // the M's; to zeros with their E's, the composed E.
      std::vector<float> identity(size_t(whole.H * kHeadElems), 0.f);
      for (int64_t h = 0; h < whole.H; ++h)
        for (int64_t i = 0; i < kDim; ++i) identity[size_t(h * kHeadElems + i * kDim + i)] = 1.f;
      CHECK(rel_l2(compose(whole, t, in_order(count), identity, true),
                   std::vector<double>(full.m.begin(), full.m.end())) < 2e-3);
      CHECK(rel_l2(compose(whole, t, in_order(count), {}), std::vector<double>(full.e.begin(), full.e.end())) <
            3e-3);
    }
    SECTION("a boundary off by one token breaks it") {
      // The second piece starts one token late: that token is lost.
      std::vector<int64_t> shifted = cuts;
      const auto inner = std::find_if(shifted.begin(), shifted.end(), [&](int64_t c) { return c > 0 && c < whole.T; });
      REQUIRE(inner != shifted.end());
      Problem skipped = whole;
      // Rebuild the tokens without token *inner: the pieces then join
      // across a missing token, as a boundary off by one would.
      const int64_t lost = *inner;
      auto erase_token = [&](auto& values, int64_t per_token) {
        if (values.empty()) return;
        values.erase(values.begin() + long(lost * whole.H * per_token), values.begin() + long((lost + 1) * whole.H * per_token));
      };
      erase_token(skipped.q, whole.K);
      erase_token(skipped.k, whole.K);
      erase_token(skipped.v, whole.V);
      erase_token(skipped.g, whole.K);
      erase_token(skipped.beta, 1);
      skipped.T = whole.T - 1;
      for (int64_t& c : shifted)
        if (c > lost) --c;
      Problem skipped_pieces = cut_into(skipped, shifted);
      const Transitions broken = run_transitions(skipped_pieces);
      CHECK(rel_l2(compose(skipped, broken, in_order(skipped_pieces.num_seqs()), whole.initial_state),
                   ref.final_state) > 3 * target);
    }
  }
}

TEST_CASE("transitions: total forgetting makes M zero and the initial state irrelevant", "[transitions]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {40, 33, 50};
  Problem p = with_edge_log_decays(as_log_decay(random_problem(slow(shape), 31), true), 0, 1);
  const Transitions t = run_transitions(p);
  const ReferenceTransitions ref = reference_transitions(p);
  for (int64_t n = 0; n < 2; ++n) {
    for (int64_t i = 0; i < p.H * kHeadElems; ++i) CHECK(t.m[size_t(n * p.H * kHeadElems + i)] == 0.f);
  }
  // Sequence 2 keeps only some channels (c % 4 == 1 decays as exp(0)).
  CHECK(rel_l2(t.m, ref.m) < 2e-3);
  CHECK(rel_l2(t.e, ref.e) < 3e-3);
  const std::vector<float> from_initial = run_apply(p, 1, 3, t.m, t.e, p.initial_state, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
  const Reference whole = reference_recurrence(p);
  CHECK(rel_l2(from_initial, whole.final_state) < 1e-3);
}

TEST_CASE("apply_transitions: state dtypes, layouts, in place, none", "[transitions]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {70, 29};
  Problem p = random_problem(slow(shape), 77);
  const Reference ref = reference_recurrence(p);
  // Two pieces per sequence: [0, 21) and the rest, as transitions [2, N, ...].
  // Pieces 0, 1: sequence 0's [0, 21) and [21, 70); 2, 3: sequence 1's first 8 tokens and the rest.
  Problem first = p;
  first.cu_seqlens = {0, 21, 70, 78, 99};
  first.initial_state.clear();
  const Transitions t = run_transitions(first);
  // Reorder [piece] -> [r, n]: r = 0 the first piece of each sequence.
  const size_t per = size_t(p.H * kHeadElems);
  auto take = [&](const std::vector<float>& all, std::vector<int64_t> pieces) {
    std::vector<float> out;
    for (int64_t piece : pieces) out.insert(out.end(), all.begin() + long(piece * per), all.begin() + long((piece + 1) * per));
    return out;
  };
  const std::vector<float> m = take(t.m, {0, 2, 1, 3}), e = take(t.e, {0, 2, 1, 3});
  // A bf16 plan takes the initial state rounded to bf16: so does its reference.
  Problem rounded = p;
  for (float& x : rounded.initial_state) x = from_bf16(to_bf16(x));
  const Reference ref_bf16 = reference_recurrence(rounded);
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
      for (bool in_place : {false, true}) {
        INFO("dtype " << (dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32") << ", layout " << layout << ", in place " << in_place);
        const std::vector<float> state = run_apply(p, 2, 2, m, e, p.initial_state, dtype, layout, in_place);
        const Reference& want = dtype == FKDA_DTYPE_BF16 ? ref_bf16 : ref;
        CHECK(rel_l2(state, want.final_state) < accuracy_targets(dtype, true).state);
      }
    }
  }
  SECTION("R = 0 copies the initial state; no initial state means zeros") {
    const std::vector<float> none;
    const std::vector<float> copied = run_apply(p, 0, 2, none, none, p.initial_state, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_KV);
    CHECK(copied == p.initial_state);
    const std::vector<float> from_zeros = run_apply(p, 2, 2, m, e, {}, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK);
    Problem without = p;
    without.initial_state.clear();
    CHECK(rel_l2(from_zeros, reference_recurrence(without).final_state) < 1e-3);
  }
}

TEST_CASE("transitions and apply: every bad argument is named", "[transitions][validation]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {20, 12};
  Problem p = random_problem(slow(shape), 5);
  const Plan plan(desc_for(p, FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK));
  std::vector<float> m(size_t(2 * p.H * kHeadElems)), e(m.size());
  std::vector<uint16_t> out(1);
  const fkda_transition_args good = make_transition_args(p, host_buffers(p, out.data()), m.data(), e.data());
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_transitions_workspace_size(plan.get(), p.T, 2, &bytes));
  std::vector<float> workspace(bytes / 4 + 4);
  auto call = [&](const fkda_transition_args& args, size_t workspace_bytes) {
    return fkda_transitions(plan.get(), &args, workspace.data(), workspace_bytes, nullptr);
  };
  FKDA_REQUIRE(call(good, bytes));
  fkda_transition_args a = good;
  SECTION("args") {
    expect_invalid(fkda_transitions(plan.get(), nullptr, workspace.data(), bytes, nullptr), "args");
    a.struct_size = 8;
    expect_invalid(call(a, bytes), "args");
  }
  SECTION("k") { a.k.shape[2] = 3; expect_invalid(call(a, bytes), "k"); }
  SECTION("v") { a.v.dtype = FKDA_DTYPE_F32; expect_invalid(call(a, bytes), "v"); }
  SECTION("g") { a.g.shape[1] = 5; expect_invalid(call(a, bytes), "g"); }
  SECTION("beta") { a.beta.rank = 4; expect_invalid(call(a, bytes), "beta"); }
  SECTION("A_log") { a.A_log.shape[0] = 1; expect_invalid(call(a, bytes), "A_log"); }
  SECTION("dt_bias") { a.dt_bias.dtype = FKDA_DTYPE_BF16; expect_invalid(call(a, bytes), "dt_bias"); }
  SECTION("cu_seqlens") {
    p.cu_seqlens[1] = 40;
    expect_invalid(call(a, bytes), "cu_seqlens");
  }
  SECTION("transition_m") { a.transition_m.shape[0] = 1; expect_invalid(call(a, bytes), "transition_m"); }
  SECTION("transition_e") { a.transition_e.strides[3] = 2; expect_invalid(call(a, bytes), "transition_e"); }
  SECTION("transition_e overlapping transition_m") {
    a.transition_e.data = m.data();
    expect_invalid(call(a, bytes), "transition_e");
  }
  SECTION("transitions overlapping an input or the workspace") {
    a.transition_m.data = const_cast<void*>(good.v.data);
    expect_invalid(call(a, bytes), "transition_m");
    a = good;
    a.transition_e.data = static_cast<char*>(const_cast<void*>(good.cu_seqlens.data)) - 64;
    expect_invalid(call(a, bytes), "transition_e");
    a = good;
    expect_invalid(fkda_transitions(plan.get(), &a, e.data(), bytes, nullptr), "workspace");
  }
  SECTION("workspace") {
    check_failure(call(a, bytes - 1), FKDA_ERROR_WORKSPACE_TOO_SMALL, "workspace_bytes");
    expect_invalid(fkda_transitions(plan.get(), &a, nullptr, bytes, nullptr), "workspace");
  }
  SECTION("workspace size") {
    expect_invalid(fkda_plan_transitions_workspace_size(plan.get(), -1, 2, &bytes), "total_tokens");
    expect_invalid(fkda_plan_transitions_workspace_size(plan.get(), 5, -1, &bytes), "num_seqs");
    expect_invalid(fkda_plan_transitions_workspace_size(plan.get(), 5, 1, nullptr), "bytes");
    expect_invalid(fkda_plan_transitions_workspace_size(nullptr, 5, 1, &bytes), "plan");
  }

  std::vector<float> initial(m.size()), final_state(m.size());
  fkda_apply_args apply = FKDA_APPLY_ARGS_INIT;
  apply.transition_m = tensor(m.data(), FKDA_DTYPE_F32, {1, 2, p.H, kDim, kDim});
  apply.transition_e = tensor(e.data(), FKDA_DTYPE_F32, {1, 2, p.H, kDim, kDim});
  apply.initial_state = tensor(initial.data(), FKDA_DTYPE_F32, {2, p.H, kDim, kDim});
  apply.final_state = tensor(final_state.data(), FKDA_DTYPE_F32, {2, p.H, kDim, kDim});
  auto run = [&](const fkda_apply_args& args) { return fkda_apply_transitions(plan.get(), &args, nullptr, 0, nullptr); };
  FKDA_REQUIRE(run(apply));
  SECTION("apply: args") {
    expect_invalid(fkda_apply_transitions(plan.get(), nullptr, nullptr, 0, nullptr), "args");
    apply.struct_size = 4;
    expect_invalid(run(apply), "args");
  }
  SECTION("apply: transition_m") { apply.transition_m.shape[3] = 64; expect_invalid(run(apply), "transition_m"); }
  SECTION("apply: transition_e") { apply.transition_e.shape[0] = 2; expect_invalid(run(apply), "transition_e"); }
  SECTION("apply: initial_state") { apply.initial_state.dtype = FKDA_DTYPE_BF16; expect_invalid(run(apply), "initial_state"); }
  SECTION("apply: final_state") {
    apply.final_state = FKDA_TENSOR_NONE;
    expect_invalid(run(apply), "final_state");
  }
  SECTION("apply: final_state overlapping") {
    apply.final_state.data = e.data();
    expect_invalid(run(apply), "final_state");
    apply.final_state.data = initial.data() + 1;
    expect_invalid(run(apply), "final_state");
  }
  SECTION("apply: plan") { expect_invalid(fkda_apply_transitions(nullptr, &apply, nullptr, 0, nullptr), "plan"); }
}

// ------------------------------------------------------ chunk-parallel ---

namespace {

struct FwdOptions {
  fkda_dtype state_dtype = FKDA_DTYPE_F32;
  fkda_state_layout layout = FKDA_STATE_LAYOUT_VK;
  int32_t chunk_parallel = FKDA_CHUNK_PARALLEL_OFF;
  int64_t segment_chunks = 0;
  bool pool = false;         // states in a pool by slot, sequence 1 padding, has_initial_state
  bool checkpoints = false;  // every 16 tokens of every sequence
};

struct FwdResult {
  std::vector<float> out, states, checkpoints;  // states: final_state or the whole pool
};

// Checkpoint columns: a state every 16 tokens, enough for the longest sequence.
int64_t checkpoint_columns(const Problem& p) {
  int64_t longest = 0;
  for (int64_t n = 0; n < p.num_seqs(); ++n) {
    const int64_t length = p.cu_seqlens.empty() ? p.T : p.cu_seqlens[size_t(n) + 1] - p.cu_seqlens[size_t(n)];
    longest = std::max(longest, length);
  }
  return std::max<int64_t>(1, longest / 16);
}

FwdResult run_fwd(Problem& p, const FwdOptions& o) {
  const Plan plan(desc_for(p, o.state_dtype, o.layout, o.chunk_parallel, o.segment_chunks));
  const int64_t N = p.num_seqs();
  const bool bf16 = o.state_dtype == FKDA_DTYPE_BF16;
  std::vector<uint16_t> out(size_t(p.B * p.T * p.H * p.V), 0x7FC1);
  const Buffers buffers = host_buffers(p, out.data());
  fkda_fwd_args args = make_args(p, buffers, o.state_dtype);
  const size_t state_count = size_t(N * p.H * kHeadElems);
  const std::vector<float> initial = o.layout == FKDA_STATE_LAYOUT_KV ? transpose_heads(p.initial_state) : p.initial_state;
  // States: [N, H, ...] initial/final, or a pool of N + 2 slots, sequence n in slot N + 1 - n.
  const int64_t slots = N + 2;
  std::vector<float> states_f32(o.pool ? size_t(slots) * p.H * kHeadElems : state_count, poison());
  std::vector<uint16_t> states_bf16(states_f32.size(), 0x7FC1);
  std::vector<float> init_f32(initial);
  std::vector<uint16_t> init_bf16;
  for (float x : initial) init_bf16.push_back(to_bf16(x));
  void* states = bf16 ? static_cast<void*>(states_bf16.data()) : states_f32.data();
  std::vector<int64_t> indices(static_cast<size_t>(N));
  std::vector<uint8_t> has_initial(static_cast<size_t>(N));
  if (o.pool) {
    for (int64_t n = 0; n < N; ++n) {
      indices[size_t(n)] = n == 1 ? -1 : slots - 1 - n;  // sequence 1 is padding
      has_initial[size_t(n)] = n % 3 != 2;               // sequence 2 starts from zeros
      if (n == 1) continue;
      for (size_t i = 0; i < size_t(p.H * kHeadElems); ++i) {
        const size_t to = size_t(indices[size_t(n)] * p.H * kHeadElems) + i, from = size_t(n * p.H * kHeadElems) + i;
        states_f32[to] = init_f32[from];
        states_bf16[to] = init_bf16[from];
      }
    }
    args.state_pool = tensor(states, o.state_dtype, {slots, p.H, kDim, kDim});
    args.state_indices = tensor(indices.data(), FKDA_DTYPE_I64, {N});
    args.has_initial_state = tensor(has_initial.data(), FKDA_DTYPE_BOOL, {N});
  } else {
    args.initial_state = tensor(bf16 ? static_cast<void*>(init_bf16.data()) : init_f32.data(), o.state_dtype,
                                {N, p.H, kDim, kDim});
    args.final_state = tensor(states, o.state_dtype, {N, p.H, kDim, kDim});
  }
  const int64_t C = checkpoint_columns(p);
  std::vector<int64_t> offsets(size_t(N * C), -1);
  std::vector<float> checkpoints(o.checkpoints ? size_t(N * C) * p.H * kHeadElems : 0, poison());
  if (o.checkpoints) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t length = p.cu_seqlens.empty() ? p.T : p.cu_seqlens[size_t(n) + 1] - p.cu_seqlens[size_t(n)];
      for (int64_t c = 0; c < C; ++c)
        if ((c + 1) * 16 <= length) offsets[size_t(n * C + c)] = (c + 1) * 16;
    }
    args.checkpoint_offsets = tensor(offsets.data(), FKDA_DTYPE_I64, {N, C});
    args.checkpoints = tensor(checkpoints.data(), FKDA_DTYPE_F32, {N, C, p.H, kDim, kDim});
  }
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, N, &bytes));
  std::vector<float> workspace(bytes / sizeof(float) + 4);
  FKDA_REQUIRE(fkda_fwd(plan.get(), &args, workspace.data(), bytes, nullptr));
  FwdResult r;
  for (uint16_t bits : out) r.out.push_back(from_bf16(bits));
  REQUIRE(all_finite(r.out));
  for (size_t i = 0; i < states_f32.size(); ++i) r.states.push_back(bf16 ? from_bf16(states_bf16[i]) : states_f32[i]);
  if (o.layout == FKDA_STATE_LAYOUT_KV) r.states = transpose_heads(r.states);
  r.checkpoints = o.layout == FKDA_STATE_LAYOUT_KV ? transpose_heads(checkpoints) : checkpoints;
  return r;
}

double max_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) != std::isnan(b[i])) return INFINITY;
    if (!std::isnan(a[i])) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  }
  return worst;
}

double rel_l2_f(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> a_known, b_known;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) && std::isnan(b[i])) continue;  // poison left where nothing is due in either
    a_known.push_back(a[i]);
    b_known.push_back(b[i]);
  }
  return rel_l2(a_known, std::vector<double>(b_known.begin(), b_known.end()));
}

}  // namespace

TEST_CASE("chunk-parallel CPU forward pass equals the serial one", "[transitions][chunk_parallel]") {
  ProblemShape shape;
  shape.H = 2;
  // Short and long sequences: shorter than a segment, exactly one, several
  // with a partial last chunk, and empty.
  shape.lengths = {5, 100, 0, 64, 147, 32};
  struct Case {
    const char* name;
    FwdOptions options;
  };
  FwdOptions base;
  std::vector<Case> cases;
  for (int64_t segment_chunks : {1, 2, 3}) {
    FwdOptions o = base;
    o.segment_chunks = segment_chunks;
    cases.push_back({"contiguous f32 VK", o});
    o.checkpoints = true;
    cases.push_back({"checkpoints", o});
    o.pool = true;
    cases.push_back({"pool + checkpoints", o});
    o.checkpoints = false;
    o.state_dtype = FKDA_DTYPE_BF16;
    o.layout = FKDA_STATE_LAYOUT_KV;
    cases.push_back({"pool bf16 KV", o});
    o.pool = false;
    cases.push_back({"contiguous bf16 KV", o});
  }
  for (uint64_t variant_seed : {11u, 12u}) {
    std::vector<GateVariant> variants = gate_variants(shape, 4000 + variant_seed);
    // One bounded and one softplus/log-decay variant per seed keeps the run short.
    for (size_t v : {size_t(variant_seed == 11 ? 0 : 2), size_t(variant_seed == 11 ? 6 : 9)}) {
      Problem& p = variants[v].p;
      for (const Case& c : cases) {
        INFO(variants[v].name << ": " << c.name << ", segment_chunks " << c.options.segment_chunks);
        FwdOptions serial = c.options;
        serial.chunk_parallel = FKDA_CHUNK_PARALLEL_OFF;
        FwdOptions parallel = c.options;
        parallel.chunk_parallel = FKDA_CHUNK_PARALLEL_ON;
        const FwdResult a = run_fwd(p, serial), b = run_fwd(p, parallel);
        // The segments' transitions round like the recurrence (f16 operands)
        // but at other places: the paths agree to the f32 state's accuracy
        // target, far below what a lost token or a misplaced segment costs.
        const double state_tolerance = c.options.state_dtype == FKDA_DTYPE_BF16 ? 4e-3 : 1e-3;
        CHECK(rel_l2_f(b.out, a.out) < 2e-3);
        CHECK(rel_l2_f(b.states, a.states) < state_tolerance);
        CHECK(max_difference(b.out, a.out) < 0.05);
        if (c.options.checkpoints) CHECK(rel_l2_f(b.checkpoints, a.checkpoints) < 1e-3);
        // Padding and untouched slots: bit for bit (poison stays poison).
        if (c.options.pool) {
          const size_t per_slot = size_t(p.H * kHeadElems);
          for (size_t slot : {size_t(0), size_t(1)}) {
            bool same = true;
            for (size_t i = slot * per_slot; i < (slot + 1) * per_slot; ++i)
              same = same && std::isnan(a.states[i]) && std::isnan(b.states[i]);
            CHECK(same);
          }
        }
      }
    }
  }
}

TEST_CASE("chunk-parallel forward pass against the fp64 recurrence", "[transitions][chunk_parallel]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {300, 17, 129};
  Problem p = random_problem(slow(shape), 61);
  std::vector<int64_t> state_tokens;
  for (int64_t t = 16; t <= 288; t += 16) state_tokens.push_back(t);
  const Reference ref = reference_recurrence(p, state_tokens);
  FwdOptions o;
  o.chunk_parallel = FKDA_CHUNK_PARALLEL_ON;
  o.segment_chunks = 2;
  o.checkpoints = true;
  const FwdResult r = run_fwd(p, o);
  const AccuracyTargets targets = accuracy_targets(FKDA_DTYPE_F32, true);
  CHECK(rel_l2(r.out, ref.out) < targets.out);
  CHECK(rel_l2(r.states, ref.final_state) < targets.state);
  // Checkpoint c of sequence 0 (the only one with 18 of them) is the state after 16 (c + 1) tokens.
  const int64_t C = checkpoint_columns(p);
  for (int64_t c = 0; c < C; ++c) {
    const size_t per = size_t(p.H * kHeadElems);
    std::vector<float> got(r.checkpoints.begin() + long(c * per), r.checkpoints.begin() + long((c + 1) * per));
    std::vector<double> want(ref.states_after[size_t(c)].begin(), ref.states_after[size_t(c)].begin() + long(per));
    INFO("checkpoint " << c);
    CHECK(rel_l2(got, want) < targets.state);
  }
}
