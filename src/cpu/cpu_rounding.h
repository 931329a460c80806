/* SPDX-License-Identifier: MIT */
// The roundings of docs/NUMERICS.md on the host. Every bf16 and f16 value is
// exactly representable in f32, so the CPU backend keeps rounded operands as
// f32 values: products of two of them are exact in f32, as on the tensor cores.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace fkda::cpu {

inline uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

inline float float_of(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// bf16 is the upper half of an f32; round to nearest even on the dropped half.
inline uint16_t bf16_bits_of(float x) {
  uint32_t bits = bits_of(x);
  if (std::isnan(x)) return static_cast<uint16_t>((bits >> 16) | 0x0040u);  // stay a quiet NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float float_of_bf16(uint16_t bits) { return float_of(static_cast<uint32_t>(bits) << 16); }

inline float round_to_bf16(float x) { return float_of_bf16(bf16_bits_of(x)); }

// Round to the nearest f16 value, ties to even, saturating at ±65504 like
// cvt.rn.satfinite.f16.f32: no step of the contract may produce an infinity.
inline float round_to_f16_satfinite(float x) {
  constexpr float kF16Max = 65504.f;
  constexpr float kF16MinNormal = 0x1p-14f;
  if (std::isnan(x)) return x;
  const float magnitude = std::fabs(x);
  // Everything above the largest f16 rounds to it or to infinity; both become 65504.
  if (magnitude >= kF16Max) return std::copysign(kF16Max, x);
  float rounded;
  if (magnitude < kF16MinNormal) {
    // f16 subnormals are multiples of 2^-24; the scalings are exact and
    // nearbyint rounds ties to even in the default rounding mode.
    rounded = std::nearbyint(magnitude * 0x1p24f) * 0x1p-24f;
  } else {
    // f16 keeps 10 of the 23 mantissa bits: round the 13 dropped bits to even.
    uint32_t bits = bits_of(magnitude);
    bits += 0x0FFFu + ((bits >> 13) & 1u);
    bits &= ~0x1FFFu;
    rounded = float_of(bits);
  }
  return std::copysign(rounded, x);
}

}  // namespace fkda::cpu
