// SPDX-License-Identifier: MIT
// The serving arguments are checked before any work: every bad pool, index,
// offset, table or struct size gets a status and a message naming the
// argument (and the sequence, for contents), and nothing is written. Structs
// of the 0.1 sizes keep working; the debug checks report shared slots.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"
#include "layer_support.h"
#include "serving_support.h"

namespace {

using namespace serving;

Problem random_inputs(ProblemShape shape, uint64_t seed) {
  shape.H = 1;
  shape.with_initial_state = false;
  return random_problem(shape, seed);
}

// The layer step the fixtures can add: a convolution of width 3 with
// biases and f32 conv states of width 3, and the output gate.
layer::LayerConfig full_layer_step() {
  layer::LayerConfig c;
  c.width = 3;
  c.state_width = 3;
  c.bias = true;
  c.out_gate = true;
  return c;
}

PlanOptions with_layer_step() {
  PlanOptions o;
  o.layer_step = 1;
  return o;
}

// A valid prefill by slot: sequences of 20, 40 and 16 tokens on slots 1, 4
// and 6 with checkpoints into slots 2, 3, 5 and 7 (or into a tensor); with
// the layer step, conv states in the rows of the pool's 8 slots.
struct PrefillFixture {
  Problem p;
  Pool pool{8, 1, FKDA_DTYPE_F32, 3};
  std::vector<uint16_t> out;
  std::vector<int32_t> slots = {1, 4, 6};
  std::vector<uint8_t> has_initial = {1, 0, 1};
  std::vector<int64_t> offsets = {16, -1, 16, 32, 16, -1};  // [3, 2]
  std::vector<int32_t> checkpoint_slots = {2, -1, 3, 5, 7, -1};
  std::vector<float> checkpoints, initial_state, final_state;
  layer::LayerBuffers layer{full_layer_step(), 1, 1, 76, 8, 301};

  PrefillFixture() {
    ProblemShape shape;
    shape.lengths = {20, 40, 16};
    p = random_inputs(shape, 101);
    out.assign(size_t(p.T * p.H * kD), kPoisonBf16);
    checkpoints.assign(size_t(3 * 2 * p.H * kHeadState), 0.f);
    initial_state.assign(size_t(3 * p.H * kHeadState), 0.5f);
    final_state.assign(size_t(3 * p.H * kHeadState), 0.f);
  }

  fkda_fwd_args common() {
    Buffers b{p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), p.A_log.data(), p.dt_bias.data(), out.data()};
    b.cu_seqlens = p.cu_seqlens.data();
    fkda_fwd_args a = make_args(p, b, FKDA_DTYPE_F32);
    a.checkpoint_offsets = tensor(offsets.data(), FKDA_DTYPE_I64, {3, 2});
    return a;
  }
  // States and checkpoints in the pool.
  fkda_fwd_args by_slot() {
    fkda_fwd_args a = common();
    a.state_pool = pool.tensor();
    a.state_indices = tensor(slots.data(), FKDA_DTYPE_I32, {3});
    a.has_initial_state = tensor(has_initial.data(), FKDA_DTYPE_BOOL, {3});
    a.checkpoint_slots = tensor(checkpoint_slots.data(), FKDA_DTYPE_I32, {3, 2});
    return a;
  }
  fkda_fwd_args by_slot_with_layer() {
    fkda_fwd_args a = by_slot();
    a.layer = layer.tensors();
    return a;
  }
  // Contiguous states, checkpoints into a tensor.
  fkda_fwd_args contiguous() {
    fkda_fwd_args a = common();
    a.initial_state = tensor(initial_state.data(), FKDA_DTYPE_F32, {3, p.H, kD, kD});
    a.final_state = tensor(final_state.data(), FKDA_DTYPE_F32, {3, p.H, kD, kD});
    a.checkpoints = tensor(checkpoints.data(), FKDA_DTYPE_F32, {3, 2, p.H, kD, kD});
    return a;
  }
};

// A valid decode: four packed sequences of 1, 3, 4 and 16 tokens (or three
// batched rows of 2), on [N] slots or an [N, 16] table with accepted counts;
// with the layer step, conv states in the rows of the pool's 24 slots.
struct DecodeFixture {
  Problem p;
  Pool pool{24, 1, FKDA_DTYPE_F32, 4};
  layer::LayerBuffers layer{full_layer_step(), 1, 1, 24, 24, 302};
  std::vector<uint16_t> out;
  std::vector<int32_t> cu = {0, 1, 4, 8, 24};
  std::vector<int64_t> slots = {3, 0, 7, 2};
  std::vector<int32_t> table = std::vector<int32_t>(4 * 16, -1);
  std::vector<int32_t> accepted = {1, 2, 3, 1};

  DecodeFixture() {
    ProblemShape shape;
    shape.lengths = {1, 3, 4, 16};
    p = random_inputs(shape, 202);
    out.assign(size_t(p.T * p.H * kD), kPoisonBf16);
    int32_t next = 0;
    for (int64_t n = 0; n < 4; ++n)
      for (int64_t t = 0; t < cu[size_t(n) + 1] - cu[size_t(n)]; ++t) table[size_t(n * 16 + t)] = next++;
  }

  fkda_decode_args packed() {
    Buffers b{p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(), p.A_log.data(), p.dt_bias.data(), out.data()};
    fkda_decode_args a = make_decode_args(p, b);
    a.cu_seqlens = tensor(cu.data(), FKDA_DTYPE_I32, {5});
    a.state_pool = pool.tensor();
    a.state_indices = tensor(slots.data(), FKDA_DTYPE_I64, {4});
    return a;
  }
  fkda_decode_args packed_with_layer() {
    fkda_decode_args a = packed();
    a.layer = layer.tensors();
    return a;
  }
  fkda_decode_args speculative() {
    fkda_decode_args a = packed();
    a.state_indices = tensor(table.data(), FKDA_DTYPE_I32, {4, 16});
    a.num_accepted_tokens = tensor(accepted.data(), FKDA_DTYPE_I32, {4});
    return a;
  }
  // B rows of T tokens over the same buffers (B * T <= 24), slots [B].
  fkda_decode_args batched(int64_t B, int64_t T) {
    fkda_decode_args a = packed();
    for (fkda_tensor* t : {&a.q, &a.k, &a.v, &a.g, &a.out}) *t = tensor(t->data, FKDA_DTYPE_BF16, {B, T, p.H, kD});
    a.beta = tensor(a.beta.data, FKDA_DTYPE_BF16, {B, T, p.H});
    a.cu_seqlens = FKDA_TENSOR_NONE;
    a.state_indices = tensor(slots.data(), FKDA_DTYPE_I64, {B});
    return a;
  }
};

template <typename Args, typename Fixture>
struct BadCall {
  const char* what;
  std::function<Args(Fixture&)> valid;
  std::function<void(Args&, Fixture&)> break_it;
  const char* message_start;
  fkda_status status = FKDA_ERROR_INVALID_ARGUMENT;
};

using BadPrefill = BadCall<fkda_fwd_args, PrefillFixture>;
using BadDecode = BadCall<fkda_decode_args, DecodeFixture>;

const auto kBySlot = [](PrefillFixture& f) { return f.by_slot(); };
const auto kContiguous = [](PrefillFixture& f) { return f.contiguous(); };
const auto kPacked = [](DecodeFixture& f) { return f.packed(); };
const auto kSpeculative = [](DecodeFixture& f) { return f.speculative(); };
const auto kBatched = [](DecodeFixture& f) { return f.batched(3, 2); };
const auto kBySlotWithLayer = [](PrefillFixture& f) { return f.by_slot_with_layer(); };
const auto kPackedWithLayer = [](DecodeFixture& f) { return f.packed_with_layer(); };

std::vector<BadPrefill> bad_prefill_calls() {
  using A = fkda_fwd_args;
  using F = PrefillFixture;
  return {
      {"state_indices without state_pool", kBySlot, [](A& a, F&) { a.state_pool = FKDA_TENSOR_NONE; }, "state_indices: given without state_pool"},
      {"state_pool alone", kBySlot, [](A& a, F&) { a.state_indices = a.has_initial_state = a.checkpoint_slots = a.checkpoint_offsets = FKDA_TENSOR_NONE; }, "state_pool: given without state_indices or checkpoint_slots"},
      {"state_indices with initial_state", kBySlot, [](A& a, F& f) { a.initial_state = f.contiguous().initial_state; }, "state_indices: the states come from state_pool"},
      {"state_indices f32", kBySlot, [](A& a, F&) { a.state_indices.dtype = FKDA_DTYPE_F32; }, "state_indices: expected dtype i32 or i64, got f32"},
      {"state_indices one too many", kBySlot, [](A& a, F&) { a.state_indices.shape[0] = 4; }, "state_indices: expected shape [3], got [4]"},
      {"state_indices rank 2", kBySlot, [](A& a, F&) { a.state_indices.rank = 2; a.state_indices.shape[1] = 1; }, "state_indices: expected rank 1, got 2"},
      {"state_pool bf16 on an f32 plan", kBySlot, [](A& a, F&) { a.state_pool.dtype = FKDA_DTYPE_BF16; }, "state_pool: expected dtype f32 (the plan's state_dtype), got bf16"},
      {"state_pool with 3 heads", kBySlot, [](A& a, F&) { a.state_pool.shape[1] = 3; }, "state_pool: expected shape [*, 1, 128, 128], got [8, 3, 128, 128]"},
      {"state_pool rank 3", kBySlot, [](A& a, F&) { a.state_pool.rank = 3; }, "state_pool: expected rank 4, got 3"},
      {"state_pool slots overlapping", kBySlot, [](A& a, F&) { a.state_pool.strides[0] = 128; }, "state_pool: strides"},
      {"state_pool rows strided", kBySlot, [](A& a, F&) { a.state_pool.strides[2] = 256; }, "state_pool: each state must be contiguous"},
      {"state_pool data NULL", kBySlot, [](A& a, F&) { a.state_pool.data = nullptr; }, "state_pool: data is NULL"},
      {"has_initial_state without a state", kBySlot, [](A& a, F&) { a.state_indices = FKDA_TENSOR_NONE; }, "has_initial_state: given without initial_state or state_indices"},
      {"has_initial_state f32", kBySlot, [](A& a, F&) { a.has_initial_state.dtype = FKDA_DTYPE_F32; }, "has_initial_state: expected dtype bool or i32 or i64, got f32"},
      {"checkpoint_offsets without destination", kBySlot, [](A& a, F&) { a.checkpoint_slots = FKDA_TENSOR_NONE; }, "checkpoint_offsets: needs exactly one destination"},
      {"checkpoint_offsets with two destinations", kBySlot, [](A& a, F& f) { a.checkpoints = f.contiguous().checkpoints; }, "checkpoint_offsets: needs exactly one destination"},
      {"checkpoint_slots without offsets", kBySlot, [](A& a, F&) { a.checkpoint_offsets = FKDA_TENSOR_NONE; }, "checkpoint_slots: given without checkpoint_offsets"},
      {"checkpoints without offsets", kContiguous, [](A& a, F&) { a.checkpoint_offsets = FKDA_TENSOR_NONE; }, "checkpoints: given without checkpoint_offsets"},
      {"checkpoint_offsets f32", kBySlot, [](A& a, F&) { a.checkpoint_offsets.dtype = FKDA_DTYPE_F32; }, "checkpoint_offsets: expected dtype i32 or i64, got f32"},
      {"checkpoint_slots of another width", kBySlot, [](A& a, F&) { a.checkpoint_slots.shape[1] = 1; }, "checkpoint_slots: expected shape [3, 2], got [3, 1]"},
      {"checkpoint_slots without state_pool", kContiguous, [](A& a, F& f) { a.checkpoints = FKDA_TENSOR_NONE; a.checkpoint_slots = f.by_slot().checkpoint_slots; }, "checkpoint_slots: given without state_pool"},
      {"checkpoints i32", kContiguous, [](A& a, F&) { a.checkpoints.dtype = FKDA_DTYPE_I32; }, "checkpoints: expected dtype bf16 or f32, got i32"},
      {"checkpoints of another width", kContiguous, [](A& a, F&) { a.checkpoints.shape[1] = 3; }, "checkpoints: expected shape [3, 2, *, *, *], got [3, 3, 1, 128, 128]"},
      {"checkpoints with 3 heads", kContiguous, [](A& a, F&) { a.checkpoints.shape[2] = 3; }, "checkpoints: expected shape [3, 2, 1, 128, 128]"},
      {"checkpoints overlapping across C", kContiguous, [](A& a, F&) { a.checkpoints.strides[1] = 0; }, "checkpoints: strides"},
      {"checkpoints rows strided", kContiguous, [](A& a, F&) { a.checkpoints.strides[3] = 256; }, "checkpoints: each state must be contiguous"},
      {"state_pool over initial_state", kContiguous, [](A& a, F& f) { a.checkpoints = FKDA_TENSOR_NONE; a.checkpoint_slots = f.by_slot().checkpoint_slots; a.state_pool = tensor(a.initial_state.data, FKDA_DTYPE_F32, {1, 1, kD, kD}); }, "state_pool: overlaps initial_state"},
      {"out over q", kBySlot, [](A& a, F&) { a.out.data = a.q.data; }, "out: overlaps q"},
      {"out over the pool", kBySlot, [](A& a, F&) { a.out.data = a.state_pool.data; }, "out: overlaps state_pool"},
      // One head state apart: head 0's final state would overwrite head 1's
      // initial state before it is read.
      {"final_state partly over initial_state", kContiguous, [](A& a, F& f) { f.final_state.assign(f.final_state.size() + size_t(kHeadState), -7.f); a.initial_state.data = f.final_state.data(); a.final_state.data = f.final_state.data() + kHeadState; }, "final_state: partly overlaps initial_state; the two may be the very same memory (updated in place) or disjoint"},
      {"initial_state partly over final_state", kContiguous, [](A& a, F& f) { f.final_state.assign(f.final_state.size() + size_t(kHeadState), -7.f); a.final_state.data = f.final_state.data(); a.initial_state.data = f.final_state.data() + kHeadState; }, "final_state: partly overlaps initial_state"},
      {"checkpoints over initial_state", kContiguous, [](A& a, F&) { a.initial_state.data = a.checkpoints.data; }, "checkpoints: overlaps initial_state"},
      {"out over has_initial_state", kBySlot, [](A& a, F& f) { a.has_initial_state.data = reinterpret_cast<unsigned char*>(f.out.data()) + 64; }, "out: overlaps has_initial_state"},
      {"state_pool over checkpoint_slots", kBySlot, [](A& a, F&) { a.checkpoint_slots.data = a.state_pool.data; }, "state_pool: overlaps checkpoint_slots"},
      // The smaller buffer moved into the larger: the other way round, the
      // checkpoints' span would reach whatever the allocator placed after
      // final_state, and the message could name that argument instead.
      {"final_state over the checkpoints", kContiguous, [](A& a, F&) { a.final_state.data = a.checkpoints.data; }, "checkpoints: overlaps final_state"},
      {"state index past the pool", kBySlot, [](A&, F& f) { f.slots[1] = 8; }, "state_indices[1]: slot 8 is outside the pool's 8 slots (sequence 1)"},
      {"checkpoint offset not a multiple of 16", kBySlot, [](A&, F& f) { f.offsets[2] = 20; }, "checkpoint_offsets[1][0]: 20 is not a multiple of 16 in [16, 40] (sequence 1 has 40 tokens)"},
      {"checkpoint offset past its sequence", kBySlot, [](A&, F& f) { f.offsets[0] = 32; }, "checkpoint_offsets[0][0]: 32 is not a multiple of 16 in [16, 20]"},
      {"checkpoint offset 0", kContiguous, [](A&, F& f) { f.offsets[4] = 0; }, "checkpoint_offsets[2][0]: 0 is not a multiple of 16 in [16, 16]"},
      {"checkpoint offsets descending", kBySlot, [](A&, F& f) { f.offsets[2] = 32; f.offsets[3] = 16; }, "checkpoint_offsets[1][1]: 16 follows 32; a sequence's offsets must ascend (sequence 1)"},
      {"checkpoint offsets repeated", kContiguous, [](A&, F& f) { f.offsets[3] = 16; }, "checkpoint_offsets[1][1]: 16 follows 16"},
      {"checkpoint slot past the pool", kBySlot, [](A&, F& f) { f.checkpoint_slots[3] = 9; }, "checkpoint_slots[1][1]: slot 9 is outside the pool's 8 slots (sequence 1)"},
  };
}

std::vector<BadDecode> bad_decode_calls() {
  using A = fkda_decode_args;
  using F = DecodeFixture;
  return {
      {"struct_size short", kPacked, [](A& a, F&) { a.struct_size -= 8; }, "args: struct_size is 2592, not a size fkda_decode_args has had (1360 in 0.2, 2600 in 0.5, or larger with zeros past 2600); initialise it with FKDA_DECODE_ARGS_INIT"},
      {"q missing", kPacked, [](A& a, F&) { a.q = FKDA_TENSOR_NONE; }, "q: required tensor is missing"},
      {"v of another length", kPacked, [](A& a, F&) { a.v.shape[1] = 23; }, "v: expected shape [1, 24, 1, 128], got [1, 23, 1, 128]"},
      {"17 tokens per row", kPacked, [](A& a, F& f) { a = f.batched(1, 17); }, "q: fkda_decode takes at most 16 tokens per sequence, got T = 17"},
      {"state_pool missing", kPacked, [](A& a, F&) { a.state_pool = FKDA_TENSOR_NONE; }, "state_pool: required tensor is missing"},
      {"state_pool with 2 heads", kPacked, [](A& a, F&) { a.state_pool.shape[1] = 2; }, "state_pool: expected shape [*, 1, 128, 128]"},
      {"state_pool slots overlapping", kPacked, [](A& a, F&) { a.state_pool.strides[0] = 8192; }, "state_pool: strides"},
      {"state_indices missing", kPacked, [](A& a, F&) { a.state_indices = FKDA_TENSOR_NONE; }, "state_indices: required tensor is missing"},
      {"state_indices rank 3", kPacked, [](A& a, F&) { a.state_indices.rank = 3; a.state_indices.shape[1] = a.state_indices.shape[2] = 1; }, "state_indices: expected rank 1, got 3"},
      {"state_indices one short", kPacked, [](A& a, F&) { a.state_indices.shape[0] = 3; }, "state_indices: expected shape [4], got [3]"},
      {"state_indices f32", kPacked, [](A& a, F&) { a.state_indices.dtype = FKDA_DTYPE_F32; }, "state_indices: expected dtype i32 or i64, got f32"},
      {"a table without columns", kSpeculative, [](A& a, F&) { a.state_indices.shape[1] = 0; }, "state_indices: a slot table needs at least one column, got 0"},
      {"a table narrower than the rows", kBatched, [](A& a, F& f) { a.state_indices = tensor(f.table.data(), FKDA_DTYPE_I32, {3, 1}); }, "state_indices: 2 tokens per sequence but the slot table has 1 columns"},
      {"num_accepted_tokens with [N] indices", kPacked, [](A& a, F& f) { a.num_accepted_tokens = f.speculative().num_accepted_tokens; }, "num_accepted_tokens: needs state_indices as an [N, W] slot table"},
      {"num_accepted_tokens one short", kSpeculative, [](A& a, F&) { a.num_accepted_tokens.shape[0] = 3; }, "num_accepted_tokens: expected shape [4], got [3]"},
      {"num_accepted_tokens bool", kSpeculative, [](A& a, F&) { a.num_accepted_tokens.dtype = FKDA_DTYPE_BOOL; }, "num_accepted_tokens: expected dtype i32 or i64, got bool"},
      {"scale NaN", kPacked, [](A& a, F&) { a.scale = std::numeric_limits<float>::quiet_NaN(); }, "scale: must be finite"},
      {"out over the pool", kPacked, [](A& a, F&) { a.out.data = a.state_pool.data; }, "out: overlaps state_pool"},
      {"state_pool over num_accepted_tokens", kSpeculative, [](A& a, F&) { a.num_accepted_tokens.data = a.state_pool.data; }, "state_pool: overlaps num_accepted_tokens"},
      {"out over v", kPacked, [](A& a, F&) { a.out.data = a.v.data; }, "out: overlaps v"},
      {"cu_seqlens past T", kPacked, [](A&, F& f) { f.cu[4] = 25; }, "cu_seqlens: must end at T = 24"},
      {"a sequence of 17 tokens", kPacked, [](A&, F& f) { f.cu[3] = 7; }, "cu_seqlens: sequence 3 has 17 tokens; fkda_decode takes at most 16 per sequence"},
      {"a sequence longer than its table", kSpeculative, [](A& a, F&) { a.state_indices.shape[1] = 8; }, "state_indices: sequence 3 has 16 tokens but the slot table has 8 columns"},
      {"start slot past the pool", kPacked, [](A&, F& f) { f.slots[2] = 24; }, "state_indices[2]: slot 24 is outside the pool's 24 slots (sequence 2)"},
      {"table slot past the pool", kSpeculative, [](A&, F& f) { f.table[1 * 16 + 2] = 100; }, "state_indices[1][2]: slot 100 is outside the pool's 24 slots (sequence 1)"},
      {"no accepted token", kSpeculative, [](A&, F& f) { f.accepted[1] = 0; }, "num_accepted_tokens[1]: 0 is outside [1, 16] (the slot table's columns) (sequence 1)"},
      {"more accepted tokens than columns", kSpeculative, [](A&, F& f) { f.accepted[2] = 17; }, "num_accepted_tokens[2]: 17 is outside [1, 16]"},
  };
}

template <typename Args, typename Fixture, typename Run>
void check_bad_calls(const std::vector<BadCall<Args, Fixture>>& calls, const Run& run) {
  for (const BadCall<Args, Fixture>& bad : calls) {
    SECTION(bad.what) {
      Fixture fixture;
      Args args = bad.valid(fixture);
      REQUIRE(run(args) == FKDA_SUCCESS);  // the unbroken call is valid
      std::fill(fixture.out.begin(), fixture.out.end(), kPoisonBf16);
      const Pool before = fixture.pool;
      const layer::LayerBuffers layer_before = fixture.layer;
      bad.break_it(args, fixture);
      check_failure(run(args), bad.status, bad.message_start);
      CHECK(inspect_rows(fixture.out, 1, {}).poisoned == fixture.out.size());
      CHECK(bytes_changed_outside(before, fixture.pool, {}) == 0);
      CHECK(fixture.layer.conv_bytes_changed_outside(layer_before, {}) == 0);
    }
  }
}

// Each of the layer step's arguments broken in turn (flashkda.h, "The layer
// step around the recurrence"); the fixtures' buffers hold W = 3, Wc = 3.
std::vector<BadPrefill> bad_layer_prefill_calls() {
  using A = fkda_fwd_args;
  using F = PrefillFixture;
  const auto L = kBySlotWithLayer;
  return {
      {"reserved not zero", L, [](A& a, F&) { a.layer.reserved = 1; }, "layer.reserved: must be 0, got 1"},
      {"conv_weight_k missing", L, [](A& a, F&) { a.layer.conv_weight_k = FKDA_TENSOR_NONE; }, "layer.conv_weight_k: required tensor is missing (data NULL, rank 0): the convolution's weights come all three or none, and layer.conv_weight_q is given"},
      {"conv_weight_q missing", L, [](A& a, F&) { a.layer.conv_weight_q = FKDA_TENSOR_NONE; }, "layer.conv_weight_q: required tensor is missing (data NULL, rank 0): the convolution's weights come all three or none, and layer.conv_weight_k is given"},
      {"biases without weights", L, [](A& a, F&) { a.layer.conv_weight_q = a.layer.conv_weight_k = a.layer.conv_weight_v = FKDA_TENSOR_NONE; }, "layer.conv_bias_q: given without the convolution"},
      {"a conv state without weights", L, [](A& a, F&) { a.layer.conv_weight_q = a.layer.conv_weight_k = a.layer.conv_weight_v = a.layer.conv_bias_q = a.layer.conv_bias_k = a.layer.conv_bias_v = a.layer.conv_state_q = a.layer.conv_state_v = FKDA_TENSOR_NONE; }, "layer.conv_state_k: given without the convolution"},
      {"conv weights of width 5", L, [](A& a, F&) { a.layer.conv_weight_q.shape[1] = 5; }, "layer.conv_weight_q: expected a width W of 2, 3 or 4 on axis 1, got shape [128, 5]"},
      {"conv weights of width 1", L, [](A& a, F&) { a.layer.conv_weight_q.shape[1] = 1; }, "layer.conv_weight_q: expected a width W of 2, 3 or 4 on axis 1, got shape [128, 1]"},
      {"conv weights of two heads", L, [](A& a, F&) { a.layer.conv_weight_q.shape[0] = 256; }, "layer.conv_weight_q: expected shape [128, *], got [256, 3]"},
      {"conv weights [H*K, 1, W] not viewed as [H*K, W]", L, [](A& a, F&) { auto& w = a.layer.conv_weight_q; w.rank = 3; w.shape[2] = w.shape[1]; w.shape[1] = 1; w.strides[2] = 1; }, "layer.conv_weight_q: expected rank 2, got 3"},
      {"conv weights f16", L, [](A& a, F&) { a.layer.conv_weight_q.dtype = FKDA_DTYPE_F16; }, "layer.conv_weight_q: expected dtype bf16 or f32, got f16"},
      {"conv_weight_v f32 beside bf16", L, [](A& a, F&) { a.layer.conv_weight_v.dtype = FKDA_DTYPE_F32; }, "layer.conv_weight_v: expected dtype bf16 (layer.conv_weight_q's), got f32"},
      {"conv_weight_k of another width", L, [](A& a, F&) { a.layer.conv_weight_k.shape[1] = 2; }, "layer.conv_weight_k: expected shape [128, 3], got [128, 2]"},
      {"conv weights with a negative stride", L, [](A& a, F&) { a.layer.conv_weight_q.strides[0] = -3; }, "layer.conv_weight_q: negative strides are not supported"},
      {"conv weight data NULL", L, [](A& a, F&) { a.layer.conv_weight_v.data = nullptr; }, "layer.conv_weight_v: data is NULL"},
      {"conv_bias_k missing", L, [](A& a, F&) { a.layer.conv_bias_k = FKDA_TENSOR_NONE; }, "layer.conv_bias_k: required tensor is missing (data NULL, rank 0): the biases come all three or none"},
      {"conv_bias_q f32 with bf16 weights", L, [](A& a, F&) { a.layer.conv_bias_q.dtype = FKDA_DTYPE_F32; }, "layer.conv_bias_q: expected dtype bf16 (the conv weights'), got f32"},
      {"conv_bias_v of 64 channels", L, [](A& a, F&) { a.layer.conv_bias_v.shape[0] = 64; }, "layer.conv_bias_v: expected shape [128], got [64]"},
      {"conv_state_v missing", L, [](A& a, F&) { a.layer.conv_state_v = FKDA_TENSOR_NONE; }, "layer.conv_state_v: required tensor is missing (data NULL, rank 0): the conv states come all three or none"},
      {"conv states of N rows with state_indices", L, [](A& a, F&) { a.layer.conv_state_q.shape[0] = 3; }, "layer.conv_state_q: expected 8 rows on axis 0 (the pool's slots, as the call takes state_indices), got shape [3, 128, 3]"},
      {"conv states of width 1 for W 3", L, [](A& a, F&) { a.layer.conv_state_q.shape[2] = 1; }, "layer.conv_state_q: expected a width of W - 1 = 2 or W = 3 on axis 2"},
      {"conv_state_k bf16 beside f32", L, [](A& a, F&) { a.layer.conv_state_k.dtype = FKDA_DTYPE_BF16; }, "layer.conv_state_k: expected dtype f32 (layer.conv_state_q's), got bf16"},
      {"conv_state_k of another width", L, [](A& a, F&) { a.layer.conv_state_k.shape[2] = 2; }, "layer.conv_state_k: expected shape [8, 128, 3], got [8, 128, 2]"},
      {"conv states i64", L, [](A& a, F&) { a.layer.conv_state_q.dtype = FKDA_DTYPE_I64; }, "layer.conv_state_q: expected dtype bf16 or f32, got i64"},
      {"conv state columns on one address", L, [](A& a, F&) { a.layer.conv_state_q.strides[2] = 0; }, "layer.conv_state_q: strides"},
      {"conv_state_k over conv_state_q", L, [](A& a, F&) { a.layer.conv_state_k.data = a.layer.conv_state_q.data; }, "layer.conv_state_k: overlaps layer.conv_state_q"},
      {"conv state over out", L, [](A& a, F&) { a.layer.conv_state_q.data = a.out.data; }, "layer.conv_state_q: overlaps out"},
      {"conv state over the pool", L, [](A& a, F&) { a.layer.conv_state_v.data = a.state_pool.data; }, "layer.conv_state_v: overlaps state_pool"},
      {"conv weights over a conv state", L, [](A& a, F&) { a.layer.conv_weight_q.data = a.layer.conv_state_v.data; }, "layer.conv_state_v: overlaps layer.conv_weight_q"},
      {"conv states with checkpoint_slots but no state_indices", L, [](A& a, F&) { a.state_indices = a.has_initial_state = FKDA_TENSOR_NONE; }, "layer.conv_state_q: checkpoint_slots write conv states into rows of the pool"},
      {"out_gate f32", L, [](A& a, F&) { a.layer.out_gate.dtype = FKDA_DTYPE_F32; }, "layer.out_gate: expected dtype bf16, got f32"},
      {"out_gate of another length", L, [](A& a, F&) { a.layer.out_gate.shape[1] = 75; }, "layer.out_gate: expected shape [1, 76, 1, 128], got [1, 75, 1, 128]"},
      {"out_gate rows strided", L, [](A& a, F&) { a.layer.out_gate.strides[3] = 2; }, "layer.out_gate: the last axis must be contiguous"},
      {"out_gate over out", L, [](A& a, F&) { a.layer.out_gate.data = a.out.data; }, "out: overlaps layer.out_gate"},
      {"out_norm_weight missing", L, [](A& a, F&) { a.layer.out_norm_weight = FKDA_TENSOR_NONE; }, "layer.out_norm_weight: required tensor is missing (data NULL, rank 0): layer.out_gate is given"},
      {"out_norm_weight without out_gate", L, [](A& a, F&) { a.layer.out_gate = FKDA_TENSOR_NONE; }, "layer.out_norm_weight: given without layer.out_gate"},
      {"out_norm_weight of 64", L, [](A& a, F&) { a.layer.out_norm_weight.shape[0] = 64; }, "layer.out_norm_weight: expected shape [128], got [64]"},
      {"out_norm_weight i32", L, [](A& a, F&) { a.layer.out_norm_weight.dtype = FKDA_DTYPE_I32; }, "layer.out_norm_weight: expected dtype bf16 or f32, got i32"},
      {"out_norm_eps 0", L, [](A& a, F&) { a.layer.out_norm_eps = 0.f; }, "layer.out_norm_eps: must be finite and > 0, got 0"},
      {"out_norm_eps negative", L, [](A& a, F&) { a.layer.out_norm_eps = -1e-5f; }, "layer.out_norm_eps: must be finite and > 0, got -0"},
      {"out_norm_eps NaN", L, [](A& a, F&) { a.layer.out_norm_eps = std::numeric_limits<float>::quiet_NaN(); }, "layer.out_norm_eps: must be finite and > 0, got nan"},
      {"out_norm_eps infinite", L, [](A& a, F&) { a.layer.out_norm_eps = std::numeric_limits<float>::infinity(); }, "layer.out_norm_eps: must be finite and > 0, got inf"},
  };
}

std::vector<BadDecode> bad_layer_decode_calls() {
  using A = fkda_decode_args;
  using F = DecodeFixture;
  const auto L = kPackedWithLayer;
  return {
      {"the convolution with a slot table", L, [](A& a, F& f) { a.state_indices = f.speculative().state_indices; a.num_accepted_tokens = f.speculative().num_accepted_tokens; }, "layer.conv_weight_q: fkda_decode with an [N, W] slot table (speculative verify) takes no convolution", FKDA_ERROR_UNSUPPORTED},
      {"conv states of N rows", L, [](A& a, F&) { a.layer.conv_state_q.shape[0] = 4; }, "layer.conv_state_q: expected 24 rows on axis 0 (the pool's slots), got shape [4, 128, 3]"},
      {"conv state over the pool", L, [](A& a, F&) { a.layer.conv_state_k.data = a.state_pool.data; }, "layer.conv_state_k: overlaps state_pool"},
      {"out inside a conv state", L, [](A& a, F&) { a.out.data = a.layer.conv_state_q.data; }, "layer.conv_state_q: overlaps out"},
      {"conv_weight_q alone", L, [](A& a, F&) { a.layer.conv_weight_k = a.layer.conv_weight_v = FKDA_TENSOR_NONE; }, "layer.conv_weight_k: required tensor is missing"},
      {"reserved not zero", L, [](A& a, F&) { a.layer.reserved = -1; }, "layer.reserved: must be 0, got -1"},
      {"out_gate of another length", L, [](A& a, F&) { a.layer.out_gate.shape[1] = 23; }, "layer.out_gate: expected shape [1, 24, 1, 128], got [1, 23, 1, 128]"},
      {"out_norm_weight missing", L, [](A& a, F&) { a.layer.out_norm_weight = FKDA_TENSOR_NONE; }, "layer.out_norm_weight: required tensor is missing"},
      {"out_norm_eps infinite", L, [](A& a, F&) { a.layer.out_norm_eps = std::numeric_limits<float>::infinity(); }, "layer.out_norm_eps: must be finite and > 0, got inf"},
      {"out_gate over the pool", L, [](A& a, F&) { a.layer.out_gate.data = a.state_pool.data; }, "state_pool: overlaps layer.out_gate"},
  };
}

}  // namespace

TEST_CASE("bad serving arguments of fkda_fwd are rejected with a message naming them", "[validation][serving]") {
  CpuPlan plan(1);
  check_bad_calls(bad_prefill_calls(), [&](const fkda_fwd_args& a) { return plan.fwd(a); });
}

TEST_CASE("bad fkda_decode calls are rejected with a message naming the argument", "[validation][serving]") {
  CpuPlan plan(1);
  check_bad_calls(bad_decode_calls(), [&](const fkda_decode_args& a) { return plan.decode(a); });
}

TEST_CASE("bad layer step arguments of fkda_fwd are rejected with a message naming them", "[validation][layer]") {
  CpuPlan plan(1, with_layer_step());
  check_bad_calls(bad_layer_prefill_calls(), [&](const fkda_fwd_args& a) { return plan.fwd(a); });
}

TEST_CASE("bad layer step arguments of fkda_decode are rejected with a message naming them", "[validation][layer]") {
  CpuPlan plan(1);
  check_bad_calls(bad_layer_decode_calls(), [&](const fkda_decode_args& a) { return plan.decode(a); });
}

TEST_CASE("the layer step: what each call takes", "[validation][layer]") {
  SECTION("fkda_fwd's convolution needs a plan created with layer_step = 1; its output gate does not") {
    CpuPlan plain(1);
    PrefillFixture f;
    const layer::LayerBuffers before = f.layer;
    expect_invalid(plain.fwd(f.by_slot_with_layer()),
                   "layer.conv_weight_q: the convolution needs a plan created with layer_step = 1");
    CHECK(inspect_rows(f.out, 1, {}).poisoned == f.out.size());
    CHECK(f.layer.conv_bytes_changed_outside(before, {}) == 0);
    fkda_fwd_args gate_only = f.by_slot();
    gate_only.layer.out_gate = f.layer.gate.tensor();
    gate_only.layer.out_norm_weight = f.layer.norm_weight.tensor();
    FKDA_REQUIRE(plain.fwd(gate_only));
  }
  SECTION("fkda_decode takes the convolution on any plan, and the output gate with a slot table") {
    CpuPlan plain(1);
    DecodeFixture f;
    FKDA_REQUIRE(plain.decode(f.packed_with_layer()));
    fkda_decode_args gated = f.speculative();
    gated.layer.out_gate = f.layer.gate.tensor();
    gated.layer.out_norm_weight = f.layer.norm_weight.tensor();
    FKDA_REQUIRE(plain.decode(gated));
  }
  SECTION("contiguous states: the conv states have one row per sequence") {
    CpuPlan plan(1, with_layer_step());
    PrefillFixture f;
    fkda_fwd_args a = f.contiguous();
    a.layer = f.layer.tensors();
    for (fkda_tensor* t : {&a.layer.conv_state_q, &a.layer.conv_state_k, &a.layer.conv_state_v}) t->shape[0] = 3;
    FKDA_REQUIRE(plan.fwd(a));
    a.layer.conv_state_q.shape[0] = 8;
    expect_invalid(plan.fwd(a), "layer.conv_state_q: expected 3 rows on axis 0 (one per sequence, as the call takes no state_indices), got shape [8, 128, 3]");
  }
  SECTION("an older caller's struct has no layer step") {
    CpuPlan plan(1, with_layer_step());
    PrefillFixture f;
    fkda_fwd_args a = f.by_slot_with_layer();
    a.struct_size = 1920;  // 0.2's size: the layer step's bytes are not read
    a.layer.reserved = 7;
    FKDA_REQUIRE(plan.fwd(a));
  }
}

TEST_CASE("null indices are padding, not errors, under either rule", "[validation][serving]") {
  DecodeFixture f;
  SECTION("negative indices with FKDA_NULL_SLOT_NEGATIVE") {
    CpuPlan plan(1);
    f.slots = {-1, -7, 0, 23};
    FKDA_REQUIRE(plan.decode(f.packed()));
  }
  SECTION("zero and negative indices with FKDA_NULL_SLOT_NONPOSITIVE") {
    CpuPlan plan(1, {FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, FKDA_NULL_SLOT_NONPOSITIVE});
    f.slots = {0, -3, 5, 0};
    FKDA_REQUIRE(plan.decode(f.packed()));
    f.table[0] = 0;  // sequence 0's only column: padding, and its other indices unchecked
    f.table[1] = 999;
    FKDA_REQUIRE(plan.decode(f.speculative()));
  }
}

// flashkda.h lists the entries a call never reads; they may hold anything.
// Each garbage value below is one that fails when the entry is read.
TEST_CASE("entries the call never reads are not checked, as flashkda.h lists them", "[validation][serving]") {
  CpuPlan plan(1);
  SECTION("fkda_fwd: a padding sequence's checkpoints, a checkpoint slot behind a negative offset") {
    PrefillFixture f;
    f.slots[0] = -1;  // sequence 0 is padding
    f.offsets[0] = 7;
    f.checkpoint_slots[0] = 999;
    f.checkpoint_slots[1] = 999;  // behind offset -1 of sequence 0
    f.checkpoint_slots[5] = 999;  // behind offset -1 of sequence 2
    FKDA_REQUIRE(plan.fwd(f.by_slot()));
    f.slots[0] = 1;
    expect_invalid(plan.fwd(f.by_slot()), "checkpoint_offsets[0][0]: 7 is not a multiple of 16 in [16, 20] (sequence 0 has 20 tokens)");
  }
  SECTION("fkda_decode: a zero-length sequence's indices and count, table columns past a sequence's length") {
    DecodeFixture f;
    f.cu = {0, 0, 4, 8, 24};  // sequence 0 has no token, sequence 1 four
    f.table[0] = 999;
    f.accepted[0] = 99;
    f.table[1 * 16 + 3] = 9;   // sequence 1's fourth column, now read
    f.table[2 * 16 + 4] = 999;  // past sequence 2's four tokens
    FKDA_REQUIRE(plan.decode(f.speculative()));
    f.cu = {0, 1, 4, 8, 24};
    expect_invalid(plan.decode(f.speculative()), "num_accepted_tokens[0]: 99 is outside [1, 16] (the slot table's columns) (sequence 0)");
  }
  SECTION("fkda_decode: a padding sequence's other columns") {
    DecodeFixture f;
    f.table[1 * 16 + 1] = -1;  // sequence 1 starts from column 1 (2 accepted): padding
    f.table[1 * 16 + 0] = 999;
    f.table[1 * 16 + 2] = 999;
    FKDA_REQUIRE(plan.decode(f.speculative()));
    f.table[1 * 16 + 1] = 5;
    expect_invalid(plan.decode(f.speculative()), "state_indices[1][0]: slot 999 is outside the pool's 24 slots (sequence 1)");
  }
}

TEST_CASE("fkda_decode needs no workspace", "[validation][serving]") {
  CpuPlan plan(1);
  size_t bytes = 1;
  REQUIRE(fkda_plan_decode_workspace_size(plan.get(), 24, 4, &bytes) == FKDA_SUCCESS);
  CHECK(bytes == 0);
  expect_invalid(fkda_plan_decode_workspace_size(plan.get(), -1, 4, &bytes), "total_tokens: must be >= 0");
  expect_invalid(fkda_plan_decode_workspace_size(plan.get(), 24, 4, nullptr), "bytes: NULL output pointer");
  expect_invalid(fkda_plan_decode_workspace_size(nullptr, 24, 4, &bytes), "plan: NULL");
  DecodeFixture f;
  const fkda_decode_args args = f.packed();
  FKDA_REQUIRE(fkda_decode(plan.get(), &args, nullptr, 0, nullptr));
  expect_invalid(fkda_decode(plan.get(), nullptr, nullptr, 0, nullptr), "args: NULL");
}

namespace {

// Where a field ends, and a release's sizeof: that end rounded up to the
// struct's alignment. Computed from flashkda.h, apart from src/abi_struct.h's
// table, so that the two can disagree.
#define FIELD_END(S, f) (offsetof(S, f) + sizeof(static_cast<S*>(nullptr)->f))
template <typename S>
constexpr size_t release_size(size_t fields_end) {
  return (fields_end + alignof(S) - 1) / alignof(S) * alignof(S);
}

// The struct behind a caller's pointer, with room for the sizes of a newer
// header: `extra` bytes past sizeof(S), zero unless a test sets one. The
// bytes from `fields_end` on (S's trailing padding, undefined in a copy)
// are zero too, as a caller that zeroes its struct whole has them.
template <typename S>
struct Oversized {
  std::vector<uint64_t> words;
  explicit Oversized(const S& value, size_t extra = 64, size_t fields_end = sizeof(S))
      : words((sizeof(S) + extra + 7) / 8, 0) {
    std::memcpy(words.data(), &value, fields_end);
  }
  S* get() { return reinterpret_cast<S*>(words.data()); }
  unsigned char* bytes() { return reinterpret_cast<unsigned char*>(words.data()); }
};

// Every size from 0 to sizeof(S) + 64 through `call`: the releases' sizes
// and larger ones (zeros past the fields) succeed, any other fails naming
// the argument, the size and the struct.
template <typename S, typename Call>
void check_every_size(const S& valid, const std::set<size_t>& releases, const char* argument, const char* name,
                      const Call& call, size_t fields_end = sizeof(S)) {
  for (size_t size = 0; size <= sizeof(S) + 64; ++size) {
    CAPTURE(size);
    Oversized<S> given(valid, 64, fields_end);
    given.get()->struct_size = size;
    const fkda_status status = call(given.get());
    if (releases.count(size) == 1 || size > sizeof(S)) {
      CHECK(status == FKDA_SUCCESS);
      CHECK(std::string(fkda_last_error()).empty());
    } else {
      CHECK(status == FKDA_ERROR_INVALID_ARGUMENT);
      const std::string message = fkda_last_error();
      CHECK(message.rfind(std::string(argument) + ": struct_size is " + std::to_string(size) + ", ", 0) == 0);
      CHECK(message.find(name) != std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("struct sizes: exactly the releases' sizes, or larger with zeros past the known fields", "[validation][abi]") {
  SECTION("fkda_plan_desc") {
    fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
    desc.num_heads = 1;
    desc.backend = FKDA_BACKEND_CPU;
    const std::set<size_t> releases = {release_size<fkda_plan_desc>(FIELD_END(fkda_plan_desc, lower_bound)),
                                       release_size<fkda_plan_desc>(FIELD_END(fkda_plan_desc, debug_checks)),
                                       release_size<fkda_plan_desc>(FIELD_END(fkda_plan_desc, beta_mode)),
                                       release_size<fkda_plan_desc>(FIELD_END(fkda_plan_desc, segment_chunks)),
                                       sizeof(fkda_plan_desc)};
    check_every_size(desc, releases, "desc", "fkda_plan_desc", [](const fkda_plan_desc* d) {
      fkda_plan_t plan = nullptr;
      const fkda_status status = fkda_plan_create(d, &plan);
      if (plan != nullptr) fkda_plan_destroy(plan);  // a refusal's message stays
      return status;
    }, FIELD_END(fkda_plan_desc, layer_step));
  }
  SECTION("fkda_fwd_args") {
    CpuPlan plan(1);
    PrefillFixture f;
    // Without the 0.2 fields, so that a 0.1 reading is the same call.
    fkda_fwd_args args = f.contiguous();
    args.checkpoint_offsets = args.checkpoints = FKDA_TENSOR_NONE;
    const std::set<size_t> releases = {release_size<fkda_fwd_args>(FIELD_END(fkda_fwd_args, scale)),
                                       release_size<fkda_fwd_args>(FIELD_END(fkda_fwd_args, checkpoint_slots)),
                                       sizeof(fkda_fwd_args)};
    check_every_size(args, releases, "args", "fkda_fwd_args",
                     [&](const fkda_fwd_args* a) { return plan.fwd(*a); });
  }
  SECTION("fkda_decode_args") {
    CpuPlan plan(1);
    DecodeFixture f;
    check_every_size(f.packed(),
                     {release_size<fkda_decode_args>(FIELD_END(fkda_decode_args, scale)), sizeof(fkda_decode_args)},
                     "args", "fkda_decode_args",
                     [&](const fkda_decode_args* a) { return plan.decode(*a); });
  }
}

TEST_CASE("struct sizes that split a field are refused, naming the struct", "[validation][abi]") {
  // 1424 ends inside state_indices' descriptor; 1919 is one byte short of
  // 0.2's struct, 3159 of 0.5's.
  CpuPlan plan(1);
  PrefillFixture f;
  for (size_t size : {size_t(1424), size_t(1919), sizeof(fkda_fwd_args) - 1}) {
    CAPTURE(size);
    fkda_fwd_args args = f.by_slot();
    args.struct_size = size;
    std::fill(f.out.begin(), f.out.end(), kPoisonBf16);
    const Pool before = f.pool;
    expect_invalid(plan.fwd(args), "args: struct_size is " + std::to_string(size) + ", not a size fkda_fwd_args has had (1248 in 0.1, 1920 in 0.2, 3160 in 0.5, or larger with zeros past 3160");
    CHECK(inspect_rows(f.out, 1, {}).poisoned == f.out.size());
    CHECK(bytes_changed_outside(before, f.pool, {}) == 0);
  }
}

TEST_CASE("a newer caller's struct: accepted while its unknown bytes are zero, else the first one is named", "[validation][abi]") {
  SECTION("fkda_fwd_args") {
    CpuPlan plan(1);
    PrefillFixture f;
    Oversized<fkda_fwd_args> given(f.by_slot());
    given.get()->struct_size = sizeof(fkda_fwd_args) + 24;
    FKDA_REQUIRE(plan.fwd(*given.get()));
    given.bytes()[sizeof(fkda_fwd_args) + 24] = 1;  // past its size: never read
    FKDA_REQUIRE(plan.fwd(*given.get()));
    given.bytes()[sizeof(fkda_fwd_args) + 9] = 1;
    given.bytes()[sizeof(fkda_fwd_args) + 17] = 1;
    expect_invalid(plan.fwd(*given.get()),
                   "args: struct_size is 3184, larger than this library's fkda_fwd_args (3160 bytes), and byte 3169 "
                   "is not zero: the caller sets a field this library does not know");
  }
  SECTION("fkda_plan_desc: its trailing padding is a field to a newer caller") {
    fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
    desc.num_heads = 1;
    desc.backend = FKDA_BACKEND_CPU;
    const size_t fields_end = FIELD_END(fkda_plan_desc, layer_step);
    REQUIRE(fields_end < sizeof(fkda_plan_desc));
    Oversized<fkda_plan_desc> given(desc, 64, fields_end);
    given.bytes()[fields_end] = 0x5A;
    fkda_plan_t plan = nullptr;
    FKDA_REQUIRE(fkda_plan_create(given.get(), &plan));  // this header's size: padding, not read
    fkda_plan_destroy(plan);
    given.get()->struct_size = sizeof(fkda_plan_desc) + 8;
    expect_invalid(fkda_plan_create(given.get(), &plan),
                   "desc: struct_size is " + std::to_string(sizeof(fkda_plan_desc) + 8) +
                       ", larger than this library's fkda_plan_desc (88 bytes), and byte " + std::to_string(fields_end) +
                       " is not zero");
  }
  SECTION("fkda_plan_desc: beyond a page past the struct is refused unread") {
    fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
    desc.num_heads = 1;
    desc.backend = FKDA_BACKEND_CPU;
    Oversized<fkda_plan_desc> given(desc, 4096, FIELD_END(fkda_plan_desc, layer_step));
    fkda_plan_t plan = nullptr;
    given.get()->struct_size = sizeof(fkda_plan_desc) + 4096;
    FKDA_REQUIRE(fkda_plan_create(given.get(), &plan));
    fkda_plan_destroy(plan);
    given.get()->struct_size = sizeof(fkda_plan_desc) + 4097;
    expect_invalid(fkda_plan_create(given.get(), &plan), "desc: struct_size is " + std::to_string(sizeof(fkda_plan_desc) + 4097) + ", not a size fkda_plan_desc has had");
  }
}

TEST_CASE("an earlier release's struct reads only that release's fields", "[validation][abi]") {
  SECTION("fkda_plan_desc of 0.1, 0.2 and 0.3: later fields in their padding are garbage, not read") {
    const size_t ends[] = {FIELD_END(fkda_plan_desc, lower_bound), FIELD_END(fkda_plan_desc, debug_checks),
                           FIELD_END(fkda_plan_desc, beta_mode)};
    for (size_t end : ends) {
      CAPTURE(end);
      REQUIRE(end < release_size<fkda_plan_desc>(end));  // a later field sits in the padding
      fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
      desc.num_heads = 1;
      desc.backend = FKDA_BACKEND_CPU;
      std::memset(reinterpret_cast<unsigned char*>(&desc) + end, 0x7F, sizeof desc - end);
      desc.struct_size = release_size<fkda_plan_desc>(end);
      fkda_plan_t plan = nullptr;
      FKDA_REQUIRE(fkda_plan_create(&desc, &plan));
      float lower_bound = 0.f;
      FKDA_REQUIRE(fkda_get_lower_bound(plan, &lower_bound));  // the bounded gate, gate_mode's _INIT value
      fkda_plan_destroy(plan);
      // Read as this header's struct, the garbage reaches a checked field.
      if (end <= offsetof(fkda_plan_desc, gate_mode)) {
        desc.struct_size = sizeof(fkda_plan_desc);
        expect_invalid(fkda_plan_create(&desc, &plan), "desc.");
      }
    }
  }
  SECTION("fkda_fwd_args of 0.1: the pool fields are not read") {
    CpuPlan plan(1);
    PrefillFixture f;
    fkda_fwd_args full = f.contiguous();
    full.checkpoint_offsets = full.checkpoints = FKDA_TENSOR_NONE;
    FKDA_REQUIRE(plan.fwd(full));
    const std::vector<uint16_t> full_out = f.out;
    const std::vector<float> full_state = f.final_state;
    fkda_fwd_args old = full;
    old.state_indices = tensor(nullptr, FKDA_DTYPE_F32, {99});
    old.checkpoints = tensor(f.p.q.data(), FKDA_DTYPE_I32, {1});
    old.struct_size = release_size<fkda_fwd_args>(FIELD_END(fkda_fwd_args, scale));
    std::fill(f.out.begin(), f.out.end(), kPoisonBf16);
    std::fill(f.final_state.begin(), f.final_state.end(), 0.f);
    FKDA_REQUIRE(plan.fwd(old));
    CHECK(f.out == full_out);
    CHECK(f.final_state == full_state);
  }
}

TEST_CASE("output structs are written by the caller's size, never past its release's fields", "[validation][abi]") {
  constexpr unsigned char kCanary = 0xCD;
  // Fills the caller's memory with the canary, sets struct_size, calls, and
  // returns the bytes from the caller's fields on: all must be the canary.
  auto untouched_after = [&](auto* proto, size_t size, size_t fields_end, auto call) {
    using S = std::remove_pointer_t<decltype(proto)>;
    Oversized<S> given(*proto, 64);
    std::memset(given.bytes(), kCanary, given.words.size() * 8);
    given.get()->struct_size = size;
    FKDA_REQUIRE(call(given.get()));
    CHECK(given.get()->struct_size == size);
    size_t changed = 0;
    for (size_t i = fields_end; i < given.words.size() * 8; ++i) changed += given.bytes()[i] != kCanary;
    return changed;
  };
  SECTION("fkda_launch_report of 0.2, 0.4 and newer") {
    CpuPlan plan(1);
    fkda_launch_report report = FKDA_LAUNCH_REPORT_INIT;
    auto call = [&](fkda_launch_report* r) { return fkda_plan_get_launch_report(plan.get(), r); };
    const size_t old_end = FIELD_END(fkda_launch_report, slots_per_window);
    CHECK(untouched_after(&report, old_end, old_end, call) == 0);
    CHECK(untouched_after(&report, sizeof report, sizeof report, call) == 0);
    CHECK(untouched_after(&report, sizeof report + 16, sizeof report, call) == 0);
    // The fields of the caller's release are written (a CPU plan reports zeros).
    Oversized<fkda_launch_report> given(report);
    std::memset(given.bytes(), kCanary, given.words.size() * 8);
    given.get()->struct_size = old_end;
    FKDA_REQUIRE(call(given.get()));
    CHECK(given.get()->vsplit == 0);
    CHECK(given.get()->slots_per_window == 0);
    given.get()->struct_size = old_end + 8;
    expect_invalid(call(given.get()), "report: struct_size is " + std::to_string(old_end + 8) + ", not a size fkda_launch_report has had (32 in 0.2, 48 in 0.4");
  }
  SECTION("fkda_build_info") {
    fkda_build_info info = FKDA_BUILD_INFO_INIT;
    CHECK(untouched_after(&info, sizeof info, sizeof info, [](fkda_build_info* i) { return fkda_get_build_info(i); }) == 0);
    CHECK(untouched_after(&info, sizeof info + 40, sizeof info, [](fkda_build_info* i) { return fkda_get_build_info(i); }) == 0);
    info.struct_size = sizeof info - 8;
    expect_invalid(fkda_get_build_info(&info), "info: struct_size is 72, not a size fkda_build_info has had (80 in 0.2");
  }
  SECTION("fkda_device_info: not even its trailing padding") {
    fkda_device_info info = FKDA_DEVICE_INFO_INIT;
    auto call = [](fkda_device_info* i) { return fkda_query_device(-1, i); };
    const size_t fields_end = FIELD_END(fkda_device_info, name);
    CHECK(untouched_after(&info, sizeof info, fields_end, call) == 0);
    CHECK(untouched_after(&info, sizeof info + 8, fields_end, call) == 0);
    info.struct_size -= 8;
    expect_invalid(fkda_query_device(-1, &info), "info: struct_size is 288, not a size fkda_device_info has had (296 in 0.1, or larger with zeros past 296");
  }
}

TEST_CASE("fkda_decode takes the gate and beta inputs of the plan's modes", "[validation][serving][gate]") {
  DecodeFixture f;
  std::vector<float> g_f32(f.p.g.size(), -0.5f), beta_f32(f.p.beta.size(), 0.25f);
  auto with_f32 = [&](fkda_decode_args a) {
    a.g = tensor(g_f32.data(), FKDA_DTYPE_F32, {1, f.p.T, f.p.H, kD});
    a.beta = tensor(beta_f32.data(), FKDA_DTYPE_F32, {1, f.p.T, f.p.H});
    return a;
  };
  PlanOptions softplus;
  softplus.gate_mode = FKDA_GATE_SOFTPLUS;
  const CpuPlan softplus_plan(f.p.H, softplus);
  fkda_decode_args a = f.packed();
  FKDA_REQUIRE(softplus_plan.decode(a));
  a.A_log = FKDA_TENSOR_NONE;
  expect_invalid(softplus_plan.decode(a), "A_log: required tensor is missing");
  expect_invalid(softplus_plan.decode(with_f32(f.packed())), "g: expected dtype bf16 (the plan's gate is softplus");

  PlanOptions log_decay;
  log_decay.gate_mode = FKDA_GATE_LOG_DECAY;
  log_decay.beta_mode = FKDA_BETA_PROBABILITIES;
  const CpuPlan log_decay_plan(f.p.H, log_decay);
  expect_invalid(log_decay_plan.decode(f.packed()), "A_log: must be absent");
  a = with_f32(f.packed());
  a.A_log = FKDA_TENSOR_NONE;
  expect_invalid(log_decay_plan.decode(a), "dt_bias: must be absent");
  a.dt_bias = FKDA_TENSOR_NONE;
  FKDA_REQUIRE(log_decay_plan.decode(a));
  CHECK(inspect_rows(f.out, f.p.H, {}).poisoned == 0);
}

TEST_CASE("debug checks report two sequences sharing a slot", "[validation][serving][debug]") {
  struct Shared {
    const char* what;
    std::function<void(PrefillFixture&, DecodeFixture&)> share;
    bool decode;
    bool speculative;
    const char* message_start;
  };
  // Prefill calls this small run on one CPU worker, so the unchecked call
  // below has no race; decode calls spread over workers and would.
  const std::vector<Shared> cases = {
      {"two prefills writing one slot", [](PrefillFixture& p, DecodeFixture&) { p.slots[1] = 1; }, false, false,
       "state_indices[1]: slot 1 is also written by sequence 0; two sequences writing one slot in a call is undefined"},
      {"a checkpoint into another sequence's slot", [](PrefillFixture& p, DecodeFixture&) { p.checkpoint_slots[0] = 4; }, false, false,
       "state_indices[1]: slot 4 is also written by sequence 0"},
      {"two decodes writing one slot", [](PrefillFixture&, DecodeFixture& d) { d.slots[3] = 0; }, true, false,
       "state_indices[3]: slot 0 is also written by sequence 1"},
      {"a speculative start slot another sequence writes", [](PrefillFixture&, DecodeFixture& d) { d.accepted[0] = 2; d.table[1] = 5; }, true, true,
       "state_indices[0][1]: sequence 0 starts from slot 5, which sequence 2 writes in the same call"},
  };
  for (const Shared& c : cases) {
    SECTION(c.what) {
      PrefillFixture prefill;
      DecodeFixture decode;
      c.share(prefill, decode);
      auto run = [&](const CpuPlan& plan) {
        return c.decode ? plan.decode(c.speculative ? decode.speculative() : decode.packed()) : plan.fwd(prefill.by_slot());
      };
      if (!c.decode) {
        SECTION("undefined but not checked without them") {
          CpuPlan plan(1);
          FKDA_REQUIRE(run(plan));
        }
      }
      SECTION("desc.debug_checks = 1") {
        CpuPlan plan(1, {FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, FKDA_NULL_SLOT_NEGATIVE, 1});
        expect_invalid(run(plan), c.message_start);
      }
      SECTION("FKDA_DEBUG_CHECKS=1 in the environment") {
        setenv("FKDA_DEBUG_CHECKS", "1", 1);
        CpuPlan plan(1);
        unsetenv("FKDA_DEBUG_CHECKS");
        expect_invalid(run(plan), c.message_start);
      }
    }
  }
}
