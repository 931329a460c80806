// SPDX-License-Identifier: MIT
// The fp64 reference and the conversions checked against cases that can be
// worked out by hand, so that the accuracy tests rest on something known.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kda_reference.h"

namespace {

using namespace fkda_ref;

// Beta and gate logits this far out saturate sigmoid to exactly 0 or 1 in fp64.
const uint16_t kHugeNegative = to_bf16(-1e4f);
const uint16_t kHugePositive = to_bf16(1e4f);

double norm_of(const uint16_t* bits, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += double(from_bf16(bits[i])) * from_bf16(bits[i]);
  return std::sqrt(sum + 1e-6);
}

// Compares without Catch printing every element on failure.
template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a == b;
}

float f32_from_bits(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

}  // namespace

TEST_CASE("reference: one token from a zero state is scale * b * (k̂·q̂) * v", "[reference]") {
  ProblemShape shape;
  shape.T = 1;
  shape.H = 3;
  shape.with_initial_state = false;
  const Problem p = random_problem(shape, 11);
  const Reference ref = reference_recurrence(p);
  for (int64_t h = 0; h < p.H; ++h) {
    const uint16_t* q = &p.q[h * p.K];
    const uint16_t* k = &p.k[h * p.K];
    double q_dot_k = 0.0;
    for (int64_t c = 0; c < p.K; ++c) q_dot_k += double(from_bf16(q[c])) * from_bf16(k[c]);
    const double cosine = q_dot_k / (norm_of(q, p.K) * norm_of(k, p.K));
    const double b = 1.0 / (1.0 + std::exp(-double(from_bf16(p.beta[h]))));
    for (int64_t e = 0; e < p.V; ++e) {
      const double expected = double(p.scale) * b * cosine * from_bf16(p.v[h * p.V + e]);
      CHECK(ref.out[h * p.V + e] == Approx(expected).epsilon(1e-12).margin(1e-15));
    }
    // The state is the rank-one write b * v k̂ᵀ.
    const double k_norm = norm_of(k, p.K);
    for (int64_t e = 0; e < p.V; e += 17)
      for (int64_t c = 0; c < p.K; c += 13) {
        const double expected = b * from_bf16(p.v[h * p.V + e]) * from_bf16(k[c]) / k_norm;
        CHECK(ref.final_state[(h * p.V + e) * p.K + c] == Approx(expected).epsilon(1e-12).margin(1e-15));
      }
  }
}

TEST_CASE("reference: with beta -> -inf the state only decays", "[reference]") {
  ProblemShape shape;
  shape.T = 9;
  shape.H = 2;
  shape.lower_bound = -0.75f;
  Problem p = random_problem(shape, 12);
  for (uint16_t& beta : p.beta) beta = kHugeNegative;  // b = 0: no writes
  SECTION("a fully open gate leaves the state unchanged") {
    for (uint16_t& gate : p.g) gate = kHugeNegative;  // sigmoid -> 0, a = 0
    const Reference ref = reference_recurrence(p);
    size_t changed = 0;
    for (size_t i = 0; i < p.initial_state.size(); ++i)
      changed += ref.final_state[i] != double(p.initial_state[i]);
    CHECK(changed == 0);
  }
  SECTION("a closed gate decays by exp(lower_bound) per token") {
    for (uint16_t& gate : p.g) gate = kHugePositive;  // sigmoid -> 1, a = lower_bound
    const Reference ref = reference_recurrence(p);
    const double per_token = std::exp(double(p.lower_bound));
    const double total = std::pow(per_token, double(p.T));
    size_t off = 0;
    for (size_t i = 0; i < p.initial_state.size(); ++i)
      off += ref.final_state[i] != Approx(double(p.initial_state[i]) * total).epsilon(1e-12).margin(1e-18);
    CHECK(off == 0);
    // Output of the last token reads the decayed state: scale * S_T q̂_T.
    const int64_t t = p.T - 1;
    for (int64_t h = 0; h < p.H; ++h) {
      const uint16_t* q = &p.q[(t * p.H + h) * p.K];
      const double q_norm = norm_of(q, p.K);
      for (int64_t e = 0; e < p.V; e += 7) {
        double expected = 0.0;
        for (int64_t c = 0; c < p.K; ++c)
          expected += double(p.initial_state[(h * p.V + e) * p.K + c]) * total * from_bf16(q[c]) / q_norm;
        expected *= double(p.scale);
        CHECK(ref.out[(t * p.H + h) * p.V + e] == Approx(expected).epsilon(1e-10).margin(1e-15));
      }
    }
  }
}

TEST_CASE("reference: with b = 1 and no decay the state maps k̂ exactly to v", "[reference]") {
  ProblemShape shape;
  shape.T = 1;
  shape.H = 1;
  Problem p = random_problem(shape, 13);  // random initial state: the delta rule overwrites it along k̂
  p.beta[0] = kHugePositive;
  for (uint16_t& gate : p.g) gate = kHugeNegative;
  p.q = p.k;  // read back along the key just written
  const Reference ref = reference_recurrence(p);
  for (int64_t e = 0; e < p.V; ++e) {
    // |k̂|² = Σk² / (Σk² + 1e-6) differs from 1 by about 1e-8.
    CHECK(ref.out[e] == Approx(double(p.scale) * from_bf16(p.v[e])).epsilon(1e-6).margin(1e-9));
  }
}

TEST_CASE("reference: q and k enter only through their directions", "[reference]") {
  ProblemShape shape;
  shape.T = 5;
  shape.H = 2;
  const Problem p = random_problem(shape, 14);
  Problem scaled = p;
  // Powers of two scale bf16 values exactly.
  for (uint16_t& x : scaled.q) x = to_bf16(from_bf16(x) * 4.f);
  for (uint16_t& x : scaled.k) x = to_bf16(from_bf16(x) * 0.5f);
  const Reference a = reference_recurrence(p), b = reference_recurrence(scaled);
  std::vector<float> out_a(a.out.begin(), a.out.end());
  CHECK(rel_l2(out_a, b.out) < 1e-6);
  // A different direction changes the result: the comparison above can fail.
  Problem rotated = p;
  std::swap(rotated.q[0], rotated.q[1]);
  std::swap(rotated.q[2], rotated.q[3]);
  CHECK(rel_l2(out_a, reference_recurrence(rotated).out) > 1e-6);
}

TEST_CASE("reference: sequences of a varlen batch are independent", "[reference]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {6, 0, 11};
  const Problem packed = random_problem(shape, 15);
  const Reference whole = reference_recurrence(packed);
  const int64_t per_token = packed.H * packed.V, per_state = packed.H * packed.V * packed.K;
  for (int64_t n = 0; n < packed.num_seqs(); ++n) {
    CAPTURE(n);
    const int64_t begin = packed.cu_seqlens[n], end = packed.cu_seqlens[n + 1];
    Problem alone = packed;
    alone.cu_seqlens.clear();
    alone.T = end - begin;
    auto cut = [&](const std::vector<uint16_t>& all, int64_t width) {
      return std::vector<uint16_t>(all.begin() + begin * width, all.begin() + end * width);
    };
    alone.q = cut(packed.q, packed.H * packed.K);
    alone.k = cut(packed.k, packed.H * packed.K);
    alone.v = cut(packed.v, packed.H * packed.V);
    alone.g = cut(packed.g, packed.H * packed.K);
    alone.beta = cut(packed.beta, packed.H);
    alone.initial_state.assign(packed.initial_state.begin() + n * per_state,
                               packed.initial_state.begin() + (n + 1) * per_state);
    const Reference single = reference_recurrence(alone);
    CHECK(same(single.out, std::vector<double>(whole.out.begin() + begin * per_token,
                                               whole.out.begin() + end * per_token)));
    CHECK(same(single.final_state, std::vector<double>(whole.final_state.begin() + n * per_state,
                                                       whole.final_state.begin() + (n + 1) * per_state)));
  }
  // The empty sequence hands its initial state through.
  CHECK(same(
      std::vector<double>(whole.final_state.begin() + per_state, whole.final_state.begin() + 2 * per_state),
      std::vector<double>(packed.initial_state.begin() + per_state,
                          packed.initial_state.begin() + 2 * per_state)));
}

TEST_CASE("random_problem: deterministic, shaped as asked, never zeros", "[reference]") {
  ProblemShape shape;
  shape.H = 3;
  shape.lengths = {4, 0, 9};
  const Problem a = random_problem(shape, 99), b = random_problem(shape, 99), c = random_problem(shape, 100);
  CHECK(same(a.q, b.q));
  CHECK(same(a.initial_state, b.initial_state));
  CHECK_FALSE(same(a.q, c.q));
  CHECK(a.B == 1);
  CHECK(a.T == 13);
  CHECK(a.cu_seqlens == std::vector<int64_t>{0, 4, 4, 13});
  CHECK(a.num_seqs() == 3);
  CHECK(a.q.size() == size_t(13 * 3 * 128));
  CHECK(a.beta.size() == size_t(13 * 3));
  CHECK(a.dt_bias.size() == size_t(3 * 128));
  CHECK(a.initial_state.size() == size_t(3 * 3 * 128 * 128));
  size_t zeros = 0;
  for (uint16_t x : a.v) zeros += (x & 0x7FFF) == 0;
  CHECK(zeros == 0);
  for (float x : a.A_log) CHECK((x >= 0.f && x < 1.f));
  shape.with_initial_state = false;
  CHECK(random_problem(shape, 99).initial_state.empty());
}

TEST_CASE("bf16: every value round-trips and ties go to even", "[reference][conversions]") {
  size_t mismatches = 0;
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float x = from_bf16(uint16_t(bits));
    if (std::isnan(x))
      mismatches += !std::isnan(from_bf16(to_bf16(x)));
    else
      mismatches += to_bf16(x) != bits;
  }
  CHECK(mismatches == 0);
  CHECK(from_bf16(to_bf16(1.f + 0x1p-8f)) == 1.f);                       // tie, down to even
  CHECK(from_bf16(to_bf16(1.f + 3 * 0x1p-8f)) == 1.f + 0x1p-6f);         // tie, up to even
  CHECK(from_bf16(to_bf16(1.f + 0x1p-8f + 0x1p-20f)) == 1.f + 0x1p-7f);  // above the tie
  CHECK(from_bf16(to_bf16(-(1.f + 0x1p-8f))) == -1.f);
  CHECK(to_bf16(f32_from_bits(0x7F7FFFFFu)) == 0x7F80);  // the largest float rounds to infinity
  CHECK(std::isnan(from_bf16(to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose upper half alone would read as infinity.
  CHECK(std::isnan(from_bf16(to_bf16(f32_from_bits(0x7F800001u)))));
}

TEST_CASE("f16: every value round-trips, ties go to even, overflow saturates", "[reference][conversions]") {
  size_t mismatches = 0;
  for (uint32_t bits = 0; bits <= 0xFFFF; ++bits) {
    const float x = from_f16(uint16_t(bits));
    if (std::isnan(x))
      mismatches += !std::isnan(from_f16(to_f16(x)));
    else if (std::isinf(x))
      mismatches += to_f16(x) != ((bits & 0x8000u) | 0x7BFFu);  // satfinite
    else
      mismatches += to_f16(x) != bits;
  }
  CHECK(mismatches == 0);
  CHECK(from_f16(to_f16(1.f + 0x1p-11f)) == 1.f);                // tie, down to even
  CHECK(from_f16(to_f16(1.f + 3 * 0x1p-11f)) == 1.f + 0x1p-9f);  // tie, up to even
  CHECK(from_f16(to_f16(1.f + 0x1p-11f + 0x1p-20f)) == 1.f + 0x1p-10f);
  CHECK(to_f16(0x1p-24f) == 0x0001);             // the smallest subnormal
  CHECK(to_f16(0x1p-25f) == 0x0000);             // tie between 0 and 2^-24: even is 0
  CHECK(to_f16(3 * 0x1p-25f) == 0x0002);         // tie between 1 and 2 units: even is 2
  CHECK(to_f16(-0x1p-26f) == 0x8000);            // flushes to a signed zero
  CHECK(to_f16(0x1p-14f - 0x1p-26f) == 0x0400);  // rounds up into the normals
  CHECK(to_f16(65504.f) == 0x7BFF);
  CHECK(to_f16(65519.f) == 0x7BFF);
  CHECK(to_f16(1e6f) == 0x7BFF);
  CHECK(to_f16(-1e30f) == 0xFBFF);
  CHECK(to_f16(-std::numeric_limits<float>::infinity()) == 0xFBFF);
  CHECK(from_f16(0x3C00) == 1.f);
  CHECK(from_f16(0xC000) == -2.f);
  CHECK(std::isnan(from_f16(to_f16(std::numeric_limits<float>::quiet_NaN()))));
}

TEST_CASE("rel_l2: known values, and non-finite results are never close", "[reference]") {
  CHECK(rel_l2({3.f, 4.f}, {3.0, 4.0}) == 0.0);
  CHECK(rel_l2({3.f, 0.f}, {0.0, 4.0}) == Approx(std::sqrt(25.0) / 4.0));
  CHECK(rel_l2({1.f, std::numeric_limits<float>::quiet_NaN()}, {1.0, 1.0}) ==
        std::numeric_limits<double>::infinity());
  CHECK(rel_l2({1.f, std::numeric_limits<float>::infinity()}, {1.0, 1.0}) ==
        std::numeric_limits<double>::infinity());
  CHECK(rel_l2({1.f}, {1.0, 1.0}) == std::numeric_limits<double>::infinity());
}

TEST_CASE("tensor and make_args describe the buffers row-major", "[reference]") {
  std::vector<float> data(24);
  const fkda_tensor t = tensor(data.data(), FKDA_DTYPE_F32, {2, 3, 4});
  CHECK(t.rank == 3);
  CHECK(t.dtype == FKDA_DTYPE_F32);
  CHECK((t.shape[0] == 2 && t.shape[1] == 3 && t.shape[2] == 4));
  CHECK((t.strides[0] == 12 && t.strides[1] == 4 && t.strides[2] == 1));

  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {3, 5};
  const Problem p = random_problem(shape, 3);
  int dummy = 0;
  Buffers buffers{&dummy, &dummy, &dummy, &dummy, &dummy, &dummy, &dummy, &dummy};
  buffers.cu_seqlens = &dummy;
  buffers.final_state = &dummy;
  const fkda_fwd_args args = make_args(p, buffers, FKDA_DTYPE_BF16);
  CHECK(args.struct_size == sizeof(fkda_fwd_args));
  CHECK((args.q.rank == 4 && args.q.shape[1] == 8 && args.q.shape[2] == 2 && args.q.shape[3] == 128));
  CHECK(args.beta.rank == 3);
  CHECK((args.cu_seqlens.dtype == FKDA_DTYPE_I64 && args.cu_seqlens.shape[0] == 3));
  CHECK((args.final_state.dtype == FKDA_DTYPE_BF16 && args.final_state.shape[0] == 2));
  CHECK(args.initial_state.data == nullptr);
  CHECK(args.initial_state.rank == 0);
  CHECK(args.scale == p.scale);
}

TEST_CASE("reference: each gate mode's log-decay, worked out by hand", "[reference][gate]") {
  ProblemShape shape;
  shape.T = 1;
  shape.H = 2;
  Problem p = random_problem(shape, 16);
  const float gates[] = {-30.f, -1.f, 0.f, 0.5f, 19.5f, 24.f};  // bf16-exact
  for (size_t i = 0; i < p.g.size(); ++i) p.g[i] = to_bf16(gates[i % 6]);
  auto g_of = [&](size_t i) { return double(gates[i % 6]); };

  p.A_log.clear();  // exp(A_log) = 1
  p.lower_bound = -2.f;
  std::vector<double> a = log_decays(p);
  REQUIRE(a.size() == p.g.size());
  CHECK(a[1] == Approx(-2.0 / (1.0 + std::exp(-(-1.0 + double(p.dt_bias[1]))))).epsilon(1e-14));
  p.dt_bias.clear();  // dt_bias = 0
  a = log_decays(p);
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == Approx(-2.0 / (1.0 + std::exp(-g_of(i)))).epsilon(1e-14));

  p.gate_mode = FKDA_GATE_SOFTPLUS;
  p.A_log = {1.5f, 0.f};
  a = log_decays(p);
  for (size_t i = 0; i < a.size(); ++i) {
    const double a_scale = std::exp(i < size_t(p.K) ? 1.5 : 0.0);
    // softplus(x) = log(1 + e^x), taken as x above 20 only.
    const double softplus = g_of(i) > 20 ? g_of(i) : std::log1p(std::exp(g_of(i)));
    CHECK(a[i] == Approx(-a_scale * softplus).epsilon(1e-14));
  }
  const size_t past_20 = size_t(p.K) + 3;  // head 1, exp(A_log) = 1
  REQUIRE(g_of(past_20) == 24.0);
  CHECK(a[past_20] == -24.0);

  p.gate_mode = FKDA_GATE_LOG_DECAY;
  p.A_log.clear();
  a = log_decays(p);
  for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == std::min(g_of(i), 0.0));  // above 0 reads as 0
  p.g_f32.assign(p.g.size(), -0.125f);
  for (double x : log_decays(p)) CHECK(x == -0.125);  // f32 g wins over the bf16 bits
}

TEST_CASE("reference: a log-decay of -inf forgets the state entirely, without a NaN", "[reference][gate]") {
  ProblemShape shape;
  shape.T = 2;
  shape.H = 1;
  shape.gate_mode = FKDA_GATE_LOG_DECAY;
  Problem p = random_problem(shape, 17);  // random initial state
  for (uint16_t& g : p.g) g = to_bf16(-std::numeric_limits<float>::infinity());
  const Reference ref = reference_recurrence(p);
  // Only the last token's rank-one write b · v k̂ᵀ is left.
  const int64_t t = 1;
  const double b = 1.0 / (1.0 + std::exp(-double(from_bf16(p.beta[t]))));
  const double k_norm = norm_of(&p.k[t * p.K], p.K);
  size_t off = 0;
  for (int64_t e = 0; e < p.V; ++e)
    for (int64_t c = 0; c < p.K; ++c) {
      const double expected = b * from_bf16(p.v[t * p.V + e]) * from_bf16(p.k[t * p.K + c]) / k_norm;
      off += !(ref.final_state[e * p.K + c] == Approx(expected).epsilon(1e-12).margin(1e-15));
    }
  CHECK(off == 0);
  std::vector<float> out(ref.out.begin(), ref.out.end());
  CHECK(std::isfinite(rel_l2(out, ref.out)));
  // An f32 -300 (exp(-300) is about 5e-131, not 0) gives the same.
  p.g_f32.assign(p.g.size(), -300.f);
  std::vector<float> state(ref.final_state.begin(), ref.final_state.end());  // rounded to f32: 6e-8
  CHECK(rel_l2(state, reference_recurrence(p).final_state) < 1e-7);
}

TEST_CASE("reference: as_log_decay and as_probabilities keep the problem's recurrence", "[reference][gate]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {9, 0, 20};
  for (const ProblemShape& s : {realistic_softplus(shape), extreme_softplus(shape), slow_decay(shape)}) {
    const Problem p = random_problem(s, 18);
    const Reference original = reference_recurrence(p);
    const std::vector<float> out(original.out.begin(), original.out.end());
    for (bool f32 : {true, false}) {
      CAPTURE(f32);
      const Problem log_decay = as_log_decay(p, f32);
      CHECK(log_decay.gate_mode == FKDA_GATE_LOG_DECAY);
      CHECK(log_decay.A_log.empty());
      CHECK(log_decay.dt_bias.empty());
      CHECK((f32 ? log_decay.g.empty() && log_decay.g_f32.size() == p.g.size()
                 : log_decay.g_f32.empty() && log_decay.g.size() == p.g.size()));
      const Problem probabilities = as_probabilities(log_decay, f32);
      CHECK(probabilities.beta_mode == FKDA_BETA_PROBABILITIES);
      CHECK((f32 ? probabilities.beta_f32.size() : probabilities.beta.size()) == p.beta.size());
      // Only the rounding of the log-decays and step sizes differs.
      const double tolerance = f32 ? 1e-5 : 1e-2;
      CHECK(rel_l2(out, reference_recurrence(log_decay).out) < tolerance);
      CHECK(rel_l2(out, reference_recurrence(probabilities).out) < tolerance);
    }
  }
}

TEST_CASE("random_problem: the softplus distributions use the model's gate parameters", "[reference][gate]") {
  ProblemShape shape;
  shape.T = 64;
  shape.H = 4;
  const Problem realistic = random_problem(realistic_softplus(shape), 19);
  const Problem extreme = random_problem(extreme_softplus(shape), 19);
  CHECK(realistic.gate_mode == FKDA_GATE_SOFTPLUS);
  CHECK(realistic.beta_mode == FKDA_BETA_LOGITS);
  for (float x : realistic.A_log) CHECK((std::exp(double(x)) >= 1.0 - 1e-6 && std::exp(double(x)) <= 16.0 + 1e-5));
  for (float x : realistic.dt_bias) {
    const double softplus = std::log1p(std::exp(double(x)));
    CHECK((softplus >= 0.001 * (1 - 1e-5) && softplus <= 0.1 * (1 + 1e-5)));
  }
  // The same draws but g's spread: extreme gates decay far more.
  CHECK(realistic.A_log == extreme.A_log);
  const std::vector<double> mild = log_decays(realistic), strong = log_decays(extreme);
  const double mild_min = *std::min_element(mild.begin(), mild.end());
  const double strong_min = *std::min_element(strong.begin(), strong.end());
  CHECK((mild_min < -5 && mild_min > -60));
  CHECK(strong_min < -60);
  for (double x : mild) CHECK(x <= 0);

  ProblemShape log_decay = shape;
  log_decay.gate_mode = FKDA_GATE_LOG_DECAY;
  const Problem p = random_problem(log_decay, 19);
  CHECK(p.A_log.empty());
  CHECK(p.dt_bias.empty());
  CHECK(p.initial_state == random_problem(shape, 19).initial_state);  // the same draws as the bounded gate
}

TEST_CASE("make_args, host_buffers and apply_gate follow the problem's gate", "[reference][gate]") {
  ProblemShape shape;
  shape.H = 2;
  shape.lengths = {3, 5};
  const Problem softplus = random_problem(realistic_softplus(shape), 20);
  Problem p = as_probabilities(as_log_decay(softplus, true), true);
  std::vector<uint16_t> out(size_t(p.T * p.H * p.V));
  const Buffers buffers = host_buffers(p, out.data());
  CHECK(buffers.g == p.g_f32.data());
  CHECK(buffers.beta == p.beta_f32.data());
  CHECK(buffers.cu_seqlens == p.cu_seqlens.data());
  const fkda_fwd_args args = make_args(p, buffers, FKDA_DTYPE_F32);
  CHECK(args.g.dtype == FKDA_DTYPE_F32);
  CHECK(args.beta.dtype == FKDA_DTYPE_F32);
  CHECK((args.A_log.data == nullptr && args.A_log.rank == 0));
  CHECK((args.dt_bias.data == nullptr && args.dt_bias.rank == 0));
  const fkda_decode_args decode = make_decode_args(p, buffers);
  CHECK(decode.g.dtype == FKDA_DTYPE_F32);
  CHECK(decode.A_log.rank == 0);

  const fkda_fwd_args softplus_args = make_args(softplus, buffers, FKDA_DTYPE_F32);
  CHECK(softplus_args.g.dtype == FKDA_DTYPE_BF16);
  CHECK(softplus_args.A_log.rank == 1);

  fkda_plan_desc desc = FKDA_PLAN_DESC_INIT;
  desc.lower_bound = -1.f;
  apply_gate(p, &desc);
  CHECK(desc.gate_mode == FKDA_GATE_LOG_DECAY);
  CHECK(desc.beta_mode == FKDA_BETA_PROBABILITIES);
  CHECK(desc.lower_bound == -5.f);  // what a gate without a floor needs
  Problem bounded = random_problem(shape, 21);
  bounded.lower_bound = -0.5f;
  apply_gate(bounded, &desc);
  CHECK(desc.gate_mode == FKDA_GATE_BOUNDED);
  CHECK(desc.beta_mode == FKDA_BETA_LOGITS);
  CHECK(desc.lower_bound == -0.5f);

  // token_range cuts the f32 forms too.
  const Problem part = token_range(p, 0, 3, 8);
  CHECK(part.g_f32 == std::vector<float>(p.g_f32.begin() + 3 * p.H * p.K, p.g_f32.end()));
  CHECK(part.beta_f32 == std::vector<float>(p.beta_f32.begin() + 3 * p.H, p.beta_f32.end()));
  CHECK(part.g.empty());
}

TEST_CASE("gate_variants and with_edge_log_decays cover what they say", "[reference][gate]") {
  ProblemShape shape;
  shape.H = 1;
  shape.lengths = {3, 4, 0, 2};
  const std::vector<GateVariant> variants = gate_variants(shape, 22);
  int bounded = 0, softplus = 0, log_decay = 0, probabilities = 0, f32_g = 0, f32_beta = 0, no_A_log = 0, no_dt_bias = 0;
  for (const GateVariant& v : variants) {
    CAPTURE(v.name);
    CHECK(v.p.cu_seqlens == std::vector<int64_t>{0, 3, 7, 7, 9});
    bounded += v.p.gate_mode == FKDA_GATE_BOUNDED;
    softplus += v.p.gate_mode == FKDA_GATE_SOFTPLUS;
    log_decay += v.p.gate_mode == FKDA_GATE_LOG_DECAY;
    probabilities += v.p.beta_mode == FKDA_BETA_PROBABILITIES;
    f32_g += !v.p.g_f32.empty();
    f32_beta += !v.p.beta_f32.empty();
    no_A_log += v.p.gate_mode != FKDA_GATE_LOG_DECAY && v.p.A_log.empty();
    no_dt_bias += v.p.gate_mode != FKDA_GATE_LOG_DECAY && v.p.dt_bias.empty();
  }
  CHECK(bounded == 2);
  CHECK(softplus == 4);
  CHECK(log_decay == 5);
  CHECK(probabilities == 2);
  CHECK(f32_g == 3);
  CHECK(f32_beta == 1);
  CHECK(no_A_log == 1);
  CHECK(no_dt_bias == 2);

  for (bool f32 : {false, true}) {
    const Problem edges = with_edge_log_decays(as_log_decay(variants[2].p, f32), 1, 3);
    const std::vector<double> a = log_decays(edges);
    const double infinity = std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < edges.T; ++t)
      for (int64_t c = 0; c < edges.K; ++c) {
        const double x = a[size_t(t * edges.K + c)];
        if (t >= 3 && t < 7) CHECK(x == -infinity);
        else if (t >= 7) CHECK(x == -300.0);
        else if (c % 4 == 0) CHECK(x == double(f32 ? -1e4f : from_bf16(to_bf16(-1e4f))));
        else if (c % 4 == 1) CHECK(x == 0.0);
        else if (c % 4 == 2) CHECK(x == -infinity);
        else CHECK((x < 0.0 && x > -1e3));
      }
  }
}
