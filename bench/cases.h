/* SPDX-License-Identifier: MIT */
// The benchmark cases: the prefill table of docs/BENCHMARKS.md with the
// peers' figures, the accuracy cases and their targets, and cases read from
// a JSON file.
#pragma once

#include <cstdint>
#include <optional>
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

// The long-context cases L1 ... L6 (docs/BENCHMARKS.md): few heads per GPU,
// long sequences, all varlen (cu_seqlens) with bf16 inputs like P cases.
// flashkda_ms holds no figure (FlashKDA was not measured there); fla_ms is
// FLA's serial chunk_kda; the note gives this library's serial time before
// the chunk-parallel path.
const std::vector<BenchCase>& long_context_cases();
const BenchCase* find_long_context_case(const std::string& id);

// The softplus-gate cases (P1, P3 and P11 = T 8192, H 12) with FLA's
// chunk_kda softplus figures and our targets; FlashKDA has no softplus gate.
const std::vector<BenchCase>& softplus_cases();
// The softplus entry of a prefill id, or nullptr.
const BenchCase* find_softplus_case(const std::string& id);

// Reads a JSON file of cases: an array, or an object with a "cases" array,
// of objects {"id", "H", and "T" (with optional "B") or "lengths", optional
// "flashkda_ms", "fla_ms", "target_ms", "note"}. Throws std::runtime_error
// naming the file, the entry and the field on any mistake.
std::vector<BenchCase> load_cases_file(const std::string& path);

// Checks a case built from command-line flags or a file; throws
// std::runtime_error with a message when a dimension is out of range.
void validate_case(const BenchCase& c);

// Serving cases: decode and speculative verify on a state pool (slot 0
// reserved as the null slot, the sequences' slots scattered over the pool,
// int32 cu_seqlens, lower_bound -5), and prefill reading and writing its
// states in a pool.
enum class ServingKind { kDecode, kSpecVerify, kPoolPrefill };

struct ServingCase {
  std::string id;
  ServingKind kind = ServingKind::kDecode;
  int64_t N = 1;               // sequences
  int64_t H = 1;
  int64_t tokens_per_seq = 1;  // decode 1; speculative verify: draft tokens T; prefill: length
  fkda_dtype pool_dtype = FKDA_DTYPE_F32;
  int64_t pool_slots = 0;          // 0: 1 + the slots the benchmark's input sets use
  int64_t checkpoint_every = 0;    // pool prefill: a checkpoint into a pool slot every this many tokens
  double fla_ms;                   // FLA's fused_recurrent_kda, median ms (NaN: none)
  double target_ms;                // NaN for pool prefill, judged against P8 instead
  double target_ratio_to_p8;       // pool prefill: median / P8's median (NaN otherwise)

  ServingCase();
  int64_t total_tokens() const { return N * tokens_per_seq; }
  // Interior checkpoints of one sequence (the final state is not one).
  int64_t checkpoints_per_seq() const;
  // Pool slots one call reads or writes.
  int64_t slots_per_call() const;
  // Bytes of state one call moves: read once, and written once (decode,
  // prefill), T times (speculative verify), plus the checkpoints.
  double state_bytes_moved() const;
  std::string shape() const;  // "N=256 H=32 f32 pool", "N=64 H=12 T=8 table", ...
};

// D1 ... D8, S1 ... S3, R1, R2.
const std::vector<ServingCase>& serving_cases();
// Case-insensitive lookup; nullptr when unknown.
const ServingCase* find_serving_case(const std::string& id);
const char* serving_kind_name(ServingKind kind);

// Relative L2 errors of out and the final state: targets and peers' figures.
struct AccuracyTarget {
  double out;
  double final_state;
};

// The accuracy cases: A1 (T=1024 H=4) and A2 (varlen [300, 77, 700] H=4) on
// the default inputs, and the long-memory cases LM1 ... LM3 on slow decays
// with an initial state ~ N(0, 1), whose lost or blurred state shows.
struct AccuracyCase {
  std::string id;
  int64_t T = 0;  // used when lengths is empty
  int64_t H = 4;
  std::vector<int64_t> lengths;
  bool long_memory = false;
  // Set for the long-memory cases; the others take --lower-bound.
  std::optional<float> lower_bound;
  // g ~ N(gate_mean, gate_std^2); initial state ~ initial_state_std N(0, 1).
  float gate_mean = 0.f;
  float gate_std = 1.f;
  float initial_state_std = 0.1f;
  // The softplus gate on Kimi-Linear's parameter distribution (ProblemShape
  // in reference/kda_reference.h), with g ~ N(0, 1) or, extreme, N(0, 4).
  bool softplus = false;
  bool extreme = false;
  // LM4 and LM4S: L1's shape, run with "long" and by name only (their fp64
  // reference takes seconds), not with "accuracy" or "long-memory".
  bool long_context = false;
  // The peers' figures on this case (FLA with f32 state).
  AccuracyTarget flashkda_figures{};
  AccuracyTarget fla_figures{};
  std::string shape() const;
};
// A1, A2, LM1, LM2, LM3, SP1, SP2 (softplus gate: realistic, extreme), and
// LM4, LM4S (L1's shape on slow decays; LM4S with SP1's softplus gate).
const std::vector<AccuracyCase>& accuracy_cases();
// Case-insensitive lookup; nullptr when unknown.
const AccuracyCase* find_accuracy_case(const std::string& id);

// The target of a case for a state dtype.
AccuracyTarget accuracy_target(const AccuracyCase& c, fkda_dtype state_dtype);

const char* state_dtype_name(fkda_dtype dtype);
size_t state_dtype_bytes(fkda_dtype dtype);

}  // namespace fkda_bench
