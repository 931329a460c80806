// SPDX-License-Identifier: MIT
// fkda-bench: times libflashkda's prefill, decode and pool cases (or custom
// prefill shapes), prints the peers' figures beside ours, checks accuracy
// against the fp64 recurrence, and writes the results as JSON.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <limits>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "accuracy.h"
#include "bench_support.h"
#include "cases.h"
#include "report.h"
#include "serving.h"
#include "timing.h"
#include "bench_commit.h"  // FKDA_BENCH_GIT_DESCRIBE, generated at each build

namespace fkda_bench {
namespace {

const char* gate_name(int32_t gate_mode) {
  return gate_mode == FKDA_GATE_SOFTPLUS ? "softplus" : gate_mode == FKDA_GATE_LOG_DECAY ? "log-decay" : "bounded";
}

constexpr double kP1WorkspaceTargetBytes = 0.34e9;

const char* const kUsage = R"(usage: fkda-bench [CASE...] [accuracy] [options]

Times libflashkda's prefill (fkda_fwd), decode (fkda_decode) and prefill on a
state pool on one GPU with random inputs and prints median/min/max ms,
effective GB/s and workspace bytes per case, beside the FlashKDA, FLA and
target figures of docs/BENCHMARKS.md.

Cases (ids are case-insensitive):
  P1 ... P14          prefill cases
  prefill             all of P1 ... P14 (the default when nothing else is asked)
  D1 ... D8           decode, one token for N sequences, states in a pool
  S1 ... S3           speculative verify: T draft tokens, [N, T] slot table,
                      num_accepted random in 1 ... T
  R1, R2              P8's shape with states in an f32 pool of 4096 slots (R2:
                      a checkpoint into a pool slot every 256 tokens), judged by
                      the ratio to P8 with contiguous f32 states (this
                      invocation's P8 with --state f32, else timed for it)
  decode, spec, pool  D1 ... D8, S1 ... S3, R1 and R2
  serving             all of the above three
  all                 prefill, serving, accuracy and long-memory
  accuracy            relative L2 error of out and final state against the fp64
                      recurrence (A1: T=1024 H=4, A2: varlen [300,77,700] H=4),
                      with bf16 and f32 state
  long-memory         LM1 (T=4096 H=4, lb -5, g ~ N(-6,1)), LM2 (T=4096 H=4,
                      lb -5, g ~ N(-2,2^2)), LM3 (T=8192 H=2, lb -1, g ~ N(0,1)):
                      slow decays, initial state ~ N(0,1); targets out <= 3e-3,
                      state <= 1e-3 (f32) or 2e-3 (bf16)
  L1 ... L6           long context at few heads, varlen: L1 T=65536 H=4, L2
                      T=131072 H=4, L3 T=1048576 H=4, L4 T=8192 H=4, L5 4x16384
                      H=4, L6 T=65536 H=12
  long                L1 ... L6, and the accuracy cases LM4 (L1's shape, lb -5,
                      g ~ N(-6,1), initial state ~ N(0,1)) and LM4S (the same
                      with SP1's softplus gate)
  A1, A2, LM1 ... LM4, LM4S  one accuracy case
  --B N --T N --H N   a custom batched shape (B defaults to 1)
  --lengths L1,L2,... --H N
                      a custom varlen shape (packed, B = 1)
  --cases FILE        cases from a JSON file: an array (or {"cases": [...]}) of
                      {"id", "H", "T" [, "B"] | "lengths" [, "flashkda_ms",
                      "fla_ms", "target_ms", "note"]}

Options:
  --state bf16|f32    state dtype of the timed cases (default bf16, as in
                      docs/BENCHMARKS.md); accuracy always runs both
  --warmup N          untimed calls before timing (default 10)
  --iters N           timed calls per case (default 100)
  --lower-bound X     gate floor in [-5, 0] (default -5)
  --gate G            bounded (default), softplus or log-decay (g ~ N(0, 1)
                      read as log-decays); softplus times P1, P3 and P11
                      against FLA's softplus figures unless cases are named
  --seed N            seed of the random inputs (default 1)
  --json FILE         also write the results as JSON to FILE
  --commit SHA        commit recorded in the results (default: git describe
                      of the source tree when fkda-bench was built)
  --cpu               accuracy cases and decode/spec cases on the CPU backend
                      (host memory, no GPU needed): one checked call each,
                      nothing timed
  --list              print the cases and exit; touches no GPU
  --help              print this text and exit
  Options also take the form --name=value.

Timing: device 0 is made current (cudaSetDevice(0), cudaFree(0)); each call
is bracketed by CUDA events after the warm-up; the calls rotate over several
input sets that together exceed the L2 cache many times. GB/s counts q, k, v,
g, beta and the initial state read once and out and the final state written
once. Serving cases: pools [slots, H, 128, 128] with slot 0 reserved as the
null slot, each input set's slots scattered over the pool (fixed seed), int32
cu_seqlens and slot tables; "state GB/s" counts the states read once and
written once (decode, pool prefill, plus its checkpoints) or T times (verify).
The first call of each decode case is checked against the fp64 recurrence on
its first sequences.

Exit status: 0 success; 1 a library, CUDA or output check failed; 2 bad
command line or cases file; 3 no usable GPU; 4 an accuracy figure above its
target.
)";

struct Options {
  std::vector<BenchCase> cases;
  std::vector<ServingCase> serving;
  std::vector<AccuracyCase> accuracy;
  bool list = false;
  bool help = false;
  bool on_cpu = false;
  std::string json_path;
  std::string commit;
  TimingOptions timing;
};

BenchError usage_error(const std::string& message) {
  return BenchError(message + " (see fkda-bench --help)", kExitUsage);
}

int64_t parse_int(const std::string& flag, const std::string& text, int64_t lo, int64_t hi) {
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw usage_error(flag + ": expected an integer, got \"" + text + "\"");
  if (value < lo || value > hi)
    throw usage_error(flag + ": " + text + " is outside [" + std::to_string(lo) + ", " +
                      std::to_string(hi) + "]");
  return value;
}

float parse_float(const std::string& flag, const std::string& text) {
  size_t used = 0;
  float value = 0;
  try {
    value = std::stof(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(value))
    throw usage_error(flag + ": expected a finite number, got \"" + text + "\"");
  return value;
}

std::vector<int64_t> parse_lengths(const std::string& text) {
  std::vector<int64_t> lengths;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ','))
    lengths.push_back(parse_int("--lengths", item, 0, int64_t(1) << 26));
  if (lengths.empty()) throw usage_error("--lengths: expected a comma-separated list");
  return lengths;
}

Options parse_options(int argc, char** argv) {
  Options options;
  std::optional<int64_t> B, T, H;
  std::vector<int64_t> lengths;
  std::vector<std::string> case_files;
  std::vector<std::string> named;

  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg.rfind("--", 0) != 0) {
      named.push_back(arg);
      continue;
    }
    std::optional<std::string> inline_value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    const auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw usage_error(arg + " needs a value");
      return argv[++i];
    };
    const auto no_value = [&] {
      if (inline_value) throw usage_error(arg + " takes no value");
    };

    if (arg == "--help") {
      no_value();
      options.help = true;
    } else if (arg == "--list") {
      no_value();
      options.list = true;
    } else if (arg == "--cpu") {
      no_value();
      options.on_cpu = true;
    } else if (arg == "--B") {
      B = parse_int(arg, value(), 1, int64_t(1) << 20);
    } else if (arg == "--T") {
      T = parse_int(arg, value(), 1, int64_t(1) << 26);
    } else if (arg == "--H") {
      H = parse_int(arg, value(), 1, 4096);
    } else if (arg == "--lengths") {
      lengths = parse_lengths(value());
    } else if (arg == "--cases") {
      case_files.push_back(value());
    } else if (arg == "--state") {
      const std::string state = value();
      if (state == "bf16")
        options.timing.state_dtype = FKDA_DTYPE_BF16;
      else if (state == "f32")
        options.timing.state_dtype = FKDA_DTYPE_F32;
      else
        throw usage_error("--state: expected bf16 or f32, got \"" + state + "\"");
    } else if (arg == "--warmup") {
      options.timing.warmup = int(parse_int(arg, value(), 0, 1000000));
    } else if (arg == "--iters") {
      options.timing.iters = int(parse_int(arg, value(), 1, 1000000));
    } else if (arg == "--gate") {
      const std::string gate = value();
      if (gate == "bounded")
        options.timing.gate_mode = FKDA_GATE_BOUNDED;
      else if (gate == "softplus")
        options.timing.gate_mode = FKDA_GATE_SOFTPLUS;
      else if (gate == "log-decay")
        options.timing.gate_mode = FKDA_GATE_LOG_DECAY;
      else
        throw usage_error("--gate: expected bounded, softplus or log-decay, got \"" + gate + "\"");
    } else if (arg == "--lower-bound") {
      options.timing.lower_bound = parse_float(arg, value());
    } else if (arg == "--seed") {
      options.timing.seed = uint64_t(parse_int(arg, value(), 0, INT64_MAX));
    } else if (arg == "--json") {
      options.json_path = value();
    } else if (arg == "--commit") {
      options.commit = value();
    } else {
      throw usage_error("unknown option " + arg);
    }
  }
  if (options.help) return options;

  const auto add_serving = [&](bool (*wanted)(ServingKind)) {
    for (const auto& c : serving_cases())
      if (wanted(c.kind)) options.serving.push_back(c);
  };
  const auto add_accuracy = [&](bool long_memory) {
    for (const auto& c : accuracy_cases())
      if (c.long_memory == long_memory && !c.long_context) options.accuracy.push_back(c);
  };
  for (const std::string& name : named) {
    if (name == "accuracy" || name == "long-memory") {
      add_accuracy(name == "long-memory");
    } else if (name == "prefill" || name == "all") {
      for (const auto& c : prefill_cases()) options.cases.push_back(c);
      if (name == "all") {
        add_serving([](ServingKind) { return true; });
        add_accuracy(false);
        add_accuracy(true);
      }
    } else if (name == "serving") {
      add_serving([](ServingKind) { return true; });
    } else if (name == "decode") {
      add_serving([](ServingKind kind) { return kind == ServingKind::kDecode; });
    } else if (name == "spec") {
      add_serving([](ServingKind kind) { return kind == ServingKind::kSpecVerify; });
    } else if (name == "pool") {
      add_serving([](ServingKind kind) { return kind == ServingKind::kPoolPrefill; });
    } else if (name == "long") {
      for (const auto& c : long_context_cases()) options.cases.push_back(c);
      for (const auto& c : accuracy_cases())
        if (c.long_context) options.accuracy.push_back(c);
    } else if (const BenchCase* long_case = find_long_context_case(name)) {
      options.cases.push_back(*long_case);
    } else if (name == "softplus") {
      options.timing.gate_mode = FKDA_GATE_SOFTPLUS;
      for (const auto& c : softplus_cases()) options.cases.push_back(c);
    } else if (const BenchCase* c = find_prefill_case(name)) {
      options.cases.push_back(*c);
    } else if (const ServingCase* serving = find_serving_case(name)) {
      options.serving.push_back(*serving);
    } else if (const AccuracyCase* accuracy = find_accuracy_case(name)) {
      options.accuracy.push_back(*accuracy);
    } else {
      throw usage_error("unknown case \"" + name +
                        "\"; known: P1 ... P14, D1 ... D8, S1 ... S3, R1, R2, A1, A2, "
                        "LM1 ... LM4, LM4S, L1 ... L6, prefill, softplus, decode, spec, pool, "
                        "serving, accuracy, long-memory, long, all");
    }
  }

  if (B || T || H || !lengths.empty()) {
    BenchCase custom;
    custom.id = "custom";
    if (!H) throw usage_error("a custom shape needs --H");
    custom.H = *H;
    if (!lengths.empty()) {
      if (B || T) throw usage_error("--lengths describes a packed varlen batch: drop --B and --T");
      custom.lengths = lengths;
    } else {
      if (!T) throw usage_error("a custom shape needs --T (or --lengths)");
      custom.B = B.value_or(1);
      custom.T = *T;
    }
    try {
      validate_case(custom);
    } catch (const std::runtime_error& e) {
      throw usage_error(e.what());
    }
    options.cases.push_back(custom);
  }
  for (const std::string& path : case_files) {
    try {
      for (auto& c : load_cases_file(path)) options.cases.push_back(std::move(c));
    } catch (const std::runtime_error& e) {
      throw usage_error(e.what());
    }
  }
  if (options.cases.empty() && options.serving.empty() && options.accuracy.empty())
    options.cases = options.timing.gate_mode == FKDA_GATE_SOFTPLUS ? softplus_cases() : prefill_cases();
  if (options.timing.gate_mode == FKDA_GATE_SOFTPLUS) {
    // Peer figures and targets of the softplus table where it has the case.
    for (BenchCase& c : options.cases)
      if (const BenchCase* softplus = find_softplus_case(c.id)) c = *softplus;
  }

  const float lb = options.timing.lower_bound;
  if (!(lb >= -5.f && lb <= 0.f))
    throw usage_error("--lower-bound: " + format("%g", lb) + " is outside [-5, 0]");
  if (options.on_cpu && !options.list) {
    if (!options.cases.empty())
      throw usage_error("--cpu runs the accuracy, decode and spec cases only; prefill timing "
                        "needs a GPU");
    for (const auto& c : options.serving)
      if (c.pool_slots > 0)
        throw usage_error("--cpu: " + c.id + " needs a GPU (a pool of " +
                          std::to_string(c.pool_slots) + " slots)");
  }
  return options;
}

// ------------------------------------------------------------- listing ---

// FLA's state GB/s: our count of state bytes over FLA's median.
std::string fla_state_gbps_text(const ServingCase& c) {
  if (std::isnan(c.fla_ms)) return "-";
  return format("%.0f", c.state_bytes_moved() / (c.fla_ms * 1e-3) / 1e9);
}

std::string serving_target_text(const ServingCase& c) {
  if (!std::isnan(c.target_ms)) return format("%.3f ms", c.target_ms);
  return format("%.2fx P8", c.target_ratio_to_p8);
}

// Table cells of an accuracy target and the peers' figures.
struct AccuracyCells {
  std::string target_out, target_state, flashkda, fla;
};

AccuracyCells accuracy_cells(const AccuracyTarget& target, const AccuracyTarget& flashkda,
                             const AccuracyTarget& fla) {
  // A peer without figures (FlashKDA has no softplus gate) shows "-".
  const auto pair = [](const AccuracyTarget& t) {
    return std::isnan(t.out) ? std::string("-") : format("%.1e / %.1e", t.out, t.final_state);
  };
  return {format("%.1e", target.out), format("%.1e", target.final_state), pair(flashkda), pair(fla)};
}

void print_case_list(const Options& options) {
  const fkda_dtype state = options.timing.state_dtype;
  std::printf("Prefill cases (K = V = 128, bf16 activations, initial and final state, "
              "lower_bound = -5). Peer figures: one H200, median ms, bf16 state "
              "(FLA: f32 state).\n\n");
  TextTable table({"case", "shape", "tokens", "seqs", "FlashKDA ms", "FLA ms", "target ms",
                   format("MB moved (%s state)", state_dtype_name(state)),
                   "FlashKDA ws MB", "note"},
                  "llrrrrrrrl");
  // Listed cases: the ones a run would time, else the whole prefill table.
  const std::vector<BenchCase>& cases = options.cases.empty() ? prefill_cases() : options.cases;
  for (const auto& c : cases) {
    table.add_row({c.id, c.shape(), std::to_string(c.total_tokens()), std::to_string(c.num_seqs()),
                   ms_or_dash(c.flashkda_ms), ms_or_dash(c.fla_ms), ms_or_dash(c.target_ms),
                   format("%.1f", bytes_moved(c, state) / 1e6),
                   format("%.1f", flashkda_workspace_bytes(c) / 1e6), c.note});
  }
  table.print(stdout);
  std::printf("\nWorkspace target: fkda_plan_workspace_size for P1 <= %.2f GB "
              "(FlashKDA: %.2f GB).\n",
              kP1WorkspaceTargetBytes / 1e9, flashkda_workspace_bytes(prefill_cases()[0]) / 1e9);

  std::printf("\nServing cases (states in a pool [slots, H, 128, 128], slot 0 reserved, "
              "scattered slots, int32 cu_seqlens, lower_bound = -5). FLA: fused_recurrent_kda, "
              "one H200, median ms.\n\n");
  TextTable serving({"case", "kind", "shape", "tokens", "FLA ms", "FLA state GB/s", "target",
                     "state MB moved"},
                    "lllrrrrr");
  for (const auto& c : options.serving.empty() ? serving_cases() : options.serving)
    serving.add_row({c.id, serving_kind_name(c.kind), c.shape(), std::to_string(c.total_tokens()),
                     ms_or_dash(c.fla_ms), fla_state_gbps_text(c), serving_target_text(c),
                     format("%.1f", c.state_bytes_moved() / 1e6)});
  serving.print(stdout);

  std::printf("\nAccuracy cases (\"accuracy\", \"long-memory\"): relative L2 error against the "
              "fp64 recurrence; q, k, v, beta ~ N(0,1), A_log, dt_bias ~ U(0,1); A1, A2: "
              "g ~ N(0,1), initial state ~ 0.1 N(0,1); LM1 ... LM3: initial state ~ N(0,1). "
              "Peers' figures: FLA with f32 state.\n\n");
  TextTable accuracy({"case", "shape", "state", "target out", "target state", "FlashKDA out/state",
                      "FLA out/state (f32)"},
                     "lllrrrr");
  for (const auto& c : options.accuracy.empty() ? accuracy_cases() : options.accuracy)
    for (fkda_dtype dtype : {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}) {
      const AccuracyCells cells =
          accuracy_cells(accuracy_target(c, dtype), c.flashkda_figures, c.fla_figures);
      accuracy.add_row({c.id, c.shape(), state_dtype_name(dtype), cells.target_out,
                        cells.target_state, cells.flashkda, cells.fla});
    }
  accuracy.print(stdout);
}

// -------------------------------------------------------------- results ---

struct CaseRun {
  BenchCase bench_case;
  TimingResult timing;
};

std::string target_status(const CaseRun& run) {
  if (std::isnan(run.bench_case.target_ms)) return "-";
  return run.timing.median_ms <= run.bench_case.target_ms ? "meets target" : "misses target";
}

void print_timing_table(const std::vector<CaseRun>& runs, const Options& options) {
  std::printf("\nPrefill, %s gate, %s state, median of %d calls after %d warm-up calls:\n\n",
              gate_name(options.timing.gate_mode), state_dtype_name(options.timing.state_dtype),
              options.timing.iters, options.timing.warmup);
  TextTable table({"case", "shape", "median ms", "min ms", "max ms", "GB/s", "workspace MB",
                   "FlashKDA ms", "FLA ms", "target ms", "status"},
                  "llrrrrrrrrl");
  for (const auto& run : runs) {
    const BenchCase& c = run.bench_case;
    table.add_row({c.id, c.shape(), format("%.3f", run.timing.median_ms),
                   format("%.3f", run.timing.min_ms), format("%.3f", run.timing.max_ms),
                   format("%.0f", run.timing.gbps),
                   format("%.2f", double(run.timing.workspace_bytes) / 1e6),
                   ms_or_dash(c.flashkda_ms), ms_or_dash(c.fla_ms), ms_or_dash(c.target_ms),
                   target_status(run)});
  }
  table.print(stdout);
  std::printf("\nWorkspace bytes:");
  for (const auto& run : runs)
    std::printf(" %s=%zu", run.bench_case.id.c_str(), run.timing.workspace_bytes);
  std::printf("\n");
  for (const auto& run : runs) {
    if (run.bench_case.id != "P1") continue;
    const double bytes = double(run.timing.workspace_bytes);
    std::printf("P1 workspace: %.3f GB (target <= %.2f GB, FlashKDA %.2f GB): %s\n", bytes / 1e9,
                kP1WorkspaceTargetBytes / 1e9, flashkda_workspace_bytes(run.bench_case) / 1e9,
                bytes <= kP1WorkspaceTargetBytes ? "meets target" : "misses target");
  }
  if (options.timing.state_dtype == FKDA_DTYPE_F32)
    std::printf("Peers' figures are for bf16 state (FLA: f32); docs/BENCHMARKS.md puts FlashKDA's "
                "f32-state figures within 3%% of them.\n");
}

void print_accuracy_table(const std::vector<AccuracyResult>& results) {
  std::printf("\nAccuracy: relative L2 error against the fp64 recurrence:\n\n");
  TextTable table({"case", "shape", "state", "backend", "out", "final state", "target out",
                   "target state", "FlashKDA out/state", "FLA out/state (f32)", "status"},
                  "llllrrrrrrl");
  for (const auto& r : results) {
    const AccuracyCells cells = accuracy_cells(r.target, r.flashkda_figures, r.fla_figures);
    table.add_row({r.id, r.shape, state_dtype_name(r.state_dtype), r.backend,
                   format("%.2e", r.out_rel_l2), format("%.2e", r.state_rel_l2), cells.target_out,
                   cells.target_state, cells.flashkda, cells.fla,
                   r.within_target() ? "within target" : "ABOVE TARGET"});
  }
  table.print(stdout);
}

// The median of P8 with contiguous f32 states, the pool prefill cases'
// baseline: from this invocation's P8 when it ran with f32 states, else timed
// here when a pool prefill case was timed (NaN otherwise).
double p8_f32_baseline_ms(const std::vector<CaseRun>& prefill_runs,
                          const std::vector<ServingRun>& serving_runs, const Options& options,
                          const std::optional<DeviceContext>& device) {
  const bool wanted = std::any_of(serving_runs.begin(), serving_runs.end(), [](const auto& run) {
    return run.timed && run.serving_case.kind == ServingKind::kPoolPrefill;
  });
  if (!wanted) return std::numeric_limits<double>::quiet_NaN();
  if (options.timing.state_dtype == FKDA_DTYPE_F32)
    for (const auto& p : prefill_runs)
      if (p.bench_case.id == "P8") return p.timing.median_ms;
  TimingOptions f32 = options.timing;
  f32.state_dtype = FKDA_DTYPE_F32;
  std::fprintf(stderr, "fkda-bench: P8 with f32 states, the pool prefill cases' baseline ...\n");
  const double ms = time_case(*find_prefill_case("P8"), f32, *device).median_ms;
  std::fprintf(stderr, "fkda-bench: P8 (f32 states): median %.3f ms\n", ms);
  return ms;
}

// Median of a pool prefill case over the P8 baseline (NaN for other cases).
double ratio_to_p8(const ServingRun& run, double p8_ms) {
  if (run.serving_case.kind != ServingKind::kPoolPrefill || !run.timed)
    return std::numeric_limits<double>::quiet_NaN();
  return run.timing.median_ms / p8_ms;
}

std::string serving_status(const ServingRun& run, double ratio) {
  if (!run.within_check()) return "WRONG RESULT";
  const ServingCase& c = run.serving_case;
  if (!run.timed) return "checked";
  if (!std::isnan(c.target_ms))
    return run.timing.median_ms <= c.target_ms ? "meets target" : "misses target";
  return ratio <= c.target_ratio_to_p8 ? "meets target" : "misses target";
}

void print_serving_table(const std::vector<ServingRun>& runs, double p8_ms,
                         const Options& options) {
  if (options.on_cpu)
    std::printf("\nServing cases on the CPU backend, one call each, checked against the fp64 "
                "recurrence:\n\n");
  else
    std::printf("\nServing cases, median of %d calls after %d warm-up calls:\n\n",
                options.timing.iters, options.timing.warmup);
  TextTable table({"case", "shape", "slots", "median ms", "min ms", "max ms", "graph ms",
                   "state GB/s", "GB/s", "out err", "state err", "FLA ms", "FLA state GB/s", "target",
                   "x P8", "status"},
                  "llrrrrrrrrrrrrrl");
  for (const auto& run : runs) {
    const ServingCase& c = run.serving_case;
    const double ratio = ratio_to_p8(run, p8_ms);
    const auto timed = [&](const char* fmt, double value) {
      return run.timed ? format(fmt, value) : std::string("-");
    };
    const auto error = [&](double value) {
      return run.checked() ? format("%.2e", value) : std::string("-");
    };
    table.add_row({c.id, c.shape(), std::to_string(run.pool_slots),
                   timed("%.4f", run.timing.median_ms), timed("%.4f", run.timing.min_ms),
                   timed("%.4f", run.timing.max_ms), timed("%.4f", run.timing.graph_mean_ms),
                   timed("%.0f", run.state_gbps),
                   timed("%.0f", run.timing.gbps), error(run.out_rel_l2), error(run.state_rel_l2),
                   ms_or_dash(c.fla_ms), fla_state_gbps_text(c), serving_target_text(c),
                   std::isnan(ratio) ? std::string("-") : format("%.3f", ratio),
                   serving_status(run, ratio)});
  }
  table.print(stdout);
  if (!std::isnan(p8_ms))
    std::printf("x P8: over P8 with contiguous f32 states, median %.3f ms.\n", p8_ms);
}

nlohmann::ordered_json ms_json(double ms) {
  return std::isnan(ms) ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(ms);
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm parts{};
  gmtime_r(&now, &parts);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &parts);
  return text;
}

void write_json(const std::string& path, const Options& options,
                const std::optional<DeviceContext>& device, const std::vector<CaseRun>& runs,
                const std::vector<ServingRun>& serving_runs, double p8_ms,
                const std::vector<AccuracyResult>& accuracy) {
  using json = nlohmann::ordered_json;
  json doc;
  doc["tool"] = "fkda-bench";
  doc["date_utc"] = utc_now();
  doc["library_version"] = fkda_version_string();
  if (!options.commit.empty()) {
    doc["commit"] = options.commit;
    doc["commit_source"] = "--commit";
  } else if (std::string(FKDA_BENCH_GIT_DESCRIBE).empty()) {
    doc["commit"] = nullptr;
    doc["commit_source"] = "unknown";
  } else {
    doc["commit"] = FKDA_BENCH_GIT_DESCRIBE;
    doc["commit_source"] = "git describe when fkda-bench was built";
  }
  if (device) {
    doc["device"] = {{"name", device->name},
                     {"compute_capability", format("%d.%d", device->cc_major, device->cc_minor)},
                     {"sm_count", device->sm_count},
                     {"l2_bytes", device->l2_bytes},
                     {"memory_bytes", device->total_memory},
                     {"driver_version", device->driver_version},
                     {"runtime_version", device->runtime_version}};
  } else {
    doc["device"] = nullptr;
  }
  doc["settings"] = {{"state_dtype", state_dtype_name(options.timing.state_dtype)},
                     {"warmup", options.timing.warmup},
                     {"iters", options.timing.iters},
                     {"lower_bound", options.timing.lower_bound},
                     {"gate", gate_name(options.timing.gate_mode)},
                     {"seed", options.timing.seed},
                     {"head_dim_k", 128},
                     {"head_dim_v", 128}};

  json prefill = json::array();
  for (const auto& run : runs) {
    const BenchCase& c = run.bench_case;
    json shape = {{"B", c.varlen() ? 1 : c.B}, {"T", c.varlen() ? c.total_tokens() : c.T},
                  {"H", c.H}};
    if (c.varlen()) shape["lengths"] = c.lengths;
    shape["total_tokens"] = c.total_tokens();
    shape["num_seqs"] = c.num_seqs();
    json entry = {{"id", c.id}, {"shape_text", c.shape()}, {"shape", shape}};
    entry["ms"] = {{"median", run.timing.median_ms},
                   {"min", run.timing.min_ms},
                   {"max", run.timing.max_ms},
                   {"back_to_back_mean", run.timing.back_to_back_mean_ms},
                   {"graph_mean", ms_json(run.timing.graph_mean_ms)}};
    entry["host_us_per_call"] = run.timing.host_us_per_call;
    entry["gbps"] = run.timing.gbps;
    entry["bytes_moved"] = run.timing.bytes_moved;
    entry["workspace_bytes"] = run.timing.workspace_bytes;
    entry["flashkda_workspace_bytes"] = flashkda_workspace_bytes(c);
    entry["input_sets"] = run.timing.input_sets;
    entry["input_set_bytes"] = run.timing.input_set_bytes;
    entry["peers"] = {{"flashkda_ms", ms_json(c.flashkda_ms)},
                      {"fla_ms", ms_json(c.fla_ms)},
                      {"target_ms", ms_json(c.target_ms)}};
    entry["meets_target"] = std::isnan(c.target_ms)
                                ? json(nullptr)
                                : json(run.timing.median_ms <= c.target_ms);
    if (!c.note.empty()) entry["note"] = c.note;
    prefill.push_back(entry);
  }
  doc["prefill"] = prefill;

  json serving = json::array();
  for (const auto& run : serving_runs) {
    const ServingCase& c = run.serving_case;
    const double ratio = ratio_to_p8(run, p8_ms);
    json shape = {{"N", c.N}, {"H", c.H}, {"tokens_per_seq", c.tokens_per_seq},
                  {"pool_dtype", state_dtype_name(c.pool_dtype)}, {"pool_slots", run.pool_slots}};
    if (c.checkpoints_per_seq() > 0) {
      shape["checkpoint_every"] = c.checkpoint_every;
      shape["checkpoints_per_seq"] = c.checkpoints_per_seq();
    }
    json entry = {{"id", c.id}, {"kind", serving_kind_name(c.kind)}, {"shape_text", c.shape()},
                  {"shape", shape}, {"backend", run.timed ? "GPU" : "CPU"}};
    if (run.timed) {
      entry["ms"] = {{"median", run.timing.median_ms},
                     {"min", run.timing.min_ms},
                     {"max", run.timing.max_ms},
                     {"back_to_back_mean", run.timing.back_to_back_mean_ms},
                     {"graph_mean", ms_json(run.timing.graph_mean_ms)}};
      entry["host_us_per_call"] = run.timing.host_us_per_call;
      entry["state_gbps"] = run.state_gbps;
      entry["gbps"] = run.timing.gbps;
      entry["input_sets"] = run.timing.input_sets;
    }
    entry["state_bytes_moved"] = c.state_bytes_moved();
    entry["workspace_bytes"] = run.timing.workspace_bytes;
    entry["check"] = run.checked() ? json{{"sequences", run.checked_seqs},
                                          {"out_rel_l2", run.out_rel_l2},
                                          {"state_rel_l2", run.state_rel_l2},
                                          {"tolerance", kServingCheckTolerance},
                                          {"passed", run.within_check()}}
                                   : json(nullptr);
    entry["peers"] = {{"fla_ms", ms_json(c.fla_ms)},
                      {"target_ms", ms_json(c.target_ms)},
                      {"target_ratio_to_p8", ms_json(c.target_ratio_to_p8)}};
    entry["ratio_to_p8"] = ms_json(ratio);
    const std::string status = serving_status(run, ratio);
    entry["meets_target"] = status == "meets target"    ? json(true)
                            : status == "misses target" ? json(false)
                                                        : json(nullptr);
    serving.push_back(entry);
  }
  doc["serving"] = serving;
  doc["p8_f32_state_ms"] = ms_json(p8_ms);

  json accuracy_list = json::array();
  for (const auto& r : accuracy) {
    accuracy_list.push_back({{"id", r.id},
                             {"shape_text", r.shape},
                             {"state_dtype", state_dtype_name(r.state_dtype)},
                             {"backend", r.backend},
                             {"out_rel_l2", r.out_rel_l2},
                             {"final_state_rel_l2", r.state_rel_l2},
                             {"target", {{"out", r.target.out},
                                         {"final_state", r.target.final_state}}},
                             {"peers", {{"flashkda", {{"out", r.flashkda_figures.out},
                                                      {"final_state", r.flashkda_figures.final_state}}},
                                        {"fla_f32_state", {{"out", r.fla_figures.out},
                                                           {"final_state", r.fla_figures.final_state}}}}},
                             {"within_target", r.within_target()}});
  }
  doc["accuracy"] = accuracy_list;

  std::ofstream file(path);
  file << doc.dump(2) << '\n';
  file.close();
  if (!file) throw BenchError("cannot write " + path, kExitFailure);
  std::printf("\nWrote %s\n", path.c_str());
}

int run(int argc, char** argv) {
  const Options options = parse_options(argc, argv);
  if (options.help) {
    std::fputs(kUsage, stdout);
    return kExitOk;
  }
  if (options.list) {
    print_case_list(options);
    return kExitOk;
  }

  const std::string commit = !options.commit.empty()           ? options.commit
                             : *FKDA_BENCH_GIT_DESCRIBE != '\0' ? FKDA_BENCH_GIT_DESCRIBE
                                                                : "unknown";
  std::optional<DeviceContext> device;
  const bool needs_gpu = !options.on_cpu &&
                         (!options.cases.empty() || !options.serving.empty() ||
                          !options.accuracy.empty());
  if (needs_gpu) device = open_device();

  std::printf("fkda-bench: libflashkda %s, commit %s\n", fkda_version_string(), commit.c_str());
  if (device)
    std::printf("device 0: %s (sm_%d%d, %d SMs, L2 %.0f MB, driver %d, runtime %d)\n",
                device->name.c_str(), device->cc_major, device->cc_minor, device->sm_count,
                double(device->l2_bytes) / 1048576.0, device->driver_version,
                device->runtime_version);
  std::fflush(stdout);

  std::vector<CaseRun> runs;
  for (const BenchCase& c : options.cases) {
    std::fprintf(stderr, "fkda-bench: %s (%s) ...\n", c.id.c_str(), c.shape().c_str());
    CaseRun run{c, time_case(c, options.timing, *device)};
    std::fprintf(stderr,
                 "fkda-bench: %s: median %.3f ms, back-to-back mean %.3f ms, graph mean %.3f ms, "
                 "host %.1f us a call (%d input sets of %.1f MB, setup %.1f s)\n",
                 c.id.c_str(), run.timing.median_ms, run.timing.back_to_back_mean_ms,
                 run.timing.graph_mean_ms, run.timing.host_us_per_call,
                 run.timing.input_sets,
                 double(run.timing.input_set_bytes) / 1e6, run.timing.setup_seconds);
    runs.push_back(std::move(run));
  }
  if (!runs.empty()) print_timing_table(runs, options);

  std::vector<ServingRun> serving_runs;
  for (const ServingCase& c : options.serving) {
    std::fprintf(stderr, "fkda-bench: %s (%s) ...\n", c.id.c_str(), c.shape().c_str());
    ServingRun run = run_serving_case(c, options.timing, device);
    if (run.timed)
      std::fprintf(stderr,
                   "fkda-bench: %s: median %.4f ms, back-to-back mean %.4f ms, graph mean %.4f ms, "
                   "host %.1f us a call (%d input sets, pool of %lld slots, setup %.1f s)\n",
                   c.id.c_str(), run.timing.median_ms, run.timing.back_to_back_mean_ms,
                   run.timing.graph_mean_ms, run.timing.host_us_per_call,
                   run.timing.input_sets, static_cast<long long>(run.pool_slots),
                   run.timing.setup_seconds);
    serving_runs.push_back(std::move(run));
  }
  const double p8_ms = p8_f32_baseline_ms(runs, serving_runs, options, device);
  if (!serving_runs.empty()) print_serving_table(serving_runs, p8_ms, options);

  std::vector<AccuracyResult> accuracy;
  if (!options.accuracy.empty()) {
    accuracy = run_accuracy(options.accuracy, options.on_cpu, options.timing.lower_bound,
                            options.timing.seed);
    print_accuracy_table(accuracy);
  }

  if (!options.json_path.empty())
    write_json(options.json_path, options, device, runs, serving_runs, p8_ms, accuracy);

  for (const auto& run : serving_runs)
    if (!run.within_check()) {
      std::fprintf(stderr, "fkda-bench: %s differs from the fp64 recurrence (out %.2e, state %.2e)\n",
                   run.serving_case.id.c_str(), run.out_rel_l2, run.state_rel_l2);
      return kExitAccuracyMissed;
    }
  for (const auto& r : accuracy)
    if (!r.within_target()) {
      std::fprintf(stderr, "fkda-bench: accuracy above target (%s, %s state)\n", r.id.c_str(),
                   state_dtype_name(r.state_dtype));
      return kExitAccuracyMissed;
    }
  return kExitOk;
}

}  // namespace
}  // namespace fkda_bench

int main(int argc, char** argv) {
  try {
    return fkda_bench::run(argc, argv);
  } catch (const fkda_bench::BenchError& e) {
    std::fprintf(stderr, "fkda-bench: %s\n", e.what());
    return e.exit_code();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fkda-bench: error: %s\n", e.what());
    return fkda_bench::kExitFailure;
  }
}
