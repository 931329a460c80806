/* SPDX-License-Identifier: MIT */
// Size arithmetic that reports overflow instead of wrapping. Sizes come from
// the caller: signed overflow would be undefined behaviour, and a size that
// wrapped around would let an impossible descriptor pass as a small one.
#pragma once

#include <cstdint>
#include <limits>

namespace fkda {

// True when a * b (a + b) does not fit in int64; *result is then unusable.
inline bool mul_overflows(int64_t a, int64_t b, int64_t* result) { return __builtin_mul_overflow(a, b, result); }
inline bool add_overflows(int64_t a, int64_t b, int64_t* result) { return __builtin_add_overflow(a, b, result); }

// For non-negative operands: the exact result, or INT64_MAX when it does not
// fit. For bounds that only need to be "at least this large".
inline int64_t saturating_mul(int64_t a, int64_t b) {
  int64_t result = 0;
  return mul_overflows(a, b, &result) ? std::numeric_limits<int64_t>::max() : result;
}
inline int64_t saturating_add(int64_t a, int64_t b) {
  int64_t result = 0;
  return add_overflows(a, b, &result) ? std::numeric_limits<int64_t>::max() : result;
}

// ceil(a / b) for a >= 0 and b > 0, without forming a + b - 1.
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace fkda
