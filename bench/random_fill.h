/* SPDX-License-Identifier: MIT */
// Fast host-side random inputs for the timing cases. The largest case moves
// about 1 GB of activations per input set, so the fill runs on every hardware
// thread and uses a counter-based generator: the values depend only on the
// seed and the element index, never on the number of threads.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fkda_bench {

// bf16 bit patterns of values distributed approximately as stddev * N(0, 1)
// (a scaled sum of four uniforms: mean 0, variance stddev², |x| < 3.5 stddev).
void fill_bf16_normal(uint16_t* dst, size_t count, float stddev, uint64_t seed);

// The same distribution in f32.
void fill_f32_normal(float* dst, size_t count, float stddev, uint64_t seed);

// Uniform in [lo, hi).
void fill_f32_uniform(float* dst, size_t count, float lo, float hi, uint64_t seed);

// A well-mixed seed for one (base seed, stream a, stream b) triple, so that
// every tensor of every input set gets its own sequence.
uint64_t derive_seed(uint64_t base, uint64_t a, uint64_t b);

}  // namespace fkda_bench
