/* SPDX-License-Identifier: MIT */
// Internal errors: thrown below api.cpp, caught there and turned into a
// status plus the thread-local message. Nothing else crosses the ABI.
#pragma once

#include <string>

#include "flashkda.h"

namespace fkda {

struct Error {
  fkda_status status;
  std::string message;
};

[[noreturn]] inline void fail(fkda_status status, std::string message) {
  throw Error{status, std::move(message)};
}

[[noreturn]] inline void invalid(std::string message) {
  throw Error{FKDA_ERROR_INVALID_ARGUMENT, std::move(message)};
}

}  // namespace fkda
