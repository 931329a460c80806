/* SPDX-License-Identifier: MIT */
// Human-readable tables for fkda-bench.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

namespace fkda_bench {

// A plain text table: columns sized to their widest cell. `alignment` holds
// one character per column, 'l' for left (text) or 'r' for right (numbers).
class TextTable {
 public:
  TextTable(std::vector<std::string> header, std::string alignment)
      : header_(std::move(header)), alignment_(std::move(alignment)) {}
  void add_row(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print(std::FILE* out) const;

 private:
  std::vector<std::string> header_;
  std::string alignment_;
  std::vector<std::vector<std::string>> rows_;
};

// printf-style formatting into a std::string.
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// "%.3f" of a value, or "-" when it is NaN.
std::string ms_or_dash(double ms);

}  // namespace fkda_bench
