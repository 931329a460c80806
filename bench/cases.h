// The benchmark cases: the prefill table of docs/BENCHMARKS.md with the
// peers' figures, the accuracy cases and their targets, and cases read from
// a JSON file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkda.h"

namespace fkda_bench {

// One prefill shape. Either B rows of T tokens (one sequence per row) or,
// when `lengths` is non-empty, one packed row of varlen sequences.
// Peer figures are NaN when unknown.
struct BenchCase {
  std::string id;
  int64_t B = 1;
  int64_t T = 0;
  int64_t H = 0;
  std::vector<int64_t> lengths;
  double flashkda_ms;
  double fla_ms;
  double target_ms;
  std::string note;

  BenchCase();
  bool varlen() const { return !lengths.empty(); }
  int64_t total_tokens() const;
  int64_t num_seqs() const;
  std::string shape() const;  // "B=1 T=8192 H=96", "varlen 8x1024 H=96"
};

// Bytes one forward call must move at least: q, k, v, g, beta and the
// initial state read once, out and the final state written once.
double bytes_moved(const BenchCase& c, fkda_dtype state_dtype);

// FlashKDA's public workspace sizing: 13,824 bytes per 16-token chunk per head.
double flashkda_workspace_bytes(const BenchCase& c);

// P1..P10 in docs/BENCHMARKS.md order.
const std::vector<BenchCase>& prefill_cases();
// Case-insensitive lookup of a prefill id; nullptr when unknown.
const BenchCase* find_prefill_case(const std::string& id);

// Reads a JSON file of cases: an array, or an object with a "cases" array,
// of objects {"id", "H", and "T" (with optional "B") or "lengths", optional
// "flashkda_ms", "fla_ms", "target_ms", "note"}. Throws std::runtime_error
// naming the file, the entry and the field on any mistake.
std::vector<BenchCase> load_cases_file(const std::string& path);

// Checks a case built from command-line flags or a file; throws
// std::runtime_error with a message when a dimension is out of range.
void validate_case(const BenchCase& c);

// docs/BENCHMARKS.md's accuracy cases: T=1024 H=4 and varlen [300, 77, 700] H=4.
struct AccuracyCase {
  std::string id;
  int64_t T = 0;  // used when lengths is empty
  int64_t H = 4;
  std::vector<int64_t> lengths;
  std::string shape() const;
};
const std::vector<AccuracyCase>& accuracy_cases();

// Relative L2 targets and the peers' figures, by state dtype.
struct AccuracyTarget {
  double out;
  double final_state;
};
AccuracyTarget accuracy_target(fkda_dtype state_dtype);
extern const AccuracyTarget kFlashKdaAccuracy;  // bf16 or f32 state
extern const AccuracyTarget kFlaAccuracy;       // f32 state

const char* state_dtype_name(fkda_dtype dtype);
size_t state_dtype_bytes(fkda_dtype dtype);

}  // namespace fkda_bench
