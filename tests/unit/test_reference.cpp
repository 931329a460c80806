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
