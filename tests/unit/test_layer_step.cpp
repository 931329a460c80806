// SPDX-License-Identifier: MIT
// The layer step around the recurrence on the CPU backend (flashkda.h, "The
// layer step around the recurrence"): fkda_fwd and fkda_decode with the
// convolution of q, k and v and the output gate, against the fp64 layer step
// of the reference, for every convolution width, conv state width and dtype,
// with and without biases, every gate form, both null-slot rules, padding,
// zero-length and short sequences. Outputs are poisoned first and checked
// fully written, conv states must hold exactly the raw inputs, and nothing
// outside the slots and rows a call writes may change. Each check is shown
// failing on a deliberately wrong variant.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"
#include "layer_support.h"
#include "serving_support.h"

namespace {

using namespace serving;
using layer::LayerBuffers;
using layer::LayerConfig;

// Relative L2 against the fp64 layer step, as test_cpu_serving.cpp measures
// the recurrence alone. fkda_fwd rounds its output to bf16 once, and once
// more for each part of the layer step (the staged q, k and v; the gated
// output); each rounding adds about 1.7e-3 in quadrature, so with both
// parts the contract itself sits near 2.9e-3.
constexpr double kPrefillOut = 3.0e-3;
constexpr double kPrefillOutBothParts = 4.0e-3;
constexpr double kDecodeOut = 2.0e-3;
constexpr double kPrefillStateF32 = 1.0e-3;
constexpr double kDecodeStateF32 = 1.0e-6;
constexpr double kStateBf16 = 2.0e-3;

double state_tolerance(fkda_dtype dtype, double f32_tolerance) {
  return dtype == FKDA_DTYPE_BF16 ? kStateBf16 : f32_tolerance;
}

double prefill_out_tolerance(const LayerConfig& config) {
  return config.width > 0 && config.out_gate ? kPrefillOutBothParts : kPrefillOut;
}

// Sequence 1 has no token; 2 and 3 have fewer than Wc, so their conv states
// keep columns of the old ones; 4 is padding in pool calls.
const std::vector<int64_t> kPrefillLengths = {37, 0, 2, 1, 64, 19, 33};
// Sequence 3 has no token; 4 is padding.
const std::vector<int64_t> kDecodeLengths = {1, 4, 16, 0, 7, 2, 3};

ProblemShape two_heads(const std::vector<int64_t>& lengths) {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = lengths;
  shape.with_initial_state = false;  // the states come from the pool or the test
  return shape;
}

Problem slow_inputs(const std::vector<int64_t>& lengths, uint64_t seed) {
  return random_problem(slow_decay(two_heads(lengths)), seed);
}

std::vector<uint16_t> poisoned_out(const Problem& p) {
  return std::vector<uint16_t>(size_t(p.B * p.T * p.H * p.V), kPoisonBf16);
}

int32_t null_index(fkda_null_slot_rule rule) { return rule == FKDA_NULL_SLOT_NONPOSITIVE ? 0 : -1; }

int64_t length_of(const Problem& p, int64_t n) { return p.cu_seqlens[size_t(n) + 1] - p.cu_seqlens[size_t(n)]; }

std::vector<int64_t> tokens_of(const Problem& p, const std::vector<int64_t>& seqs) {
  std::vector<int64_t> tokens;
  for (int64_t n : seqs)
    for (int64_t t = p.cu_seqlens[size_t(n)]; t < p.cu_seqlens[size_t(n) + 1]; ++t) tokens.push_back(t);
  return tokens;
}

// Blocks of `block` elements of these sequences from an [N, block] array, in order.
template <typename T>
std::vector<T> blocks(const std::vector<T>& all, const std::vector<int64_t>& seqs, size_t block) {
  std::vector<T> picked;
  for (int64_t n : seqs) {
    const auto first = all.begin() + std::ptrdiff_t(size_t(n) * block);
    picked.insert(picked.end(), first, first + std::ptrdiff_t(block));
  }
  return picked;
}

// The reference's conv states of these sequences, q, k and v one after the
// other, as LayerBuffers::state_rows orders the library's.
template <typename Three>
std::vector<double> conv_blocks(const Three& states, const std::vector<int64_t>& seqs, const LayerBuffers& l) {
  const size_t block = size_t(l.H * LayerBuffers::kD * l.config.state_width);
  std::vector<double> picked;
  for (int i = 0; i < 3; ++i) {
    const std::vector<double> one = blocks(states[i], seqs, block);
    picked.insert(picked.end(), one.begin(), one.end());
  }
  return picked;
}

// What one call with the layer step got right, against the fp64 layer step.
struct StepCheck {
  double out_error = 0;        // rows of the real sequences
  double state_error = 0;      // their recurrent states
  double conv_difference = 0;  // their conv states and conv checkpoints: the largest |difference|
  size_t conv_compared = 0;    // conv state values compared
  size_t poisoned = 0, nonzero_padding = 0;
  size_t pool_changed_outside = 0, conv_changed_outside = 0;
  std::vector<uint16_t> out;
  Problem as_run;                   // the problem as the reference ran it
  std::vector<int64_t> real_tokens;  // the rows out_error compares
};

void check_step(const StepCheck& c, const LayerConfig& config, double out_tolerance, double state_tolerance) {
  INFO("out rel L2 " << c.out_error << ", state rel L2 " << c.state_error << ", conv states off by "
                     << c.conv_difference);
  CHECK(c.out_error <= out_tolerance);
  CHECK(c.state_error <= state_tolerance);
  CHECK(c.conv_difference == 0.0);
  if (config.state_width > 0) CHECK(c.conv_compared > 0);
  CHECK(c.poisoned == 0);
  CHECK(c.nonzero_padding == 0);
  CHECK(c.pool_changed_outside == 0);
  CHECK(c.conv_changed_outside == 0);
}

void print_step(const char* call, const std::string& what, const StepCheck& c) {
  std::printf("CPU layer step %-6s %-92s out %.3e  state %.3e\n", call, what.c_str(), c.out_error, c.state_error);
  std::fflush(stdout);
}

double out_error_of(const StepCheck& c, const Problem& reference_problem) {
  const Reference ref = reference_recurrence(reference_problem);
  return rel_l2(bf16_to_float(token_rows(c.out, c.as_run.H, c.real_tokens)),
                token_rows(ref.out, c.as_run.H, c.real_tokens));
}

// Where a prefill's states come from: pool slots, contiguous
// initial_state / final_state (conv state rows are then the sequences), or
// no recurrent state at all.
enum class StateForm { kPool, kContiguous, kNone };

// fkda_fwd of p (kPrefillLengths) with the layer step on a plan with
// layer_step, and its comparison with the fp64 layer step. Pool calls: slot
// 7 belongs to the zero-length sequence, sequence 3 starts from zeros,
// sequence 4 is padding, checkpoints go to slots 10 (sequence 0 at 32
// tokens) and 4 (sequence 5 at 16), sequence 6's to a null slot.
StepCheck prefill_step(const Problem& p, const LayerConfig& config, PlanOptions options, StateForm form,
                       uint64_t seed) {
  REQUIRE(p.num_seqs() == int64_t(kPrefillLengths.size()));
  options.layer_step = 1;
  const CpuPlan plan(p.H, options);
  const int64_t N = p.num_seqs(), H = p.H;
  const bool by_slot = form == StateForm::kPool;
  const int32_t null = null_index(options.null_rule);
  std::vector<int32_t> slots = {3, 7, 9, 1, null, options.null_rule == FKDA_NULL_SLOT_NONPOSITIVE ? 2 : 0, 5};
  std::vector<uint8_t> has_initial = {1, 1, 1, 0, 1, 1, 1};
  std::vector<int64_t> offsets = {32, -1, -1, -1, 16, 16, 32};
  std::vector<int32_t> checkpoint_slots = {10, null, null, null, 11, 4, null};

  Pool pool(12, H, options.state_dtype, seed);
  const Pool pool_before = pool;
  States initial(options.state_dtype,
                 Pool(N, H, FKDA_DTYPE_F32, seed + 2).states({0, 1, 2, 3, 4, 5, 6}, FKDA_NULL_SLOT_NEGATIVE));
  States final_state(options.state_dtype, std::vector<float>(size_t(N * H * kHeadState), 0.f));
  std::vector<float> checkpoints(size_t(N * H * kHeadState), 0.f);
  LayerBuffers layer(config, H, p.B, p.T, by_slot ? 12 : N, seed + 1);
  const LayerBuffers layer_before = layer;

  StepCheck c;
  c.out = poisoned_out(p);
  Problem inputs = p;
  Buffers b = host_buffers(inputs, c.out.data());
  if (form == StateForm::kContiguous) {
    b.initial_state = initial.data();
    b.final_state = final_state.data();
  }
  fkda_fwd_args args = make_args(inputs, b, options.state_dtype);
  if (form != StateForm::kNone) {
    args.has_initial_state = tensor(has_initial.data(), FKDA_DTYPE_BOOL, {N});
    args.checkpoint_offsets = tensor(offsets.data(), FKDA_DTYPE_I64, {N, 1});
  }
  if (by_slot) {
    args.state_pool = pool.tensor();
    args.state_indices = tensor(slots.data(), FKDA_DTYPE_I32, {N});
    args.checkpoint_slots = tensor(checkpoint_slots.data(), FKDA_DTYPE_I32, {N, 1});
  } else if (form == StateForm::kContiguous) {
    args.checkpoints = tensor(checkpoints.data(), FKDA_DTYPE_F32, {N, 1, H, kD, kD});
  }
  args.layer = layer.tensors();
  FKDA_REQUIRE(plan.fwd(args));

  // The fp64 layer step from the states each sequence reads.
  std::vector<int64_t> real, with_tokens, conv_start(size_t(N), -1);
  std::set<int64_t> padding_tokens, written_slots, written_rows;
  c.as_run = p;
  c.as_run.initial_state.assign(size_t(N * H * kHeadState), 0.f);
  for (int64_t n = 0; n < N; ++n) {
    const bool padding = by_slot && slots[size_t(n)] == null;
    if (padding) {
      for (int64_t t : tokens_of(p, {n})) padding_tokens.insert(t);
      continue;
    }
    real.push_back(n);
    const int64_t row = by_slot ? slots[size_t(n)] : n;
    if (by_slot) written_slots.insert(row);
    if (length_of(p, n) > 0) {
      with_tokens.push_back(n);
      written_rows.insert(row);
    }
    if (form == StateForm::kNone || has_initial[size_t(n)] == 0) continue;
    const std::vector<float> start = by_slot ? pool_before.state(row) : blocks(initial.values(), {n}, size_t(H * kHeadState));
    std::copy(start.begin(), start.end(), c.as_run.initial_state.begin() + std::ptrdiff_t(n * H * kHeadState));
    conv_start[size_t(n)] = row;
  }
  c.as_run.layer = layer_before.reference(conv_start);
  const Reference ref = reference_recurrence(c.as_run, {16, 32});

  c.real_tokens = tokens_of(p, real);
  c.out_error = rel_l2(bf16_to_float(token_rows(c.out, H, c.real_tokens)), token_rows(ref.out, H, c.real_tokens));
  const OutputRows rows = inspect_rows(c.out, H, padding_tokens);
  c.poisoned = rows.poisoned;
  c.nonzero_padding = rows.nonzero_padding;
  if (by_slot) {
    std::vector<int64_t> real_slots;
    for (int64_t n : real) real_slots.push_back(slots[size_t(n)]);
    c.state_error = rel_l2(pool.states(real_slots, options.null_rule), blocks(ref.final_state, real, size_t(H * kHeadState)));
  } else if (form == StateForm::kContiguous) {
    c.state_error = rel_l2(final_state.values(), ref.final_state);
  }

  if (config.state_width > 0) {
    std::vector<int64_t> rows_written;
    for (int64_t n : with_tokens) rows_written.push_back(by_slot ? slots[size_t(n)] : n);
    const std::vector<float> got = layer.state_rows(rows_written);
    c.conv_difference = layer::max_abs_difference(got, conv_blocks(ref.conv_state, with_tokens, layer));
    c.conv_compared = got.size();
    if (by_slot) {
      // Checkpoints: slot 10 holds sequence 0 after 32 tokens, slot 4 sequence 5 after 16.
      const std::vector<float> at_32 = layer.state_rows({10}), at_16 = layer.state_rows({4});
      c.conv_difference = std::max({c.conv_difference,
                                    layer::max_abs_difference(at_32, conv_blocks(ref.conv_states_after[1], {0}, layer)),
                                    layer::max_abs_difference(at_16, conv_blocks(ref.conv_states_after[0], {5}, layer))});
      c.conv_compared += at_32.size() + at_16.size();
    }
  }
  if (by_slot) {
    written_slots.insert({10, 4});
    written_rows.insert({10, 4});
  }
  c.pool_changed_outside = bytes_changed_outside(pool_before, pool, written_slots);
  c.conv_changed_outside = layer.conv_bytes_changed_outside(layer_before, written_rows);
  return c;
}

// fkda_decode of p (kDecodeLengths) with the layer step, from pool slots,
// and its comparison with the fp64 layer step. Slot 8 belongs to the
// zero-length sequence 3, sequence 4 is padding.
StepCheck decode_step(const Problem& p, const LayerConfig& config, const PlanOptions& options, uint64_t seed) {
  REQUIRE(p.num_seqs() == int64_t(kDecodeLengths.size()));
  const CpuPlan plan(p.H, options);
  const int64_t N = p.num_seqs(), H = p.H;
  const int32_t null = null_index(options.null_rule);
  std::vector<int32_t> slots = {6, options.null_rule == FKDA_NULL_SLOT_NONPOSITIVE ? 2 : 0, 3, 8, null, 1, 4};
  Pool pool(10, H, options.state_dtype, seed);
  const Pool pool_before = pool;
  LayerBuffers layer(config, H, p.B, p.T, 10, seed + 1);
  const LayerBuffers layer_before = layer;

  StepCheck c;
  c.out = poisoned_out(p);
  Problem inputs = p;
  fkda_decode_args args = make_decode_args(inputs, host_buffers(inputs, c.out.data()));
  args.state_pool = pool.tensor();
  args.state_indices = tensor(slots.data(), FKDA_DTYPE_I32, {N});
  args.layer = layer.tensors();
  FKDA_REQUIRE(plan.decode(args));

  std::vector<int64_t> real, with_tokens, with_tokens_slots, conv_start(size_t(N), -1);
  std::set<int64_t> padding_tokens, written;
  c.as_run = p;
  c.as_run.initial_state.assign(size_t(N * H * kHeadState), 0.f);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t slot = slots[size_t(n)];
    if (slot == null) {
      for (int64_t t : tokens_of(p, {n})) padding_tokens.insert(t);
      continue;
    }
    real.push_back(n);
    const std::vector<float> start = pool_before.state(slot);
    std::copy(start.begin(), start.end(), c.as_run.initial_state.begin() + std::ptrdiff_t(n * H * kHeadState));
    conv_start[size_t(n)] = slot;
    if (length_of(p, n) == 0) continue;  // touches nothing
    with_tokens.push_back(n);
    with_tokens_slots.push_back(slot);
    written.insert(slot);
  }
  c.as_run.layer = layer_before.reference(conv_start);
  const Reference ref = reference_recurrence(c.as_run);

  c.real_tokens = tokens_of(p, real);
  c.out_error = rel_l2(bf16_to_float(token_rows(c.out, H, c.real_tokens)), token_rows(ref.out, H, c.real_tokens));
  const OutputRows rows = inspect_rows(c.out, H, padding_tokens);
  c.poisoned = rows.poisoned;
  c.nonzero_padding = rows.nonzero_padding;
  c.state_error = rel_l2(pool.states(with_tokens_slots, options.null_rule),
                         blocks(ref.final_state, with_tokens, size_t(H * kHeadState)));
  if (config.state_width > 0) {
    const std::vector<float> got = layer.state_rows(with_tokens_slots);
    c.conv_difference = layer::max_abs_difference(got, conv_blocks(ref.conv_state, with_tokens, layer));
    c.conv_compared = got.size();
  }
  c.pool_changed_outside = bytes_changed_outside(pool_before, pool, written);
  c.conv_changed_outside = layer.conv_bytes_changed_outside(layer_before, written);
  return c;
}

// Every convolution width, conv state width and dtype, each with some of
// the other choices (weight dtype, biases, output gate, norm weight dtype,
// strides), then the output gate alone and the convolution without conv states.
std::vector<LayerConfig> layer_configs() {
  std::vector<LayerConfig> configs;
  int index = 0;
  for (int W : {2, 3, 4}) {
    for (int Wc : {W - 1, W}) {
      for (fkda_dtype state_dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
        LayerConfig c;
        c.width = W;
        c.state_width = Wc;
        c.state_dtype = state_dtype;
        c.weight_dtype = index % 2 == 1 ? FKDA_DTYPE_F32 : FKDA_DTYPE_BF16;
        c.bias = index % 3 != 1;
        c.out_gate = index % 4 != 3;
        c.norm_dtype = index % 2 == 1 ? FKDA_DTYPE_BF16 : FKDA_DTYPE_F32;
        c.strided = index % 5 == 2;
        configs.push_back(c);
        ++index;
      }
    }
  }
  LayerConfig gate_alone;
  gate_alone.out_gate = true;
  configs.push_back(gate_alone);
  LayerConfig without_states;
  without_states.width = 3;
  without_states.weight_dtype = FKDA_DTYPE_F32;
  without_states.bias = true;
  without_states.out_gate = true;
  without_states.strided = true;
  configs.push_back(without_states);
  return configs;
}

PlanOptions options_for(const Problem& p, fkda_dtype state_dtype, fkda_null_slot_rule rule) {
  PlanOptions o;
  o.state_dtype = state_dtype;
  o.null_rule = rule;
  o.gate_mode = p.gate_mode;
  o.beta_mode = p.beta_mode;
  return o;
}

const char* rule_name(fkda_null_slot_rule rule) { return rule == FKDA_NULL_SLOT_NONPOSITIVE ? "<= 0" : "< 0"; }

}  // namespace

TEST_CASE("CPU layer step: every convolution and conv state form against the fp64 layer step", "[cpu][layer]") {
  const std::vector<LayerConfig> configs = layer_configs();
  uint64_t seed = 1000;
  for (const LayerConfig& config : configs) {
    for (fkda_null_slot_rule rule : {FKDA_NULL_SLOT_NEGATIVE, FKDA_NULL_SLOT_NONPOSITIVE}) {
      // The pools alternate between f32 and bf16 with the configurations.
      const fkda_dtype pool_dtype = seed % 4 < 2 ? FKDA_DTYPE_F32 : FKDA_DTYPE_BF16;
      const std::string what = config.name() + ", null slots " + rule_name(rule) + ", " +
                                (pool_dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32") + " pool";
      INFO(what);
      const Problem prefill = slow_inputs(kPrefillLengths, seed);
      const StepCheck fwd = prefill_step(prefill, config, options_for(prefill, pool_dtype, rule), StateForm::kPool, seed);
      print_step("fwd", what, fwd);
      check_step(fwd, config, prefill_out_tolerance(config), state_tolerance(pool_dtype, kPrefillStateF32));

      const Problem step = slow_inputs(kDecodeLengths, seed + 1);
      const StepCheck dec = decode_step(step, config, options_for(step, pool_dtype, rule), seed + 1);
      print_step("decode", what, dec);
      check_step(dec, config, kDecodeOut, state_tolerance(pool_dtype, kDecodeStateF32));
      seed += 2;
    }
  }
}

TEST_CASE("CPU layer step: every gate and beta mode against the fp64 layer step", "[cpu][layer][gate]") {
  const std::vector<LayerConfig> configs = layer_configs();
  const std::vector<GateVariant> prefills = gate_variants(two_heads(kPrefillLengths), 71);
  const std::vector<GateVariant> decodes = gate_variants(two_heads(kDecodeLengths), 81);
  for (size_t i = 0; i < prefills.size(); ++i) {
    // Each gate with another configuration, the null-slot rules alternating.
    const LayerConfig& config = configs[(i * 5) % configs.size()];
    const fkda_null_slot_rule rule = i % 2 == 0 ? FKDA_NULL_SLOT_NEGATIVE : FKDA_NULL_SLOT_NONPOSITIVE;
    const std::string what = prefills[i].name + "; " + config.name();
    INFO(what);
    const StepCheck fwd = prefill_step(prefills[i].p, config, options_for(prefills[i].p, FKDA_DTYPE_F32, rule),
                                       StateForm::kPool, 90 + i);
    print_step("fwd", what, fwd);
    check_step(fwd, config, prefill_out_tolerance(config), kPrefillStateF32);
    const StepCheck dec = decode_step(decodes[i].p, config, options_for(decodes[i].p, FKDA_DTYPE_F32, rule), 110 + i);
    print_step("decode", what, dec);
    check_step(dec, config, kDecodeOut, kDecodeStateF32);
  }
}

TEST_CASE("CPU layer step: fkda_fwd with contiguous states, with none, and chunk-parallel", "[cpu][layer]") {
  const std::vector<LayerConfig> configs = layer_configs();
  struct Case {
    const char* name;
    StateForm form;
    bool chunk_parallel;
    size_t config;
    fkda_dtype state_dtype;
  };
  const Case cases[] = {
      {"contiguous states, conv rows per sequence", StateForm::kContiguous, false, 4, FKDA_DTYPE_F32},
      {"contiguous bf16 states", StateForm::kContiguous, false, 7, FKDA_DTYPE_BF16},
      {"no recurrent state: conv states written, never read", StateForm::kNone, false, 10, FKDA_DTYPE_F32},
      {"chunk-parallel, by slot", StateForm::kPool, true, 2, FKDA_DTYPE_F32},
      {"chunk-parallel, contiguous states", StateForm::kContiguous, true, 9, FKDA_DTYPE_F32},
  };
  uint64_t seed = 300;
  for (const Case& k : cases) {
    const LayerConfig& config = configs[k.config];
    const std::string what = std::string(k.name) + "; " + config.name();
    INFO(what);
    const Problem p = slow_inputs(kPrefillLengths, seed);
    PlanOptions options = options_for(p, k.state_dtype, FKDA_NULL_SLOT_NEGATIVE);
    if (k.chunk_parallel) {
      options.chunk_parallel = FKDA_CHUNK_PARALLEL_ON;
      options.segment_chunks = 1;
    }
    const StepCheck fwd = prefill_step(p, config, options, k.form, seed);
    print_step("fwd", what, fwd);
    check_step(fwd, config, prefill_out_tolerance(config), state_tolerance(k.state_dtype, kPrefillStateF32));
    seed += 3;
  }
}

TEST_CASE("CPU layer step: the output gate's checks bite", "[cpu][layer][mutation]") {
  LayerConfig config = layer_configs()[0];
  REQUIRE(config.out_gate);
  const Problem prefill = slow_inputs(kPrefillLengths, 401);
  const Problem step = slow_inputs(kDecodeLengths, 402);
  const StepCheck fwd =
      prefill_step(prefill, config, options_for(prefill, FKDA_DTYPE_F32, FKDA_NULL_SLOT_NEGATIVE), StateForm::kPool, 403);
  const StepCheck dec = decode_step(step, config, options_for(step, FKDA_DTYPE_F32, FKDA_NULL_SLOT_NEGATIVE), 404);
  check_step(fwd, config, prefill_out_tolerance(config), kPrefillStateF32);
  check_step(dec, config, kDecodeOut, kDecodeStateF32);

  for (const auto& [call, check, tolerance] :
       {std::tuple<const char*, const StepCheck*, double>{"fwd", &fwd, prefill_out_tolerance(config)}, {"decode", &dec, kDecodeOut}}) {
    INFO(call);
    // Each head gated with the next head's g_out.
    Problem other_head = check->as_run;
    const size_t row = size_t(kD), heads = size_t(other_head.H);
    for (size_t token = 0; token < other_head.layer.out_gate.size() / (row * heads); ++token)
      std::rotate(other_head.layer.out_gate.begin() + std::ptrdiff_t(token * heads * row),
                  other_head.layer.out_gate.begin() + std::ptrdiff_t((token * heads + 1) * row),
                  other_head.layer.out_gate.begin() + std::ptrdiff_t((token + 1) * heads * row));
    require_mutation_caught((std::string(call) + ": the output gate of another head").c_str(),
                            out_error_of(*check, other_head), tolerance);
    // The RMSNorm without its weight.
    Problem unweighted = check->as_run;
    std::fill(unweighted.layer.out_norm_weight.begin(), unweighted.layer.out_norm_weight.end(), 1.f);
    require_mutation_caught((std::string(call) + ": RMSNorm without its weight").c_str(),
                            out_error_of(*check, unweighted), tolerance);
  }
}

namespace {

// The tokens [ranges[n].first, ranges[n].second) of each sequence n of p,
// packed into a problem of their own (the out_gate rows with them); no
// initial state nor conv state.
Problem pack(const Problem& p, const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  Problem packed = token_range(p, 0, 0, 0);
  packed.cu_seqlens = {0};
  for (const auto& [begin, end] : ranges) {
    const Problem part = token_range(p, 0, begin, end);
    for (auto [to, from] : {std::pair{&packed.q, &part.q}, {&packed.k, &part.k}, {&packed.v, &part.v},
                            {&packed.g, &part.g}, {&packed.beta, &part.beta},
                            {&packed.layer.out_gate, &part.layer.out_gate}})
      to->insert(to->end(), from->begin(), from->end());
    packed.T += end - begin;
    packed.cu_seqlens.push_back(packed.T);
  }
  return packed;
}

}  // namespace

TEST_CASE("CPU layer step: prefill, decode, decode equal one long prefill, conv states included", "[cpu][layer][chain]") {
  // Three sequences: a prefill of 20, 2 and 33 tokens, then decodes of 1,
  // 4, 2 and 3, 1, 1 tokens, from and into slots 5, 2 and 7.
  const std::vector<int64_t> prefill_lengths = {20, 2, 33}, first_lengths = {1, 4, 2}, second_lengths = {3, 1, 1};
  std::vector<int64_t> lengths;
  for (size_t n = 0; n < 3; ++n) lengths.push_back(prefill_lengths[n] + first_lengths[n] + second_lengths[n]);
  const Problem whole = slow_inputs(lengths, 501);
  LayerConfig config;
  config.width = 4;
  config.state_width = 4;
  config.state_dtype = FKDA_DTYPE_BF16;
  config.bias = true;
  config.out_gate = true;
  std::vector<int32_t> slots = {5, 2, 7};
  const std::vector<int64_t> slot_list(slots.begin(), slots.end());
  Pool pool(8, whole.H, FKDA_DTYPE_F32, 502);
  const Pool pool_before = pool;
  LayerBuffers layer(config, whole.H, 1, whole.T, 8, 503);
  const LayerBuffers layer_before = layer;

  // The three calls, each on its part of every sequence.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> parts(3);
  for (size_t n = 0; n < 3; ++n) {
    int64_t begin = whole.cu_seqlens[n];
    for (size_t call = 0; call < 3; ++call) {
      const int64_t length = (call == 0 ? prefill_lengths : call == 1 ? first_lengths : second_lengths)[n];
      parts[call].push_back({begin, begin + length});
      begin += length;
    }
  }
  const Problem full_layer = [&] {
    Problem p = whole;
    p.layer = layer_before.reference({5, 2, 7});
    return p;
  }();
  std::vector<float> chained_out(size_t(whole.T * whole.H * kD), 0.f);
  std::vector<float> pool_after_prefill, conv_after_prefill;
  std::vector<std::vector<int64_t>> call_tokens(3);
  for (size_t call = 0; call < 3; ++call) {
    Problem part = pack(full_layer, parts[call]);
    std::vector<uint16_t> out = poisoned_out(part);
    fkda_layer_step step = layer.tensors();
    step.out_gate = tensor(part.layer.out_gate.data(), FKDA_DTYPE_BF16, {1, part.T, part.H, kD});
    fkda_status status;
    if (call == 0) {
      PlanOptions options;
      options.layer_step = 1;
      const CpuPlan plan(whole.H, options);
      fkda_fwd_args args = make_args(part, host_buffers(part, out.data()), FKDA_DTYPE_F32);
      args.state_pool = pool.tensor();
      args.state_indices = tensor(slots.data(), FKDA_DTYPE_I32, {3});
      args.layer = step;
      status = plan.fwd(args);
    } else {
      const CpuPlan plan(whole.H);
      fkda_decode_args args = make_decode_args(part, host_buffers(part, out.data()));
      args.state_pool = pool.tensor();
      args.state_indices = tensor(slots.data(), FKDA_DTYPE_I32, {3});
      args.layer = step;
      status = plan.decode(args);
    }
    FKDA_REQUIRE(status);
    CHECK(inspect_rows(out, whole.H, {}).poisoned == 0);
    if (call == 0) {
      pool_after_prefill = pool.states(slot_list, FKDA_NULL_SLOT_NEGATIVE);
      conv_after_prefill = layer.state_rows(slot_list);
    }
    const std::vector<float> values = bf16_to_float(out);
    int64_t packed_token = 0;
    for (const auto& [begin, end] : parts[call]) {
      for (int64_t t = begin; t < end; ++t, ++packed_token) {
        call_tokens[call].push_back(t);
        std::copy(values.begin() + std::ptrdiff_t(packed_token * whole.H * kD),
                  values.begin() + std::ptrdiff_t((packed_token + 1) * whole.H * kD),
                  chained_out.begin() + std::ptrdiff_t(t * whole.H * kD));
      }
    }
  }

  // The fp64 layer step over the whole sequences, from the slots' states;
  // conv states are also kept one token before each prefill's end and at it:
  // sequence n's in conv_states_after[n] and [3 + n].
  Problem as_run = full_layer;
  as_run.initial_state = pool_before.states(slot_list, FKDA_NULL_SLOT_NEGATIVE);
  const Reference ref = reference_recurrence(as_run, {19, 1, 32, 20, 2, 33});
  const size_t conv_block = size_t(whole.H * kD * config.state_width);
  // Each sequence's conv states after its first prefill_lengths[n] + shift tokens, ordered as state_rows.
  auto conv_after_prefill_end = [&](int shift) {
    std::vector<double> expected;
    for (int i = 0; i < 3; ++i)
      for (int64_t n = 0; n < 3; ++n) {
        const std::vector<double> one =
            blocks(ref.conv_states_after[size_t((shift == 0 ? 3 : 0) + n)][size_t(i)], {n}, conv_block);
        expected.insert(expected.end(), one.begin(), one.end());
      }
    return expected;
  };
  const double prefill_error = rel_l2(token_rows(chained_out, whole.H, call_tokens[0]), token_rows(ref.out, whole.H, call_tokens[0]));
  std::vector<int64_t> decoded = call_tokens[1];
  decoded.insert(decoded.end(), call_tokens[2].begin(), call_tokens[2].end());
  const double decode_error = rel_l2(token_rows(chained_out, whole.H, decoded), token_rows(ref.out, whole.H, decoded));
  const double state_error = rel_l2(pool.states(slot_list, FKDA_NULL_SLOT_NEGATIVE), ref.final_state);
  const double conv_difference = layer::max_abs_difference(layer.state_rows(slot_list), conv_blocks(ref.conv_state, {0, 1, 2}, layer));
  const double prefill_conv_difference = layer::max_abs_difference(conv_after_prefill, conv_after_prefill_end(0));
  std::printf("CPU layer step chain: prefill out %.3e, decode out %.3e, final state %.3e, conv states off by %g "
              "after the prefill, %g at the end\n",
              prefill_error, decode_error, state_error, prefill_conv_difference, conv_difference);
  CHECK(prefill_error <= prefill_out_tolerance(config));
  CHECK(decode_error <= kDecodeOut);
  CHECK(state_error <= kPrefillStateF32);
  CHECK(prefill_conv_difference == 0.0);
  CHECK(conv_difference == 0.0);
  const double one_token_short = layer::max_abs_difference(conv_after_prefill, conv_after_prefill_end(-1));
  WARN("mutation check, conv states one token short of the prefill's end: off by " << one_token_short);
  CHECK(one_token_short > 0.1);
  CHECK(bytes_changed_outside(pool_before, pool, {5, 2, 7}) == 0);
  CHECK(layer.conv_bytes_changed_outside(layer_before, {5, 2, 7}) == 0);

  // The first decode against the fp64 layer step of its tokens from the
  // prefill's recurrent states and conv states one token short of the
  // prefill's end.
  Problem first = pack(full_layer, parts[1]);
  first.initial_state = pool_after_prefill;
  for (int i = 0; i < 3; ++i) {
    first.layer.conv_state[i].clear();
    for (size_t n = 0; n < 3; ++n) {
      const std::vector<double> short_state = blocks(ref.conv_states_after[n][size_t(i)], {int64_t(n)}, conv_block);
      first.layer.conv_state[i].insert(first.layer.conv_state[i].end(), short_state.begin(), short_state.end());
    }
  }
  const std::vector<float> first_out = token_rows(chained_out, whole.H, call_tokens[1]);
  const double off_by_one = rel_l2(first_out, reference_recurrence(first).out);
  require_mutation_caught("the first decode from conv states one token short", off_by_one, kDecodeOut);
}

TEST_CASE("CPU layer step: q, k and v as views into one packed projection buffer", "[cpu][layer]") {
  const Problem p = slow_inputs(kPrefillLengths, 601);
  LayerConfig config = layer_configs()[5];
  REQUIRE(config.width > 0);
  PlanOptions options;
  options.layer_step = 1;
  const CpuPlan plan(p.H, options);
  const int64_t N = p.num_seqs(), channels = p.H * kD;
  // [T, 3 * H * K]: q, k and v of a token side by side, as one linear layer writes them.
  std::vector<uint16_t> packed(size_t(p.T * 3 * channels));
  for (int64_t t = 0; t < p.T; ++t)
    for (int i = 0; i < 3; ++i) {
      const std::vector<uint16_t>& from = i == 0 ? p.q : i == 1 ? p.k : p.v;
      std::copy(from.begin() + std::ptrdiff_t(t * channels), from.begin() + std::ptrdiff_t((t + 1) * channels),
                packed.begin() + std::ptrdiff_t((t * 3 + i) * channels));
    }
  std::vector<int32_t> slots = {3, 7, 9, 1, -1, 0, 5};

  auto run = [&](bool views, Pool& pool, LayerBuffers& layer) {
    Problem inputs = p;
    std::vector<uint16_t> out = poisoned_out(p);
    fkda_fwd_args args = make_args(inputs, host_buffers(inputs, out.data()), FKDA_DTYPE_F32);
    if (views) {
      fkda_tensor* qkv[] = {&args.q, &args.k, &args.v};
      for (int i = 0; i < 3; ++i) {
        qkv[i]->data = packed.data() + i * channels;
        qkv[i]->strides[0] = p.T * 3 * channels;
        qkv[i]->strides[1] = 3 * channels;
      }
    }
    args.state_pool = pool.tensor();
    args.state_indices = tensor(slots.data(), FKDA_DTYPE_I32, {N});
    args.layer = layer.tensors();
    FKDA_REQUIRE(plan.fwd(args));
    return out;
  };
  Pool separate_pool(12, p.H, FKDA_DTYPE_F32, 602), views_pool = separate_pool;
  LayerBuffers separate_layer(config, p.H, p.B, p.T, 12, 603), views_layer = separate_layer;
  const std::vector<uint16_t> separate_out = run(false, separate_pool, separate_layer);
  const std::vector<uint16_t> views_out = run(true, views_pool, views_layer);
  CHECK(separate_out == views_out);
  CHECK(bytes_changed_outside(separate_pool, views_pool, {}) == 0);
  CHECK(views_layer.conv_bytes_changed_outside(separate_layer, {}) == 0);
}

TEST_CASE("CPU layer step: the three conv states as channel blocks of one pool tensor", "[cpu][layer]") {
  const Problem p = slow_inputs(kPrefillLengths, 651);
  LayerConfig config = layer_configs()[4];
  REQUIRE(config.state_width > 0);
  PlanOptions options;
  options.layer_step = 1;
  const CpuPlan plan(p.H, options);
  const int64_t N = p.num_seqs(), channels = p.H * kD, Wc = config.state_width, rows = 12;
  const std::vector<int32_t> slots = {3, 7, 9, 1, -1, 0, 5};
  LayerBuffers separate(config, p.H, p.B, p.T, rows, 652);
  // One [rows, 3 * H * K, Wc] f32 pool holding the same values, channel-last
  // as well as channel-first.
  for (bool channel_last : {false, true}) {
    DYNAMIC_SECTION((channel_last ? "channel-last" : "channel-first")) {
      REQUIRE(config.state_dtype == FKDA_DTYPE_F32);
      std::vector<float> whole(size_t(rows * 3 * channels * Wc));
      const int64_t stride_c = channel_last ? 1 : Wc, stride_w = channel_last ? 3 * channels : 1;
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < 3; ++i)
          for (int64_t c = 0; c < channels; ++c)
            for (int64_t j = 0; j < Wc; ++j)
              whole[size_t(r * 3 * channels * Wc + (i * channels + c) * stride_c + j * stride_w)] =
                  separate.states[i].at({r, c, j});
      auto run = [&](LayerBuffers& layer, bool packed, Pool& pool) {
        Problem inputs = p;
        std::vector<uint16_t> out = poisoned_out(p);
        fkda_fwd_args args = make_args(inputs, host_buffers(inputs, out.data()), FKDA_DTYPE_F32);
        args.state_pool = pool.tensor();
        args.state_indices = tensor(const_cast<int32_t*>(slots.data()), FKDA_DTYPE_I32, {N});
        args.layer = layer.tensors();
        if (packed) {
          fkda_tensor* views[] = {&args.layer.conv_state_q, &args.layer.conv_state_k, &args.layer.conv_state_v};
          for (int i = 0; i < 3; ++i) {
            *views[i] = tensor(whole.data() + i * channels * stride_c, FKDA_DTYPE_F32, {rows, channels, Wc});
            views[i]->strides[0] = 3 * channels * Wc;
            views[i]->strides[1] = stride_c;
            views[i]->strides[2] = stride_w;
          }
          FKDA_REQUIRE(plan.fwd(args));
          // One channel off: k's block overlaps q's and is refused.
          views[1]->data = whole.data() + (channels - 1) * stride_c;
          expect_invalid(plan.fwd(args), "layer.conv_state_k");
        } else {
          FKDA_REQUIRE(plan.fwd(args));
        }
        return out;
      };
      LayerBuffers reference_layer = separate, packed_layer = separate;
      Pool reference_pool(rows, p.H, FKDA_DTYPE_F32, 653), packed_pool = reference_pool;
      const std::vector<uint16_t> reference_out = run(reference_layer, false, reference_pool);
      const std::vector<uint16_t> packed_out = run(packed_layer, true, packed_pool);
      CHECK(reference_out == packed_out);
      CHECK(bytes_changed_outside(reference_pool, packed_pool, {}) == 0);
      for (int64_t r = 0; r < rows; ++r)
        for (int i = 0; i < 3; ++i)
          for (int64_t c = 0; c < channels; ++c)
            for (int64_t j = 0; j < Wc; ++j)
              REQUIRE(whole[size_t(r * 3 * channels * Wc + (i * channels + c) * stride_c + j * stride_w)] ==
                      reference_layer.states[i].at({r, c, j}));
    }
  }
}

TEST_CASE("CPU layer step: plans with layer_step compute the plain recurrence and the output gate unchanged",
          "[cpu][layer]") {
  const Problem p = slow_inputs(kPrefillLengths, 701);
  LayerConfig gate_alone;
  gate_alone.out_gate = true;
  for (bool with_gate : {false, true}) {
    DYNAMIC_SECTION((with_gate ? "output gate" : "no layer step")) {
      std::vector<std::vector<uint16_t>> outs;
      for (int32_t layer_step : {0, 1}) {
        PlanOptions options;
        options.layer_step = layer_step;
        const CpuPlan plan(p.H, options);
        Problem inputs = p;
        std::vector<uint16_t> out = poisoned_out(p);
        fkda_fwd_args args = make_args(inputs, host_buffers(inputs, out.data()), FKDA_DTYPE_F32);
        LayerBuffers layer(gate_alone, p.H, p.B, p.T, 0, 702);
        if (with_gate) args.layer = layer.tensors();
        FKDA_REQUIRE(plan.fwd(args));
        outs.push_back(out);
      }
      CHECK(outs[0] == outs[1]);
      CHECK(inspect_rows(outs[0], p.H, {}).poisoned == 0);
    }
  }
}
