// SPDX-License-Identifier: MIT
#include "random_fill.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

namespace fkda_bench {
namespace {

uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Element i of the stream `seed`: one 64-bit hash split into four 16-bit
// uniforms. Their sum has mean 4 * 32767.5 and standard deviation
// sqrt(4 * (65536² - 1) / 12) ≈ 37837.23.
inline float normal_at(uint64_t seed, uint64_t index) {
  const uint64_t bits = mix64(seed + index * 0x9E3779B97F4A7C15ull);
  const uint32_t sum = uint32_t(bits & 0xFFFF) + uint32_t((bits >> 16) & 0xFFFF) +
                       uint32_t((bits >> 32) & 0xFFFF) + uint32_t(bits >> 48);
  constexpr float kMean = 131070.0f;
  constexpr float kInvStddev = 1.0f / 37837.23f;
  return (float(sum) - kMean) * kInvStddev;
}

inline float uniform_at(uint64_t seed, uint64_t index) {
  const uint64_t bits = mix64(seed + index * 0x9E3779B97F4A7C15ull);
  return float(bits >> 40) * (1.0f / 16777216.0f);  // 24 bits: exact in f32, in [0, 1)
}

// Round to nearest even; the generated values are always finite.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// Calls body(begin, end) over [0, count) split across the hardware threads.
template <class Body>
void parallel_ranges(size_t count, const Body& body) {
  constexpr size_t kMinPerThread = size_t(1) << 18;
  const size_t hardware = std::max(1u, std::thread::hardware_concurrency());
  const size_t threads = std::min(hardware, std::max<size_t>(1, count / kMinPerThread));
  if (threads <= 1) {
    body(size_t(0), count);
    return;
  }
  std::vector<std::thread> workers;
  workers.reserve(threads);
  const size_t per_thread = (count + threads - 1) / threads;
  for (size_t t = 0; t < threads; ++t) {
    const size_t begin = std::min(count, t * per_thread);
    const size_t end = std::min(count, begin + per_thread);
    workers.emplace_back([&body, begin, end] { body(begin, end); });
  }
  for (auto& worker : workers) worker.join();
}

}  // namespace

void fill_bf16_normal(uint16_t* dst, size_t count, float stddev, uint64_t seed) {
  parallel_ranges(count, [=](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) dst[i] = bf16_bits(stddev * normal_at(seed, i));
  });
}

void fill_f32_normal(float* dst, size_t count, float stddev, uint64_t seed) {
  parallel_ranges(count, [=](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) dst[i] = stddev * normal_at(seed, i);
  });
}

void fill_f32_uniform(float* dst, size_t count, float lo, float hi, uint64_t seed) {
  parallel_ranges(count, [=](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) dst[i] = lo + (hi - lo) * uniform_at(seed, i);
  });
}

uint64_t derive_seed(uint64_t base, uint64_t a, uint64_t b) {
  return mix64(mix64(mix64(base) ^ (a + 0x632BE59BD9B4E019ull)) ^ (b + 0x85157AF5ull));
}

}  // namespace fkda_bench
