/* SPDX-License-Identifier: MIT */
// How error messages spell an fkda_dtype, so that every message that names
// a dtype names it the same way.
#pragma once

#include <cstdint>
#include <string>

#include "flashkda.h"

namespace fkda {

inline std::string dtype_name(int32_t dtype) {
  switch (dtype) {
    case FKDA_DTYPE_BF16: return "bf16";
    case FKDA_DTYPE_F16: return "f16";
    case FKDA_DTYPE_F32: return "f32";
    case FKDA_DTYPE_I32: return "i32";
    case FKDA_DTYPE_I64: return "i64";
    case FKDA_DTYPE_BOOL: return "bool";
    default: return "invalid dtype (" + std::to_string(dtype) + ")";
  }
}

}  // namespace fkda
