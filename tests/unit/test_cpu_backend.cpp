// SPDX-License-Identifier: MIT
// The CPU backend through the public API only, against the fp64 token-by-token
// recurrence on random inputs. Every run poisons its outputs first and checks
// that every element was written and nothing outside the views was touched.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"
#include "resource_owners.h"
#include "serving_support.h"

namespace {

using namespace fkda_ref;

// bf16 and f32 quiet NaNs with a payload no computation produces.
constexpr uint16_t kPoisonBf16 = 0x7FC1;
constexpr uint32_t kPoisonF32 = 0x7FC00001u;

float poison_f32() {
  float poison;
  std::memcpy(&poison, &kPoisonF32, sizeof poison);
  return poison;
}

// Every test of state handling runs on both kinds of input: the default fast
// decays, and slow decays where the initial state and every hand-off matter.
enum class Decay { fast, slow };
constexpr Decay kDecays[] = {Decay::fast, Decay::slow};

ProblemShape with_decay(ProblemShape shape, Decay decay) { return decay == Decay::slow ? slow_decay(shape) : shape; }

AccuracyTargets targets_for(fkda_dtype state_dtype, Decay decay = Decay::fast) {
  return accuracy_targets(state_dtype, decay == Decay::slow);
}

const char* decay_name(Decay decay) { return decay == Decay::slow ? "slow decay" : "fast decay"; }

enum class Layout { contiguous, padded, head_major };

struct RunOptions {
  fkda_dtype state_dtype = FKDA_DTYPE_F32;
  fkda_state_layout state_layout = FKDA_STATE_LAYOUT_VK;
  bool pass_initial = true;  // pass the problem's initial state (when it has one)
  bool want_final = true;
  bool in_place_state = false;              // final_state is the initial_state buffer
  Layout layout = Layout::contiguous;       // q, k, v, g, out
  Layout beta_layout = Layout::contiguous;  // beta's strides are free, independently
  fkda_dtype cu_dtype = FKDA_DTYPE_I64;
  int64_t cu_stride = 1;
  bool set_lower_bound_after_create = false;  // through fkda_set_lower_bound
};

const char* layout_name(Layout layout) {
  return layout == Layout::contiguous ? "contiguous" : layout == Layout::padded ? "padded" : "head-major";
}

std::string describe(const RunOptions& o) {
  std::ostringstream s;
  s << "state " << (o.state_dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32") << ", layout "
    << (o.state_layout == FKDA_STATE_LAYOUT_KV ? "KV" : "VK") << ", initial " << o.pass_initial << ", final "
    << o.want_final << ", in place " << o.in_place_state << ", activations " << layout_name(o.layout)
    << ", beta " << layout_name(o.beta_layout) << ", cu_seqlens "
    << (o.cu_dtype == FKDA_DTYPE_I32 ? "i32" : "i64") << " stride " << o.cu_stride;
  return s.str();
}

struct RunResult {
  std::vector<float> out;          // [B, T, H, V], contiguous
  std::vector<float> final_state;  // [N, H, V, K] V-first; empty when not requested
};

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Compares without Catch printing megabytes of elements on failure.
template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a == b;
}

bool is_poison(uint16_t bits) { return bits == kPoisonBf16; }

// An activation [B, T, H, D] (D = 1 for beta) of bf16 bits or f32 values
// placed in memory with the chosen strides; the gaps hold NaNs, so reading
// them would show in the output.
template <typename Element>
struct Placed {
  std::vector<Element> storage;
  std::vector<size_t> offsets;  // storage offset of element i of the contiguous tensor
  int64_t stride_b = 0, stride_t = 0, stride_h = 0;
  std::vector<int64_t> shape;

  fkda_tensor view() {
    fkda_tensor t = tensor(storage.data(), std::is_same_v<Element, float> ? FKDA_DTYPE_F32 : FKDA_DTYPE_BF16, shape);
    t.strides[0] = stride_b;
    t.strides[1] = stride_t;
    t.strides[2] = stride_h;
    return t;
  }
};

// Nothing is placed for an empty vector (a g or beta the problem passes in the other dtype).
template <typename Element>
Placed<Element> place(const std::vector<Element>& contiguous, int64_t B, int64_t T, int64_t H, int64_t D,
                      Layout layout, Element gap_fill) {
  Placed<Element> placed;
  if (contiguous.empty()) return placed;
  placed.shape = D == 1 ? std::vector<int64_t>{B, T, H} : std::vector<int64_t>{B, T, H, D};
  size_t size = 0;
  switch (layout) {
    case Layout::contiguous:
      placed.stride_h = D;
      placed.stride_t = H * D;
      placed.stride_b = T * H * D;
      size = size_t(B * T * H * D);
      break;
    case Layout::padded:  // gaps between heads, tokens and batch rows
      placed.stride_h = D + (D == 1 ? 2 : 8);
      placed.stride_t = H * placed.stride_h + 24;
      placed.stride_b = T * placed.stride_t + 40;
      size = size_t(B * placed.stride_b + 16);
      break;
    case Layout::head_major:  // memory is [B, H, T, D], viewed as [B, T, H, D]
      placed.stride_t = D;
      placed.stride_h = T * D;
      placed.stride_b = H * T * D;
      size = size_t(B * T * H * D);
      break;
  }
  placed.storage.assign(size, gap_fill);
  placed.offsets.reserve(contiguous.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const size_t at = size_t(b * placed.stride_b + t * placed.stride_t + h * placed.stride_h + d);
          placed.storage[at] = contiguous[placed.offsets.size()];
          placed.offsets.push_back(at);
        }
  return placed;
}

// The state [N, H, V, K] (V-first, f32 values) in the caller's dtype and layout.
struct StateBuffer {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  fkda_dtype dtype;
  void* data() { return dtype == FKDA_DTYPE_BF16 ? static_cast<void*>(bf16.data()) : f32.data(); }
};

size_t layout_index(fkda_state_layout layout, size_t head_base, int64_t e, int64_t k, int64_t V, int64_t K) {
  return head_base + size_t(layout == FKDA_STATE_LAYOUT_KV ? k * V + e : e * K + k);
}

StateBuffer state_buffer(const Problem& p, const std::vector<float>* values_vk, fkda_dtype dtype,
                         fkda_state_layout layout) {
  StateBuffer buffer{{}, {}, dtype};
  const size_t count = size_t(p.state_elems());
  if (dtype == FKDA_DTYPE_BF16)
    buffer.bf16.assign(count, kPoisonBf16);
  else
    buffer.f32.assign(count, poison_f32());
  if (values_vk == nullptr) return buffer;
  size_t not_bf16 = 0;
  for (int64_t head = 0; head < p.num_seqs() * p.H; ++head) {
    const size_t base = size_t(head * p.V * p.K);
    for (int64_t e = 0; e < p.V; ++e)
      for (int64_t k = 0; k < p.K; ++k) {
        const float value = (*values_vk)[base + size_t(e * p.K + k)];
        const size_t at = layout_index(layout, base, e, k, p.V, p.K);
        if (dtype == FKDA_DTYPE_BF16) {
          if (from_bf16(to_bf16(value)) != value) ++not_bf16;
          buffer.bf16[at] = to_bf16(value);
        } else {
          buffer.f32[at] = value;
        }
      }
  }
  // The reference must see the state the backend sees: tests round bf16 states up front.
  REQUIRE(not_bf16 == 0);
  return buffer;
}

// Every element finite (written), returned V-first in f32.
std::vector<float> read_state(const Problem& p, const StateBuffer& buffer, fkda_state_layout layout) {
  std::vector<float> values(size_t(p.state_elems()));
  size_t unwritten = 0;
  for (int64_t head = 0; head < p.num_seqs() * p.H; ++head) {
    const size_t base = size_t(head * p.V * p.K);
    for (int64_t e = 0; e < p.V; ++e)
      for (int64_t k = 0; k < p.K; ++k) {
        const size_t at = layout_index(layout, base, e, k, p.V, p.K);
        const float value = buffer.dtype == FKDA_DTYPE_BF16 ? from_bf16(buffer.bf16[at]) : buffer.f32[at];
        if (!std::isfinite(value)) ++unwritten;
        values[base + size_t(e * p.K + k)] = value;
      }
  }
  CHECK(unwritten == 0);
  return values;
}

void round_initial_state_to_bf16(Problem& p) {
  for (float& value : p.initial_state) value = from_bf16(to_bf16(value));
}

// A varlen problem of these decays, its initial state rounded to bf16 so that
// it serves both state dtypes.
Problem varlen_problem(int64_t H, std::vector<int64_t> lengths, Decay decay, uint64_t seed) {
  ProblemShape shape;
  shape.H = H;
  shape.lengths = std::move(lengths);
  Problem p = random_problem(with_decay(shape, decay), seed);
  round_initial_state_to_bf16(p);
  return p;
}

// Runs `p` on a CPU plan through the public API and checks what every run
// must satisfy: success, every output element written, nothing outside the
// output views touched, inputs unchanged.
RunResult run_cpu(const Problem& p, const RunOptions& o) {
  INFO(describe(o));
  const int64_t N = p.num_seqs();
  const bool has_initial = o.pass_initial && !p.initial_state.empty();

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.num_heads = static_cast<int32_t>(p.H);
  desc.state_dtype = o.state_dtype;
  desc.state_layout = o.state_layout;
  desc.backend = FKDA_BACKEND_CPU;
  apply_gate(p, &desc);
  if (o.set_lower_bound_after_create) desc.lower_bound = -5.f;
  const fkda_ref::Plan plan(desc);
  fkda_backend backend = FKDA_BACKEND_AUTO;
  REQUIRE(fkda_plan_get_backend(plan.get(), &backend) == FKDA_SUCCESS);
  REQUIRE(backend == FKDA_BACKEND_CPU);
  if (o.set_lower_bound_after_create) {
    REQUIRE(fkda_set_lower_bound(plan.get(), p.lower_bound) == FKDA_SUCCESS);
    float lower_bound = 1.f;
    REQUIRE(fkda_get_lower_bound(plan.get(), &lower_bound) == FKDA_SUCCESS);
    REQUIRE(lower_bound == p.lower_bound);
  }

  Placed<uint16_t> q = place(p.q, p.B, p.T, p.H, p.K, o.layout, kPoisonBf16);
  Placed<uint16_t> k = place(p.k, p.B, p.T, p.H, p.K, o.layout, kPoisonBf16);
  Placed<uint16_t> v = place(p.v, p.B, p.T, p.H, p.V, o.layout, kPoisonBf16);
  // g and beta in whichever dtype the problem passes them.
  Placed<uint16_t> g = place(p.g, p.B, p.T, p.H, p.K, o.layout, kPoisonBf16);
  Placed<float> g_f32 = place(p.g_f32, p.B, p.T, p.H, p.K, o.layout, poison_f32());
  Placed<uint16_t> beta = place(p.beta, p.B, p.T, p.H, 1, o.beta_layout, kPoisonBf16);
  Placed<float> beta_f32 = place(p.beta_f32, p.B, p.T, p.H, 1, o.beta_layout, poison_f32());
  Placed<uint16_t> out = place(std::vector<uint16_t>(p.B * p.T * p.H * p.V, kPoisonBf16), p.B, p.T, p.H, p.V,
                               o.layout, kPoisonBf16);
  const std::vector<uint16_t> q_before = q.storage, k_before = k.storage, v_before = v.storage,
                              g_before = g.storage, beta_before = beta.storage;
  const std::vector<float> g_f32_before = g_f32.storage, beta_f32_before = beta_f32.storage;
  std::vector<float> A_log = p.A_log, dt_bias = p.dt_bias;

  StateBuffer initial =
      state_buffer(p, has_initial ? &p.initial_state : nullptr, o.state_dtype, o.state_layout);
  StateBuffer separate_final = state_buffer(p, nullptr, o.state_dtype, o.state_layout);
  StateBuffer& final_state = o.in_place_state ? initial : separate_final;

  Buffers buffers{q.storage.data(),    k.storage.data(), v.storage.data(), g.storage.data(),
                  beta.storage.data(), A_log.data(),     dt_bias.data(),   out.storage.data()};
  if (has_initial) buffers.initial_state = initial.data();
  if (o.want_final) buffers.final_state = final_state.data();
  fkda_fwd_args args = make_args(p, buffers, o.state_dtype);
  args.q = q.view();
  args.k = k.view();
  args.v = v.view();
  args.g = p.g_f32.empty() ? g.view() : g_f32.view();
  args.beta = p.beta_f32.empty() ? beta.view() : beta_f32.view();
  args.out = out.view();

  // cu_seqlens in the requested dtype and stride, gaps filled with offsets
  // that would be out of range if they were read.
  std::vector<int64_t> cu_i64;
  std::vector<int32_t> cu_i32;
  if (!p.cu_seqlens.empty()) {
    const size_t count = p.cu_seqlens.size(), slots = (count - 1) * size_t(o.cu_stride) + 1;
    if (o.cu_dtype == FKDA_DTYPE_I32) {
      cu_i32.assign(slots, 1 << 30);
      for (size_t i = 0; i < count; ++i) cu_i32[i * size_t(o.cu_stride)] = int32_t(p.cu_seqlens[i]);
      args.cu_seqlens = tensor(cu_i32.data(), FKDA_DTYPE_I32, {int64_t(count)});
    } else {
      cu_i64.assign(slots, int64_t(1) << 40);
      for (size_t i = 0; i < count; ++i) cu_i64[i * size_t(o.cu_stride)] = p.cu_seqlens[i];
      args.cu_seqlens = tensor(cu_i64.data(), FKDA_DTYPE_I64, {int64_t(count)});
    }
    args.cu_seqlens.strides[0] = o.cu_stride;
  }

  size_t workspace_bytes = 0;
  REQUIRE(fkda_plan_workspace_size(plan.get(), p.B * p.T, N, &workspace_bytes) == FKDA_SUCCESS);
  std::vector<unsigned char> workspace(workspace_bytes + 16);
  const fkda_status status = fkda_fwd(plan.get(), &args, workspace.data(), workspace_bytes, nullptr);
  INFO("fkda_last_error: " << fkda_last_error());
  REQUIRE(status == FKDA_SUCCESS);

  RunResult result;
  result.out.resize(out.offsets.size());
  size_t unwritten = 0, touched_gaps = 0;
  std::vector<bool> in_view(out.storage.size(), false);
  for (size_t i = 0; i < out.offsets.size(); ++i) {
    const uint16_t bits = out.storage[out.offsets[i]];
    in_view[out.offsets[i]] = true;
    result.out[i] = from_bf16(bits);
    if (!std::isfinite(result.out[i])) ++unwritten;
  }
  for (size_t at = 0; at < out.storage.size(); ++at)
    if (!in_view[at] && !is_poison(out.storage[at])) ++touched_gaps;
  CHECK(unwritten == 0);
  CHECK(touched_gaps == 0);

  CHECK(same(q.storage, q_before));
  CHECK(same(k.storage, k_before));
  CHECK(same(v.storage, v_before));
  CHECK(same(g.storage, g_before));
  CHECK(same(beta.storage, beta_before));
  // NaN gaps compare unequal as floats: compare the bits.
  CHECK(std::memcmp(g_f32.storage.data(), g_f32_before.data(), g_f32_before.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(beta_f32.storage.data(), beta_f32_before.data(), beta_f32_before.size() * sizeof(float)) == 0);
  CHECK(same(A_log, p.A_log));
  CHECK(same(dt_bias, p.dt_bias));
  if (has_initial && !o.in_place_state) {
    const StateBuffer untouched = state_buffer(p, &p.initial_state, o.state_dtype, o.state_layout);
    CHECK(same(initial.f32, untouched.f32));  // f32 values are finite, so == is exact here
    CHECK(same(initial.bf16, untouched.bf16));
  }
  if (o.want_final) result.final_state = read_state(p, final_state, o.state_layout);
  return result;
}

struct Errors {
  double out = 0;
  double state = 0;
};

Errors check_accuracy(const Problem& p, const RunOptions& o, const RunResult& r, AccuracyTargets tolerance) {
  Problem as_run = p;
  if (!o.pass_initial) as_run.initial_state.clear();
  const Reference ref = reference_recurrence(as_run);
  Errors errors;
  errors.out = rel_l2(r.out, ref.out);
  INFO(describe(o));
  INFO("out rel L2 " << errors.out << " (target " << tolerance.out << ")");
  CHECK(errors.out <= tolerance.out);
  if (o.want_final) {
    errors.state = rel_l2(r.final_state, ref.final_state);
    INFO("final state rel L2 " << errors.state << " (target " << tolerance.state << ")");
    CHECK(errors.state <= tolerance.state);
  }
  return errors;
}

// The final state of sequence n, V-first.
std::vector<float> sequence_state(const Problem& p, const std::vector<float>& state, int64_t n) {
  const size_t per_sequence = size_t(p.H * p.V * p.K);
  return std::vector<float>(state.begin() + std::ptrdiff_t(n * per_sequence),
                            state.begin() + std::ptrdiff_t((n + 1) * per_sequence));
}

// docs/BENCHMARKS.md's accuracy case: T=1024 H=4, and varlen [300, 77, 700] H=4.
std::vector<ProblemShape> benchmark_accuracy_shapes() {
  ProblemShape dense, varlen;
  dense.H = varlen.H = 4;
  dense.T = 1024;
  varlen.lengths = {300, 77, 700};
  return {dense, varlen};
}

// Tokens [begin, end) of a single-row problem's [1, T, H, V] output.
std::vector<double> token_range(const Problem& p, const std::vector<double>& out, int64_t begin, int64_t end) {
  const int64_t per_token = p.H * p.V;
  return std::vector<double>(out.begin() + std::ptrdiff_t(begin * per_token),
                             out.begin() + std::ptrdiff_t(end * per_token));
}

// How far a mutated run must miss its target: a check that a mutation
// passes, or misses by little, could not tell a lost state from rounding.
constexpr double kWideMargin = 10.0;

}  // namespace

TEST_CASE("CPU backend meets the f32-state accuracy targets on the benchmark case", "[cpu][accuracy]") {
  for (const ProblemShape& shape : benchmark_accuracy_shapes()) {
    const Problem p = random_problem(shape, 20261130);
    RunOptions o;
    o.state_dtype = FKDA_DTYPE_F32;
    check_accuracy(p, o, run_cpu(p, o), targets_for(FKDA_DTYPE_F32));
  }
}

TEST_CASE("CPU backend meets the bf16-state accuracy targets on the benchmark case", "[cpu][accuracy]") {
  for (const ProblemShape& shape : benchmark_accuracy_shapes()) {
    Problem p = random_problem(shape, 20261130);
    round_initial_state_to_bf16(p);
    RunOptions o;
    o.state_dtype = FKDA_DTYPE_BF16;
    check_accuracy(p, o, run_cpu(p, o), targets_for(FKDA_DTYPE_BF16));
  }
}

TEST_CASE("CPU backend: batched rows of lengths around the chunk size", "[cpu][batched]") {
  for (int64_t T : {1, 15, 16, 17, 40}) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      CAPTURE(T);
      ProblemShape shape;
      shape.B = 3;
      shape.T = T;
      shape.H = 2;
      Problem p = random_problem(shape, 100 + uint64_t(T));
      if (dtype == FKDA_DTYPE_BF16) round_initial_state_to_bf16(p);
      RunOptions o;
      o.state_dtype = dtype;
      o.state_layout = T % 2 ? FKDA_STATE_LAYOUT_KV : FKDA_STATE_LAYOUT_VK;
      check_accuracy(p, o, run_cpu(p, o), targets_for(dtype));
    }
  }
}

TEST_CASE("CPU backend: varlen with empty, single-token and chunk-edge sequences", "[cpu][varlen][state]") {
  for (Decay decay : kDecays) {
    INFO(decay_name(decay));
    const Problem p = varlen_problem(8, {0, 1, 15, 16, 17, 0, 33, 5}, decay, 77);
    for (fkda_dtype cu_dtype : {FKDA_DTYPE_I64, FKDA_DTYPE_I32}) {
      for (fkda_dtype state_dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
        RunOptions o;
        o.cu_dtype = cu_dtype;
        o.state_dtype = state_dtype;
        const RunResult r = run_cpu(p, o);
        check_accuracy(p, o, r, targets_for(state_dtype, decay));
        // An empty sequence hands its initial state through unchanged.
        for (int64_t n : {0, 5})
          CHECK(bitwise_equal(sequence_state(p, r.final_state, n), sequence_state(p, p.initial_state, n)));
      }
    }
  }
}

TEST_CASE("CPU backend: every presence combination of initial and final state", "[cpu][state]") {
  for (Decay decay : kDecays) {
    INFO(decay_name(decay));
    const Problem p = varlen_problem(2, {17, 0, 40}, decay, 4242);
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
        for (bool pass_initial : {true, false}) {
          for (bool want_final : {true, false}) {
            RunOptions o;
            o.state_dtype = dtype;
            o.state_layout = layout;
            o.pass_initial = pass_initial;
            o.want_final = want_final;
            const RunResult r = run_cpu(p, o);
            check_accuracy(p, o, r, targets_for(dtype, decay));
            if (want_final) {
              const std::vector<float> empty_sequence = sequence_state(p, r.final_state, 1);
              if (pass_initial) {
                CHECK(bitwise_equal(empty_sequence, sequence_state(p, p.initial_state, 1)));
              } else {
                CHECK(bitwise_equal(empty_sequence, std::vector<float>(empty_sequence.size(), 0.f)));
              }
            }
          }
        }
      }
    }
  }
}

TEST_CASE("CPU backend: the K-first state layout is the transpose of the V-first one", "[cpu][state]") {
  for (Decay decay : kDecays) {
    INFO(decay_name(decay));
    const Problem p = varlen_problem(3, {23, 9}, decay, 31337);
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      RunOptions v_first, k_first;
      v_first.state_dtype = k_first.state_dtype = dtype;
      k_first.state_layout = FKDA_STATE_LAYOUT_KV;
      // run_cpu writes and reads the K-first buffers transposed; equal results
      // mean the backend read and wrote them transposed too.
      const RunResult a = run_cpu(p, v_first), b = run_cpu(p, k_first);
      check_accuracy(p, k_first, b, targets_for(dtype, decay));
      CHECK(bitwise_equal(a.out, b.out));
      CHECK(bitwise_equal(a.final_state, b.final_state));
    }
  }
}

TEST_CASE("CPU backend: the final state may overwrite the initial state in place", "[cpu][state]") {
  for (Decay decay : kDecays) {
    INFO(decay_name(decay));
    const Problem p = varlen_problem(2, {30, 0, 18}, decay, 5150);
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      RunOptions separate, in_place;
      separate.state_dtype = in_place.state_dtype = dtype;
      in_place.in_place_state = true;
      const RunResult a = run_cpu(p, separate), b = run_cpu(p, in_place);
      check_accuracy(p, in_place, b, targets_for(dtype, decay));
      CHECK(bitwise_equal(a.out, b.out));
      CHECK(bitwise_equal(a.final_state, b.final_state));
    }
  }
}

TEST_CASE("CPU backend: strided q, k, v, g and out views", "[cpu][strides]") {
  for (Layout layout : {Layout::padded, Layout::head_major}) {
    for (bool varlen : {false, true}) {
      ProblemShape shape;
      shape.H = 3;
      if (varlen) {
        shape.lengths = {5, 0, 29};
      } else {
        shape.B = 2;
        shape.T = 37;
      }
      const Problem p = random_problem(shape, 9000 + uint64_t(varlen));
      RunOptions contiguous, strided;
      strided.layout = layout;
      const RunResult r = run_cpu(p, strided);
      check_accuracy(p, strided, r, targets_for(FKDA_DTYPE_F32));
      // Strides change where the data lives, not a single bit of the result.
      const RunResult reference_layout = run_cpu(p, contiguous);
      CHECK(bitwise_equal(r.out, reference_layout.out));
      CHECK(bitwise_equal(r.final_state, reference_layout.final_state));
    }
  }
}

// flashkda.h: beta's strides are free and cu_seqlens may be a strided view.
TEST_CASE("CPU backend: strided beta and cu_seqlens views", "[cpu][strides]") {
  ProblemShape shape;
  shape.H = 3;
  shape.lengths = {5, 0, 29, 16};
  const Problem p = random_problem(shape, 9100);
  const RunResult contiguous = run_cpu(p, RunOptions{});
  check_accuracy(p, RunOptions{}, contiguous, targets_for(FKDA_DTYPE_F32));
  // beta with gaps between heads and tokens; beta stored head-major;
  // cu_seqlens with a stride of 3, as i64 and as i32.
  std::vector<RunOptions> variants(4);
  variants[0].beta_layout = Layout::padded;
  variants[1].beta_layout = Layout::head_major;
  variants[2].cu_stride = variants[3].cu_stride = 3;
  variants[3].cu_dtype = FKDA_DTYPE_I32;
  for (const RunOptions& o : variants) {
    const RunResult r = run_cpu(p, o);
    CHECK(bitwise_equal(r.out, contiguous.out));
    CHECK(bitwise_equal(r.final_state, contiguous.final_state));
  }
}

TEST_CASE("CPU backend: gate floors from -5 to 0", "[cpu][lower_bound]") {
  SECTION("given at plan creation") {
    for (float lower_bound : {-5.f, -2.5f, -0.5f, -1e-6f, 0.f}) {
      CAPTURE(lower_bound);
      ProblemShape shape;
      shape.H = 2;
      shape.lengths = {20, 45};
      shape.lower_bound = lower_bound;
      const Problem p = random_problem(shape, 600);
      RunOptions o;
      check_accuracy(p, o, run_cpu(p, o), targets_for(FKDA_DTYPE_F32));
    }
  }
  SECTION("set on an existing plan") {
    ProblemShape shape;
    shape.H = 2;
    shape.lengths = {20, 45};
    shape.lower_bound = -1.25f;
    const Problem p = random_problem(shape, 601);
    RunOptions o;
    o.set_lower_bound_after_create = true;  // the plan is created at -5
    check_accuracy(p, o, run_cpu(p, o), targets_for(FKDA_DTYPE_F32));
  }
}

TEST_CASE("CPU backend: saturated gates scale the keys of a chunk by up to 2^115", "[cpu][saturated]") {
  // Gate logits far above 0 drive the sigmoid to exactly 1: every token
  // decays by the full floor, a chunk's cumulative gate reaches 16 * -5 nats
  // and its key factors 2^±115 (docs/NUMERICS.md step 3), near the end of
  // bf16's range. Every chunk saturated, and saturated chunks alternating
  // with slowly decaying ones (the state crosses from one kind to the other).
  ProblemShape shape = slow_decay(ProblemShape{});
  shape.H = 2;
  shape.lengths = {16, 40, 0, 75};
  for (bool every_chunk : {true, false}) {
    Problem p = random_problem(shape, 1150 + uint64_t(every_chunk));
    round_initial_state_to_bf16(p);
    for (size_t n = 0; n + 1 < p.cu_seqlens.size(); ++n)
      for (int64_t t = p.cu_seqlens[n]; t < p.cu_seqlens[n + 1]; ++t) {
        if (!every_chunk && ((t - p.cu_seqlens[n]) / 16) % 2 == 1) continue;
        for (int64_t i = t * p.H * p.K; i < (t + 1) * p.H * p.K; ++i) p.g[size_t(i)] = to_bf16(from_bf16(p.g[size_t(i)]) + 36.f);
      }
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      INFO((every_chunk ? "every chunk saturated" : "every other chunk saturated"));
      RunOptions o;
      o.state_dtype = dtype;
      check_accuracy(p, o, run_cpu(p, o), targets_for(dtype));
    }
  }
}

TEST_CASE("CPU backend: any finite scale", "[cpu]") {
  for (float scale : {1.f, 0.02f, -0.5f, 8.f}) {
    CAPTURE(scale);
    ProblemShape shape;
    shape.B = 2;
    shape.T = 21;
    shape.H = 2;
    Problem p = random_problem(shape, 700);
    p.scale = scale;
    RunOptions o;
    check_accuracy(p, o, run_cpu(p, o), targets_for(FKDA_DTYPE_F32));
  }
}

TEST_CASE("CPU backend: two halves through final -> initial state equal the whole run", "[cpu][state]") {
  for (Decay decay : kDecays) {
    INFO(decay_name(decay));
    ProblemShape shape;
    shape.T = 77;
    shape.H = 2;
    const Problem whole = random_problem(with_decay(shape, decay), 8080);
    const AccuracyTargets targets = targets_for(FKDA_DTYPE_F32, decay);
    RunOptions o;
    o.state_dtype = FKDA_DTYPE_F32;
    const RunResult whole_run = run_cpu(whole, o);
    check_accuracy(whole, o, whole_run, targets);
    const Reference ref = reference_recurrence(whole);

    for (int64_t split : {32, 21}) {
      CAPTURE(split);
      Problem first = token_range(whole, 0, 0, split), second = token_range(whole, 0, split, whole.T);
      first.initial_state = whole.initial_state;
      const RunResult first_run = run_cpu(first, o);
      second.initial_state = first_run.final_state;
      const RunResult second_run = run_cpu(second, o);

      std::vector<float> halves_out = first_run.out;
      halves_out.insert(halves_out.end(), second_run.out.begin(), second_run.out.end());
      if (split % 16 == 0) {
        // Same chunks, f32 state carried exactly: the same arithmetic.
        CHECK(bitwise_equal(halves_out, whole_run.out));
        CHECK(bitwise_equal(second_run.final_state, whole_run.final_state));
      } else {
        CHECK_FALSE(bitwise_equal(halves_out, whole_run.out));  // the split did change the chunking
      }
      // Either way the halves follow the fp64 recurrence of the whole.
      CHECK(rel_l2(halves_out, ref.out) <= targets.out);
      CHECK(rel_l2(second_run.final_state, ref.final_state) <= targets.state);
    }
  }
}

TEST_CASE("CPU backend: a lost or damaged state fails the accuracy check by a wide margin", "[cpu][state][mutation]") {
  // The state tests above would pass a backend that mishandles the state
  // only if their comparison could not see it. On slow decays it must: the
  // same comparison fails, by kWideMargin times its target or more, when the
  // backend starts from a state other than the reference's. The margins are
  // printed.
  ProblemShape shape = slow_decay(ProblemShape{});
  shape.T = 160;
  shape.H = 2;
  const Problem p = random_problem(shape, 2718);
  const Reference ref = reference_recurrence(p);
  const AccuracyTargets targets = targets_for(FKDA_DTYPE_F32, Decay::slow);
  RunOptions o;
  o.state_dtype = FKDA_DTYPE_F32;
  auto report = [&](const char* what, double out_error, double state_error) {
    std::printf("CPU mutation %-34s out %.3e (%6.1fx target)  final state %.3e (%6.1fx target)\n", what, out_error,
                out_error / targets.out, state_error, state_error / targets.state);
    std::fflush(stdout);
  };

  SECTION("the initial state zeroed for the backend, not for the reference") {
    const RunResult faithful = run_cpu(p, o);
    CHECK(rel_l2(faithful.out, ref.out) <= targets.out);
    CHECK(rel_l2(faithful.final_state, ref.final_state) <= targets.state);
    RunOptions zeroed = o;
    zeroed.pass_initial = false;
    const RunResult r = run_cpu(p, zeroed);
    const double out_error = rel_l2(r.out, ref.out), state_error = rel_l2(r.final_state, ref.final_state);
    report("zeroed initial state", out_error, state_error);
    CHECK(out_error >= kWideMargin * targets.out);
    CHECK(state_error >= kWideMargin * targets.state);
  }

  SECTION("the state handed across a chunk boundary perturbed or dropped") {
    // Two calls split at token 64 (a chunk boundary): the second starts from
    // the first's final state as it is, scaled by 1.05, or replaced by zeros.
    constexpr int64_t kSplit = 64;
    Problem first = token_range(p, 0, 0, kSplit);
    first.initial_state = p.initial_state;
    const RunResult first_run = run_cpu(first, o);
    const std::vector<double> ref_tail = token_range(p, ref.out, kSplit, p.T);
    struct HandOff {
      const char* name;
      float factor;
      bool damaged;
    };
    for (const HandOff& hand_off : {HandOff{"hand-off as is", 1.0f, false}, HandOff{"hand-off scaled by 1.05", 1.05f, true},
                                    HandOff{"hand-off dropped", 0.0f, true}}) {
      INFO(hand_off.name);
      Problem second = token_range(p, 0, kSplit, p.T);
      second.initial_state = first_run.final_state;
      for (float& x : second.initial_state) x *= hand_off.factor;
      const RunResult r = run_cpu(second, o);
      const double out_error = rel_l2(r.out, ref_tail), state_error = rel_l2(r.final_state, ref.final_state);
      report(hand_off.name, out_error, state_error);
      if (hand_off.damaged) {
        CHECK(out_error >= kWideMargin * targets.out);
        CHECK(state_error >= kWideMargin * targets.state);
      } else {
        CHECK(out_error <= targets.out);
        CHECK(state_error <= targets.state);
      }
    }
  }
}

TEST_CASE("CPU backend: the same inputs give bitwise equal results", "[cpu]") {
  ProblemShape shape;
  shape.H = 4;
  shape.lengths = {100, 3, 64, 31};  // 16 (sequence, head) pairs: all cores take part
  Problem p = random_problem(shape, 1);
  round_initial_state_to_bf16(p);
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    RunOptions o;
    o.state_dtype = dtype;
    const RunResult a = run_cpu(p, o), b = run_cpu(p, o);
    CHECK(bitwise_equal(a.out, b.out));
    CHECK(bitwise_equal(a.final_state, b.final_state));
  }
}

// ------------------------------------------------------------ gate modes ---

namespace {

// Varlen with an initial state and partial chunks, a few hundred tokens.
ProblemShape gate_test_shape() {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {300, 0, 77, 129};
  return shape;
}

// Every gate variant with its initial state rounded for bf16 state plans.
std::vector<GateVariant> gate_cases() {
  std::vector<GateVariant> cases = gate_variants(gate_test_shape(), 31);
  for (GateVariant& c : cases) round_initial_state_to_bf16(c.p);
  return cases;
}

// The relative L2 of one run, printed so that the figures can be quoted.
void report_accuracy(const char* what, fkda_dtype state_dtype, const Errors& errors) {
  std::printf("CPU %-40s %s state: out %.3e  final state %.3e\n", what,
              state_dtype == FKDA_DTYPE_BF16 ? "bf16" : "f32 ", errors.out, errors.state);
  std::fflush(stdout);
}

}  // namespace

TEST_CASE("CPU backend: every gate and beta mode meets the accuracy targets", "[cpu][gate]") {
  for (const GateVariant& c : gate_cases()) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      INFO(c.name);
      RunOptions o;
      o.state_dtype = dtype;
      o.state_layout = dtype == FKDA_DTYPE_BF16 ? FKDA_STATE_LAYOUT_KV : FKDA_STATE_LAYOUT_VK;
      report_accuracy(c.name.c_str(), dtype, check_accuracy(c.p, o, run_cpu(c.p, o), targets_for(dtype, Decay::slow)));
    }
  }
}

TEST_CASE("CPU backend: the gate tests fail by a wide margin on a wrong gate or beta", "[cpu][gate][mutation]") {
  // The comparison of the test above against the fp64 recurrence of a
  // problem read the wrong way: what a backend that took the wrong mode, or
  // dropped A_log or dt_bias, would be measured against.
  const AccuracyTargets targets = targets_for(FKDA_DTYPE_F32, Decay::slow);
  const Problem softplus = random_problem(realistic_softplus(gate_test_shape()), 36);
  const Problem probabilities = as_probabilities(as_log_decay(softplus, true), true);
  RunOptions o;
  const RunResult softplus_run = run_cpu(softplus, o), probabilities_run = run_cpu(probabilities, o);
  CHECK(rel_l2(softplus_run.out, reference_recurrence(softplus).out) <= targets.out);
  CHECK(rel_l2(probabilities_run.out, reference_recurrence(probabilities).out) <= targets.out);

  struct Misreading {
    const char* name;
    const RunResult& run;
    Problem read_as;
  };
  std::vector<Misreading> misreadings = {{"softplus read as the bounded gate", softplus_run, softplus},
                                         {"softplus without A_log", softplus_run, softplus},
                                         {"softplus without dt_bias", softplus_run, softplus},
                                         {"probabilities read as logits", probabilities_run, probabilities}};
  misreadings[0].read_as.gate_mode = FKDA_GATE_BOUNDED;
  misreadings[1].read_as.A_log.clear();
  misreadings[2].read_as.dt_bias.clear();
  misreadings[3].read_as.beta_mode = FKDA_BETA_LOGITS;
  for (const Misreading& m : misreadings) {
    const Reference wrong = reference_recurrence(m.read_as);
    serving::require_mutation_caught(m.name, rel_l2(m.run.out, wrong.out), targets.out);
    serving::require_mutation_caught(m.name, rel_l2(m.run.final_state, wrong.final_state), targets.state);
  }
}

namespace {

// Out rows and final state of sequence n of a varlen run, against the fp64 ones.
Errors sequence_errors(const Problem& p, const RunResult& r, const Reference& ref, int64_t n) {
  const int64_t begin = p.cu_seqlens[size_t(n)], end = p.cu_seqlens[size_t(n) + 1], row = p.H * p.V;
  const std::vector<float> out(r.out.begin() + std::ptrdiff_t(begin * row), r.out.begin() + std::ptrdiff_t(end * row));
  const std::vector<float> state = sequence_state(p, r.final_state, n);
  const size_t per_sequence = size_t(p.H * p.V * p.K);
  const std::vector<double> ref_state(ref.final_state.begin() + std::ptrdiff_t(size_t(n) * per_sequence),
                                      ref.final_state.begin() + std::ptrdiff_t(size_t(n + 1) * per_sequence));
  return {rel_l2(out, token_range(p, ref.out, begin, end)), rel_l2(state, ref_state)};
}

}  // namespace

TEST_CASE("CPU backend: log-decays of -1e4, 0 and -inf, and sequences that forget everything", "[cpu][gate][edge]") {
  // Sequences 0 and 3: channels at -1e4, exactly 0, -inf and realistic
  // decays in turn; 1: -inf everywhere; 2: -300 everywhere (total
  // forgetting at every token: each output and the final state come from
  // one token alone). With g as bf16 and as f32.
  ProblemShape shape = realistic_softplus(ProblemShape{});
  shape.H = 2;
  shape.lengths = {70, 33, 20, 45};
  const Problem softplus = random_problem(shape, 37);
  for (bool f32 : {false, true}) {
    Problem p = with_edge_log_decays(as_log_decay(softplus, f32), 1, 2);
    round_initial_state_to_bf16(p);
    const Reference ref = reference_recurrence(p);
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      INFO((f32 ? "f32 g" : "bf16 g"));
      RunOptions o;
      o.state_dtype = dtype;
      const RunResult r = run_cpu(p, o);  // checks that every output is finite and written
      const AccuracyTargets targets = targets_for(dtype, Decay::slow);
      for (int64_t n = 0; n < p.num_seqs(); ++n) {
        CAPTURE(n);
        const Errors errors = sequence_errors(p, r, ref, n);
        const std::string what = std::string("log-decay edges, ") + (f32 ? "f32" : "bf16") + " g, sequence " +
                                 std::to_string(n);
        report_accuracy(what.c_str(), dtype, errors);
        CHECK(errors.out <= targets.out);
        CHECK(errors.state <= targets.state);
      }
    }
  }
}

TEST_CASE("CPU backend: softplus gate inputs of +-inf and +-1e4", "[cpu][gate][edge]") {
  // softplus(+inf) is +inf (total forgetting), softplus(-inf) is 0 (no decay).
  ProblemShape shape = realistic_softplus(ProblemShape{});
  shape.H = 2;
  shape.lengths = {50, 37};
  Problem p = random_problem(shape, 38);
  round_initial_state_to_bf16(p);
  const float kInfinity = std::numeric_limits<float>::infinity();
  const float gates[] = {kInfinity, -kInfinity, 1e4f, -1e4f};
  for (size_t i = 0; i < p.g.size(); ++i) {
    const size_t channel = i % size_t(p.K);
    if (channel % 5 < 4) p.g[i] = to_bf16(gates[channel % 5]);  // the fifth channels keep their gates
  }
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    RunOptions o;
    o.state_dtype = dtype;
    check_accuracy(p, o, run_cpu(p, o), targets_for(dtype, Decay::slow));
  }
}
