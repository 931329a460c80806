// fkda-bench: times libflashkda's prefill on the cases of docs/BENCHMARKS.md
// (or custom shapes), prints the peers' figures beside ours, checks accuracy
// against the fp64 recurrence, and writes the results as JSON.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
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
#include "timing.h"

#ifndef FKDA_BENCH_GIT_DESCRIBE
#define FKDA_BENCH_GIT_DESCRIBE ""
#endif

namespace fkda_bench {
namespace {

constexpr double kP1WorkspaceTargetBytes = 0.34e9;

const char* const kUsage = R"(usage: fkda-bench [CASE...] [accuracy] [options]

Times libflashkda's prefill (fkda_fwd) on one GPU with random inputs and
prints median/min/max ms, effective GB/s and workspace bytes per case, beside
the FlashKDA, FLA and target figures of docs/BENCHMARKS.md.

Cases:
  P1 ... P10          prefill cases of docs/BENCHMARKS.md (case-insensitive)
  prefill             all of P1 ... P10 (the default when nothing else is asked)
  all                 prefill and accuracy
  accuracy            relative L2 error of out and final state against the fp64
                      recurrence (T=1024 H=4 and varlen [300,77,700] H=4), with
                      bf16 and f32 state
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
  --seed N            seed of the random inputs (default 1)
  --json FILE         also write the results as JSON to FILE
  --commit SHA        commit recorded in the results (default: git describe
                      of the source tree when the build was configured)
  --cpu               accuracy on the CPU backend (host memory, no GPU needed)
  --list              print the cases and exit; touches no GPU
  --help              print this text and exit
  Options also take the form --name=value.

Timing: device 0 is made current (cudaSetDevice(0), cudaFree(0)); each call
is bracketed by CUDA events after the warm-up; the calls rotate over several
input sets that together exceed the L2 cache many times. GB/s counts q, k, v,
g, beta and the initial state read once and out and the final state written
once.

Exit status: 0 success; 1 a library, CUDA or output check failed; 2 bad
command line or cases file; 3 no usable GPU; 4 an accuracy figure above its
target.
)";

struct Options {
  std::vector<BenchCase> cases;
  bool run_accuracy = false;
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

  for (const std::string& name : named) {
    if (name == "accuracy") {
      options.run_accuracy = true;
    } else if (name == "prefill" || name == "all") {
      for (const auto& c : prefill_cases()) options.cases.push_back(c);
      if (name == "all") options.run_accuracy = true;
    } else if (const BenchCase* c = find_prefill_case(name)) {
      options.cases.push_back(*c);
    } else if ((name[0] == 'D' || name[0] == 'd') && name.size() == 2 && name[1] >= '1' &&
               name[1] <= '5') {
      throw usage_error("decode case " + name +
                        " needs a decode entry point, which this library's ABI does not have");
    } else {
      throw usage_error("unknown case \"" + name + "\"; known: P1 ... P10, prefill, accuracy, all");
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
  if (options.cases.empty() && !options.run_accuracy)
    options.cases = prefill_cases();

  const float lb = options.timing.lower_bound;
  if (!(lb >= -5.f && lb <= 0.f))
    throw usage_error("--lower-bound: " + format("%g", lb) + " is outside [-5, 0]");
  if (options.on_cpu && !options.cases.empty() && !options.list)
    throw usage_error(
        "--cpu runs the accuracy cases only; timing cases need a GPU (ask for just \"accuracy\")");
  return options;
}

// ------------------------------------------------------------- listing ---

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

  std::printf("\nAccuracy cases (\"accuracy\"): relative L2 error against the fp64 recurrence; "
              "q, k, v, g, beta ~ N(0,1), A_log, dt_bias ~ U(0,1), initial state ~ 0.1 N(0,1).\n\n");
  TextTable accuracy({"case", "shape", "state", "target out", "target state", "FlashKDA out/state",
                      "FLA out/state (f32)"},
                     "lllrrrr");
  for (const auto& c : accuracy_cases())
    for (fkda_dtype dtype : {FKDA_DTYPE_BF16, FKDA_DTYPE_F32}) {
      const AccuracyTarget target = accuracy_target(dtype);
      accuracy.add_row({c.id, c.shape(), state_dtype_name(dtype), format("%.1e", target.out),
                        format("%.1e", target.final_state),
                        format("%.1e / %.1e", kFlashKdaAccuracy.out, kFlashKdaAccuracy.final_state),
                        format("%.1e / %.1e", kFlaAccuracy.out, kFlaAccuracy.final_state)});
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
  std::printf("\nPrefill, %s state, median of %d calls after %d warm-up calls:\n\n",
              state_dtype_name(options.timing.state_dtype), options.timing.iters,
              options.timing.warmup);
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
    table.add_row({r.id, r.shape, state_dtype_name(r.state_dtype), r.backend,
                   format("%.2e", r.out_rel_l2), format("%.2e", r.state_rel_l2),
                   format("%.1e", r.target.out), format("%.1e", r.target.final_state),
                   format("%.1e / %.1e", kFlashKdaAccuracy.out, kFlashKdaAccuracy.final_state),
                   format("%.1e / %.1e", kFlaAccuracy.out, kFlaAccuracy.final_state),
                   r.within_target() ? "within target" : "ABOVE TARGET"});
  }
  table.print(stdout);
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
    doc["commit_source"] = "git describe when the build was configured";
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
                   {"back_to_back_mean", run.timing.back_to_back_mean_ms}};
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
  const bool needs_gpu = !options.cases.empty() || (options.run_accuracy && !options.on_cpu);
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
                 "fkda-bench: %s: median %.3f ms, back-to-back mean %.3f ms (%d input sets of "
                 "%.1f MB, setup %.1f s)\n",
                 c.id.c_str(), run.timing.median_ms, run.timing.back_to_back_mean_ms,
                 run.timing.input_sets,
                 double(run.timing.input_set_bytes) / 1e6, run.timing.setup_seconds);
    runs.push_back(std::move(run));
  }
  if (!runs.empty()) print_timing_table(runs, options);

  std::vector<AccuracyResult> accuracy;
  if (options.run_accuracy) {
    accuracy = run_accuracy(options.on_cpu, options.timing.lower_bound, options.timing.seed);
    print_accuracy_table(accuracy);
  }

  if (!options.json_path.empty()) write_json(options.json_path, options, device, runs, accuracy);

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
