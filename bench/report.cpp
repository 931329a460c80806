// SPDX-License-Identifier: MIT
#include "report.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>

namespace fkda_bench {

void TextTable::print(std::FILE* out) const {
  std::vector<size_t> widths(header_.size());
  for (size_t col = 0; col < header_.size(); ++col) widths[col] = header_[col].size();
  for (const auto& row : rows_)
    for (size_t col = 0; col < row.size() && col < widths.size(); ++col)
      widths[col] = std::max(widths[col], row[col].size());

  const auto print_row = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t col = 0; col < widths.size(); ++col) {
      const std::string cell = col < row.size() ? row[col] : std::string();
      const std::string pad(widths[col] - cell.size(), ' ');
      if (col) line += "  ";
      const bool left = col < alignment_.size() && alignment_[col] == 'l';
      line += left ? cell + pad : pad + cell;
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    std::fprintf(out, "%s\n", line.c_str());
  };
  print_row(header_);
  std::vector<std::string> rule;
  for (size_t width : widths) rule.emplace_back(width, '-');
  print_row(rule);
  for (const auto& row : rows_) print_row(row);
}

std::string format(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  const int size = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::string text(size > 0 ? size_t(size) : 0, '\0');
  if (size > 0) std::vsnprintf(&text[0], text.size() + 1, fmt, args);
  va_end(args);
  return text;
}

std::string ms_or_dash(double ms) { return std::isnan(ms) ? "-" : format("%.3f", ms); }

}  // namespace fkda_bench
