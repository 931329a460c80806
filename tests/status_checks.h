/* SPDX-License-Identifier: MIT */
// Checks of fkda_* results shared by the unit and [gpu] tests: a call that
// must succeed fails the test with the status and fkda_last_error(); a call
// that must fail is checked by its status and by how its message starts,
// which is the argument's name.
#pragma once

#include <catch2/catch.hpp>

#include <string>

#include "flashkda.h"

// An assertion either way, so a section that only makes such calls still
// counts as checking something.
#define FKDA_REQUIRE(expr)                                                          \
  do {                                                                              \
    const fkda_status status_ = (expr);                                             \
    INFO(#expr << ": " << fkda_status_string(status_) << ": " << fkda_last_error()); \
    REQUIRE(status_ == FKDA_SUCCESS);                                               \
  } while (0)

inline void check_failure(fkda_status status, fkda_status expected, const std::string& message_start) {
  CHECK(status == expected);
  const std::string message = fkda_last_error();
  INFO("message: " << message);
  CHECK(message.rfind(message_start, 0) == 0);
}

inline void expect_invalid(fkda_status status, const std::string& message_start) {
  check_failure(status, FKDA_ERROR_INVALID_ARGUMENT, message_start);
}
