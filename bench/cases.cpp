// SPDX-License-Identifier: MIT
#include "cases.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace fkda_bench {
namespace {

constexpr double kUnknown = std::numeric_limits<double>::quiet_NaN();
constexpr int64_t kHeadDim = 128;
constexpr int64_t kChunk = 16;
constexpr double kFlashKdaWorkspacePerChunkHead = 13824.0;

// Beyond these the int64 byte counts below stop being meaningful for a
// single GPU; they only guard against typos such as an extra zero digit.
constexpr int64_t kMaxTokens = int64_t(1) << 26;
constexpr int64_t kMaxHeads = 4096;

BenchCase make_case(std::string id, int64_t B, int64_t T, int64_t H, std::vector<int64_t> lengths,
                    double flashkda_ms, double fla_ms, double target_ms, std::string note = {}) {
  BenchCase c;
  c.id = std::move(id);
  c.B = B;
  c.T = T;
  c.H = H;
  c.lengths = std::move(lengths);
  c.flashkda_ms = flashkda_ms;
  c.fla_ms = fla_ms;
  c.target_ms = target_ms;
  c.note = std::move(note);
  return c;
}

std::string to_upper(std::string s) {
  for (char& ch : s) ch = char(std::toupper(static_cast<unsigned char>(ch)));
  return s;
}

std::string lengths_text(const std::vector<int64_t>& lengths) {
  const bool all_equal = std::all_of(lengths.begin(), lengths.end(),
                                     [&](int64_t n) { return n == lengths.front(); });
  std::ostringstream text;
  if (all_equal && lengths.size() > 1) {
    text << lengths.size() << 'x' << lengths.front();
    return text.str();
  }
  text << '[';
  for (size_t i = 0; i < lengths.size(); ++i) text << (i ? "," : "") << lengths[i];
  text << ']';
  return text.str();
}

int64_t json_int(const nlohmann::json& entry, const char* key, const std::string& where) {
  const auto& value = entry.at(key);
  if (!value.is_number_integer())
    throw std::runtime_error(where + ": \"" + key + "\" must be an integer, got " + value.dump());
  return value.get<int64_t>();
}

double json_ms(const nlohmann::json& entry, const char* key, const std::string& where) {
  if (!entry.contains(key)) return kUnknown;
  const auto& value = entry.at(key);
  if (value.is_null()) return kUnknown;
  if (!value.is_number() || !(value.get<double>() > 0))
    throw std::runtime_error(where + ": \"" + key + "\" must be a positive number of ms, got " +
                             value.dump());
  return value.get<double>();
}

}  // namespace

BenchCase::BenchCase() : flashkda_ms(kUnknown), fla_ms(kUnknown), target_ms(kUnknown) {}

int64_t BenchCase::total_tokens() const {
  return varlen() ? std::accumulate(lengths.begin(), lengths.end(), int64_t(0)) : B * T;
}

int64_t BenchCase::num_seqs() const { return varlen() ? int64_t(lengths.size()) : B; }

std::string BenchCase::shape() const {
  std::ostringstream text;
  if (varlen())
    text << "varlen " << lengths_text(lengths) << " H=" << H;
  else
    text << "B=" << B << " T=" << T << " H=" << H;
  return text.str();
}

double bytes_moved(const BenchCase& c, fkda_dtype state_dtype) {
  const double tokens_heads = double(c.total_tokens()) * double(c.H);
  const double activation = tokens_heads * kHeadDim * 2;  // bf16 [tokens, H, 128]
  const double beta = tokens_heads * 2;
  const double state = double(c.num_seqs()) * double(c.H) * kHeadDim * kHeadDim *
                       double(state_dtype_bytes(state_dtype));
  // Reads: q, k, v, g, beta, initial state. Writes: out, final state.
  return 4 * activation + beta + state + activation + state;
}

double flashkda_workspace_bytes(const BenchCase& c) {
  double chunks = 0;
  if (c.varlen()) {
    for (int64_t n : c.lengths) chunks += double((n + kChunk - 1) / kChunk);
  } else {
    chunks = double(c.B) * double((c.T + kChunk - 1) / kChunk);
  }
  return chunks * double(c.H) * kFlashKdaWorkspacePerChunkHead;
}

constexpr double kNoFigure = std::numeric_limits<double>::quiet_NaN();

const std::vector<BenchCase>& prefill_cases() {
  static const std::vector<BenchCase> cases = {
      make_case("P1", 1, 8192, 96, {}, 1.422, 2.621, 1.00),
      make_case("P2", 1, 8192, 64, {}, 1.209, 1.748, 0.85),
      make_case("P3", 1, 8192, 32, {}, 1.002, 1.013, 0.60),
      make_case("P4", 1, 8192, 8, {}, 0.845, 0.907, 0.35),
      make_case("P5", 1, 32768, 8, {}, 3.296, 1.629, 1.00),
      make_case("P6", 4, 2048, 32, {}, 0.430, 1.008, 0.30, "batched, no varlen"),
      make_case("P7", 1, 0, 96, {1300, 547, 2048, 963, 271, 3063}, 1.364, 2.665, 0.95),
      make_case("P8", 1, 0, 96, std::vector<int64_t>(8, 1024), 1.173, 2.637, 0.80),
      make_case("P9", 1, 0, 32, std::vector<int64_t>(8, 1024), 0.415, 1.370, 0.30),
      make_case("P10", 1, 512, 32, {}, 0.083, 1.665, 0.05,
                "FLA's time here is mostly Python-side launch overhead"),
      // The head counts deployments run per GPU.
      make_case("P11", 1, 8192, 12, {}, 0.878, 1.855, 0.20),
      make_case("P12", 1, 0, 12, std::vector<int64_t>(16, 512), 0.188, kNoFigure, 0.06),
      make_case("P13", 1, 8192, 24, {}, 0.956, kNoFigure, 0.25),
      make_case("P14", 1, 2048, 12, {}, 0.239, kNoFigure, 0.08),
  };
  return cases;
}

const std::vector<BenchCase>& long_context_cases() {
  // FLA: chunk_kda serial, one H200 at be852e4 (issue 17's table).
  static const std::vector<BenchCase> cases = {
      make_case("L1", 1, 0, 4, {65536}, kUnknown, 2.167, 0.30, "serial at be852e4: 2.076 ms"),
      make_case("L2", 1, 0, 4, {131072}, kUnknown, 4.240, 0.55, "serial at be852e4: 4.159 ms"),
      make_case("L3", 1, 0, 4, {1048576}, kUnknown, kUnknown, 4.5, "serial at be852e4: about 33 ms"),
      make_case("L4", 1, 0, 4, {8192}, kUnknown, 0.979, 0.08, "serial at be852e4: 0.276 ms"),
      make_case("L5", 1, 0, 4, std::vector<int64_t>(4, 16384), kUnknown, 1.142, 0.15,
                "serial at be852e4: 0.629 ms"),
      make_case("L6", 1, 0, 12, {65536}, kUnknown, 4.590, 0.55, "serial at be852e4: 2.333 ms"),
  };
  return cases;
}

const BenchCase* find_long_context_case(const std::string& id) {
  const std::string wanted = to_upper(id);
  for (const auto& c : long_context_cases())
    if (c.id == wanted) return &c;
  return nullptr;
}

const std::vector<BenchCase>& softplus_cases() {
  const double none = std::numeric_limits<double>::quiet_NaN();
  static const std::vector<BenchCase> cases = {
      make_case("P1", 1, 8192, 96, {}, none, 2.913, 1.10, "softplus gate"),
      make_case("P3", 1, 8192, 32, {}, none, 1.598, 0.47, "softplus gate"),
      make_case("P11", 1, 8192, 12, {}, none, 0.992, 0.42, "softplus gate"),
  };
  return cases;
}

const BenchCase* find_softplus_case(const std::string& id) {
  const std::string wanted = to_upper(id);
  for (const auto& c : softplus_cases())
    if (c.id == wanted) return &c;
  return nullptr;
}

const BenchCase* find_prefill_case(const std::string& id) {
  const std::string wanted = to_upper(id);
  for (const auto& c : prefill_cases())
    if (c.id == wanted) return &c;
  return nullptr;
}

void validate_case(const BenchCase& c) {
  const std::string where = "case " + (c.id.empty() ? std::string("(unnamed)") : c.id);
  if (c.H < 1 || c.H > kMaxHeads)
    throw std::runtime_error(where + ": H must be in [1, " + std::to_string(kMaxHeads) +
                             "], got " + std::to_string(c.H));
  if (c.varlen()) {
    if (c.B != 1) throw std::runtime_error(where + ": varlen cases need B = 1");
    for (int64_t n : c.lengths)
      if (n < 0 || n > kMaxTokens)
        throw std::runtime_error(where + ": sequence length " + std::to_string(n) +
                                 " is out of range");
  } else {
    if (c.B < 1 || c.B > kMaxTokens)
      throw std::runtime_error(where + ": B must be >= 1, got " + std::to_string(c.B));
    if (c.T < 1 || c.T > kMaxTokens)
      throw std::runtime_error(where + ": T must be >= 1, got " + std::to_string(c.T));
  }
  if (c.total_tokens() < 1 || c.total_tokens() > kMaxTokens)
    throw std::runtime_error(where + ": total tokens must be in [1, " +
                             std::to_string(kMaxTokens) + "], got " +
                             std::to_string(c.total_tokens()));
}

std::vector<BenchCase> load_cases_file(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw std::runtime_error("cannot open cases file " + path);
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(file);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": not valid JSON: " + e.what());
  }
  const nlohmann::json* list = &doc;
  if (doc.is_object()) {
    if (!doc.contains("cases")) throw std::runtime_error(path + ": expected a \"cases\" array");
    list = &doc.at("cases");
  }
  if (!list->is_array() || list->empty())
    throw std::runtime_error(path + ": expected a non-empty array of cases");

  static const std::set<std::string> known_keys = {"id", "B", "T", "H", "lengths", "flashkda_ms",
                                                   "fla_ms", "target_ms", "note"};
  std::vector<BenchCase> cases;
  std::set<std::string> ids;
  for (size_t i = 0; i < list->size(); ++i) {
    const auto& entry = (*list)[i];
    std::string where = path + ": case #" + std::to_string(i + 1);
    if (!entry.is_object()) throw std::runtime_error(where + ": expected an object");
    for (const auto& item : entry.items())
      if (!known_keys.count(item.key()))
        throw std::runtime_error(where + ": unknown field \"" + item.key() + "\"");
    try {
      BenchCase c;
      if (!entry.contains("id") || !entry.at("id").is_string() ||
          entry.at("id").get<std::string>().empty())
        throw std::runtime_error(where + ": needs a non-empty string \"id\"");
      c.id = entry.at("id").get<std::string>();
      where += " (" + c.id + ")";
      if (!ids.insert(c.id).second) throw std::runtime_error(where + ": duplicate id");
      if (!entry.contains("H")) throw std::runtime_error(where + ": needs \"H\"");
      c.H = json_int(entry, "H", where);
      if (entry.contains("lengths")) {
        if (entry.contains("T") || entry.contains("B"))
          throw std::runtime_error(where + ": give either \"lengths\" or \"T\" (and \"B\")");
        const auto& lengths = entry.at("lengths");
        if (!lengths.is_array() || lengths.empty())
          throw std::runtime_error(where + ": \"lengths\" must be a non-empty array");
        for (const auto& n : lengths) {
          if (!n.is_number_integer())
            throw std::runtime_error(where + ": \"lengths\" must hold integers, got " + n.dump());
          c.lengths.push_back(n.get<int64_t>());
        }
      } else {
        if (!entry.contains("T")) throw std::runtime_error(where + ": needs \"T\" or \"lengths\"");
        c.T = json_int(entry, "T", where);
        c.B = entry.contains("B") ? json_int(entry, "B", where) : 1;
      }
      c.flashkda_ms = json_ms(entry, "flashkda_ms", where);
      c.fla_ms = json_ms(entry, "fla_ms", where);
      c.target_ms = json_ms(entry, "target_ms", where);
      if (entry.contains("note")) {
        if (!entry.at("note").is_string())
          throw std::runtime_error(where + ": \"note\" must be a string");
        c.note = entry.at("note").get<std::string>();
      }
      validate_case(c);
      cases.push_back(std::move(c));
    } catch (const nlohmann::json::exception& e) {
      throw std::runtime_error(where + ": " + e.what());
    }
  }
  return cases;
}

ServingCase::ServingCase() : fla_ms(kUnknown), target_ms(kUnknown), target_ratio_to_p8(kUnknown) {}

int64_t ServingCase::checkpoints_per_seq() const {
  if (kind != ServingKind::kPoolPrefill || checkpoint_every <= 0) return 0;
  return (tokens_per_seq - 1) / checkpoint_every;
}

int64_t ServingCase::slots_per_call() const {
  switch (kind) {
    case ServingKind::kSpecVerify: return N * tokens_per_seq;
    case ServingKind::kPoolPrefill: return N * (1 + checkpoints_per_seq());
    case ServingKind::kDecode: break;
  }
  return N;
}

double ServingCase::state_bytes_moved() const {
  const double one_state = double(H) * kHeadDim * kHeadDim * double(state_dtype_bytes(pool_dtype));
  const int64_t writes = kind == ServingKind::kSpecVerify ? tokens_per_seq
                                                          : 1 + checkpoints_per_seq();
  return double(N) * one_state * double(1 + writes);
}

std::string ServingCase::shape() const {
  std::ostringstream text;
  switch (kind) {
    case ServingKind::kDecode: text << "N=" << N << " H=" << H; break;
    case ServingKind::kSpecVerify: text << "N=" << N << " H=" << H << " T=" << tokens_per_seq; break;
    case ServingKind::kPoolPrefill:
      text << "varlen " << N << 'x' << tokens_per_seq << " H=" << H;
      if (checkpoints_per_seq() > 0) text << " ckpt/" << checkpoint_every;
      break;
  }
  text << ' ' << state_dtype_name(pool_dtype) << " pool";
  if (pool_slots > 0) text << " of " << pool_slots;
  return text.str();
}

const char* serving_kind_name(ServingKind kind) {
  switch (kind) {
    case ServingKind::kDecode: return "decode";
    case ServingKind::kSpecVerify: return "spec verify";
    case ServingKind::kPoolPrefill: return "pool prefill";
  }
  return "?";
}

namespace {

ServingCase decode_case(std::string id, ServingKind kind, int64_t N, int64_t H, int64_t T,
                        fkda_dtype pool_dtype, double fla_ms, double target_ms) {
  ServingCase c;
  c.id = std::move(id);
  c.kind = kind;
  c.N = N;
  c.H = H;
  c.tokens_per_seq = T;
  c.pool_dtype = pool_dtype;
  c.fla_ms = fla_ms;
  c.target_ms = target_ms;
  return c;
}

ServingCase pool_prefill_case(std::string id, int64_t checkpoint_every, double target_ratio) {
  // P8's shape: 8 sequences of 1024 tokens, 96 heads.
  ServingCase c;
  c.id = std::move(id);
  c.kind = ServingKind::kPoolPrefill;
  c.N = 8;
  c.H = 96;
  c.tokens_per_seq = 1024;
  c.pool_slots = 4096;
  c.checkpoint_every = checkpoint_every;
  c.target_ratio_to_p8 = target_ratio;
  return c;
}

}  // namespace

const std::vector<ServingCase>& serving_cases() {
  constexpr auto kDecode = ServingKind::kDecode;
  constexpr auto kSpec = ServingKind::kSpecVerify;
  constexpr auto kF32 = FKDA_DTYPE_F32;
  static const std::vector<ServingCase> cases = {
      decode_case("D1", kDecode, 1, 32, 1, kF32, 0.016, 0.008),
      decode_case("D2", kDecode, 16, 32, 1, kF32, 0.029, 0.020),
      decode_case("D3", kDecode, 64, 32, 1, kF32, 0.092, 0.070),
      decode_case("D4", kDecode, 256, 32, 1, kF32, 0.366, 0.270),
      decode_case("D5", kDecode, 256, 96, 1, kF32, 1.171, 0.800),
      decode_case("D6", kDecode, 256, 12, 1, kF32, 0.128, 0.105),
      decode_case("D7", kDecode, 1024, 12, 1, kF32, 0.543, 0.420),
      decode_case("D8", kDecode, 256, 32, 1, FKDA_DTYPE_BF16, 0.227, 0.140),
      decode_case("S1", kSpec, 64, 32, 4, kF32, 0.225, 0.175),
      decode_case("S2", kSpec, 256, 12, 4, kF32, 0.352, 0.260),
      decode_case("S3", kSpec, 64, 12, 8, kF32, 0.158, 0.120),
      pool_prefill_case("R1", 0, 1.02),
      pool_prefill_case("R2", 256, 1.10),
  };
  return cases;
}

const ServingCase* find_serving_case(const std::string& id) {
  const std::string wanted = to_upper(id);
  for (const auto& c : serving_cases())
    if (c.id == wanted) return &c;
  return nullptr;
}

std::string AccuracyCase::shape() const {
  std::ostringstream text;
  if (lengths.empty())
    text << "B=1 T=" << T << " H=" << H;
  else
    text << "varlen " << lengths_text(lengths) << " H=" << H;
  if (long_memory)
    text << " lb=" << *lower_bound << " g~N(" << gate_mean << "," << gate_std << "^2)";
  if (softplus) text << (extreme ? " softplus g~N(0,4^2)" : " softplus g~N(0,1)");
  return text.str();
}

namespace {

const AccuracyTarget kFlashKdaGeneral = {5.8e-3, 5.0e-3};
const AccuracyTarget kFlaGeneral = {4.1e-3, 2.9e-3};

AccuracyCase long_memory_case(std::string id, int64_t T, int64_t H, float lower_bound,
                              float gate_mean, float gate_std, AccuracyTarget flashkda,
                              AccuracyTarget fla) {
  AccuracyCase c;
  c.id = std::move(id);
  c.T = T;
  c.H = H;
  c.long_memory = true;
  c.lower_bound = lower_bound;
  c.gate_mean = gate_mean;
  c.gate_std = gate_std;
  c.initial_state_std = 1.f;
  c.flashkda_figures = flashkda;
  c.fla_figures = fla;
  return c;
}

}  // namespace

// T = 2048, H = 4 under the softplus gate; FlashKDA has no figures (no such gate).
AccuracyCase softplus_case(std::string id, bool extreme, AccuracyTarget fla) {
  AccuracyCase c;
  c.id = std::move(id);
  c.T = 2048;
  c.H = 4;
  c.softplus = true;
  c.extreme = extreme;
  const double none = std::numeric_limits<double>::quiet_NaN();
  c.flashkda_figures = {none, none};
  c.fla_figures = fla;
  return c;
}

// L1's shape (one sequence of 65536 tokens, H = 4, varlen) with an initial
// state ~ N(0, 1): slow decays at lower_bound -5, or SP1's softplus gate.
AccuracyCase long_context_case(std::string id, bool softplus) {
  AccuracyCase c;
  if (softplus) {
    c = softplus_case(std::move(id), false, {kUnknown, kUnknown});
  } else {
    c = long_memory_case(std::move(id), 0, 4, -5.f, -6.f, 1.f, {kUnknown, kUnknown}, {kUnknown, kUnknown});
  }
  c.T = 0;
  c.H = 4;
  c.lengths = {65536};
  c.initial_state_std = 1.f;
  c.long_context = true;
  return c;
}

const std::vector<AccuracyCase>& accuracy_cases() {
  static const std::vector<AccuracyCase> cases = [] {
    AccuracyCase single;
    single.id = "A1";
    single.T = 1024;
    single.H = 4;
    single.flashkda_figures = kFlashKdaGeneral;
    single.fla_figures = kFlaGeneral;
    AccuracyCase packed = single;
    packed.id = "A2";
    packed.T = 0;
    packed.lengths = {300, 77, 700};
    return std::vector<AccuracyCase>{
        single,
        packed,
        long_memory_case("LM1", 4096, 4, -5.f, -6.f, 1.f, {8.2e-3, 7.7e-3}, {5.6e-3, 4.8e-3}),
        long_memory_case("LM2", 4096, 4, -5.f, -2.f, 2.f, {6.1e-3, 5.1e-3}, {4.2e-3, 3.4e-3}),
        long_memory_case("LM3", 8192, 2, -1.f, 0.f, 1.f, {6.0e-3, 4.6e-3}, {4.1e-3, 3.6e-3}),
        softplus_case("SP1", false, {4.4e-3, 3.8e-3}),
        softplus_case("SP2", true, {4.1e-3, 3.1e-3}),
        long_context_case("LM4", false),
        long_context_case("LM4S", true),
    };
  }();
  return cases;
}

const AccuracyCase* find_accuracy_case(const std::string& id) {
  const std::string wanted = to_upper(id);
  for (const auto& c : accuracy_cases())
    if (c.id == wanted) return &c;
  return nullptr;
}

AccuracyTarget accuracy_target(const AccuracyCase& c, fkda_dtype state_dtype) {
  const bool f32 = state_dtype == FKDA_DTYPE_F32;
  if (c.long_memory || c.softplus) return f32 ? AccuracyTarget{3.0e-3, 1.0e-3} : AccuracyTarget{3.0e-3, 2.0e-3};
  return f32 ? AccuracyTarget{4.0e-3, 2.9e-3} : AccuracyTarget{6.0e-3, 5.0e-3};
}

const char* state_dtype_name(fkda_dtype dtype) {
  switch (dtype) {
    case FKDA_DTYPE_BF16: return "bf16";
    case FKDA_DTYPE_F32: return "f32";
    default: return "?";
  }
}

size_t state_dtype_bytes(fkda_dtype dtype) { return dtype == FKDA_DTYPE_F32 ? 4 : 2; }

}  // namespace fkda_bench
