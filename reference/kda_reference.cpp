// SPDX-License-Identifier: MIT
// The accuracy reference. It shares no code with the library on purpose: it
// runs the recurrence of docs/ARCHITECTURE.md (section 1) token by token in
// fp64, with its own bf16/f16 conversions, so that a mistake in the backends cannot hide in a helper both use.

#include "kda_reference.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

namespace fkda_ref {

// ---------------------------------------------------------- conversions ---

uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  uint32_t upper = bits >> 16;
  if (std::isnan(x)) return static_cast<uint16_t>(upper | 0x0040u);  // quiet, sign kept
  const uint32_t dropped = bits & 0xFFFFu;
  const bool round_up = dropped > 0x8000u || (dropped == 0x8000u && (upper & 1u) != 0);
  if (round_up) ++upper;  // a carry into the exponent is the correct next value
  return static_cast<uint16_t>(upper);
}

float from_bf16(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &widened, sizeof x);
  return x;
}

uint16_t to_f16(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000u : 0u;
  if (std::isnan(x)) return static_cast<uint16_t>(sign | 0x7E00u);
  const double magnitude = std::fabs(static_cast<double>(x));
  if (magnitude >= 65504.0) return static_cast<uint16_t>(sign | 0x7BFFu);  // satfinite
  if (magnitude == 0.0) return sign;
  // The spacing of f16 values around `magnitude`: 2^-24 among the subnormals
  // (below 2^-14), else 2^(exponent - 10).
  const int exponent = std::ilogb(magnitude);
  const double spacing = std::ldexp(1.0, (exponent < -14 ? -14 : exponent) - 10);
  const double units = std::nearbyint(magnitude / spacing);  // ties to even
  const double rounded = units * spacing;
  if (rounded == 0.0) return sign;
  if (rounded < std::ldexp(1.0, -14)) return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));
  const int rounded_exponent = std::ilogb(rounded);  // may have carried up by one
  const double mantissa = rounded / std::ldexp(1.0, rounded_exponent - 10) - 1024.0;
  return static_cast<uint16_t>(sign | ((rounded_exponent + 15) << 10) | static_cast<uint16_t>(mantissa));
}

float from_f16(uint16_t bits) {
  const double sign = (bits & 0x8000u) ? -1.0 : 1.0;
  const int exponent_field = (bits >> 10) & 0x1F;
  const int mantissa = bits & 0x3FF;
  if (exponent_field == 0x1F)
    return mantissa == 0 ? static_cast<float>(sign * std::numeric_limits<double>::infinity())
                         : std::numeric_limits<float>::quiet_NaN();
  if (exponent_field == 0) return static_cast<float>(sign * std::ldexp(mantissa, -24));
  return static_cast<float>(sign * std::ldexp(1024 + mantissa, exponent_field - 25));
}

std::vector<float> bf16_to_float(const std::vector<uint16_t>& bits) {
  std::vector<float> values(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) values[i] = from_bf16(bits[i]);
  return values;
}

// ------------------------------------------------------- random problems ---

Problem random_problem(const ProblemShape& shape, uint64_t seed) {
  if (shape.H <= 0) throw std::invalid_argument("random_problem: H must be positive");
  Problem p;
  p.H = shape.H;
  p.lower_bound = shape.lower_bound;
  if (!shape.lengths.empty()) {
    p.B = 1;
    p.cu_seqlens.push_back(0);
    for (int64_t length : shape.lengths) {
      if (length < 0) throw std::invalid_argument("random_problem: negative sequence length");
      p.cu_seqlens.push_back(p.cu_seqlens.back() + length);
    }
    p.T = p.cu_seqlens.back();
  } else {
    p.B = shape.B;
    p.T = shape.T;
  }
  p.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.K)));

  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> uniform(0.f, 1.f);
  auto bf16_normals = [&](size_t count) {
    std::vector<uint16_t> values(count);
    for (uint16_t& value : values) value = to_bf16(normal(rng));
    return values;
  };

  const size_t tokens = static_cast<size_t>(p.B * p.T * p.H);
  p.q = bf16_normals(tokens * p.K);
  p.k = bf16_normals(tokens * p.K);
  p.v = bf16_normals(tokens * p.V);
  p.g.resize(tokens * static_cast<size_t>(p.K));
  for (uint16_t& value : p.g) value = to_bf16(shape.gate_mean + shape.gate_std * normal(rng));
  p.beta = bf16_normals(tokens);
  p.A_log.resize(static_cast<size_t>(p.H));
  p.dt_bias.resize(static_cast<size_t>(p.H * p.K));
  if (shape.model_gate_parameters) {
    // exp(A_log) ~ U(1, 16); dt_bias = softplus⁻¹(x) = log(expm1(x)) of a
    // log-uniform x in [0.001, 0.1], so that softplus(dt_bias) = x.
    for (float& value : p.A_log) value = static_cast<float>(std::log(1.0 + 15.0 * uniform(rng)));
    const double log_lowest = std::log(0.001), log_highest = std::log(0.1);
    for (float& value : p.dt_bias) {
      const double x = std::exp(log_lowest + (log_highest - log_lowest) * uniform(rng));
      value = static_cast<float>(std::log(std::expm1(x)));
    }
  } else {
    for (float& value : p.A_log) value = uniform(rng);
    for (float& value : p.dt_bias) value = uniform(rng);
  }
  p.gate_mode = shape.gate_mode;
  if (p.gate_mode == FKDA_GATE_LOG_DECAY) {
    // Drawn all the same, so that the initial state below does not depend on the gate mode.
    p.A_log.clear();
    p.dt_bias.clear();
  }
  if (shape.with_initial_state) {
    p.initial_state.resize(static_cast<size_t>(p.state_elems()));
    for (float& value : p.initial_state) value = shape.initial_state_std * normal(rng);
  }
  return p;
}

ProblemShape realistic_softplus(ProblemShape shape) {
  shape.gate_mode = FKDA_GATE_SOFTPLUS;
  shape.model_gate_parameters = true;
  shape.lower_bound = -5.f;
  shape.gate_mean = 0.f;
  shape.gate_std = 1.f;
  return shape;
}

ProblemShape extreme_softplus(ProblemShape shape) {
  shape = realistic_softplus(shape);
  shape.gate_std = 4.f;
  return shape;
}

ProblemShape slow_decay(ProblemShape shape) {
  shape.lower_bound = -5.f;
  shape.gate_mean = -6.f;
  shape.gate_std = 1.f;
  shape.initial_state_std = 1.f;
  return shape;
}

Problem token_range(const Problem& p, int64_t row, int64_t begin, int64_t end) {
  if (row < 0 || row >= p.B || begin < 0 || end < begin || end > p.T)
    throw std::invalid_argument("token_range: tokens outside the problem");
  Problem part = p;
  part.B = 1;
  part.T = end - begin;
  part.cu_seqlens.clear();
  part.initial_state.clear();
  // Empty vectors (a g or beta passed as f32 instead) stay empty.
  auto slice = [&](const auto& all, int64_t per_token) {
    using Vector = std::decay_t<decltype(all)>;
    if (all.empty()) return Vector();
    const auto first = all.begin() + static_cast<std::ptrdiff_t>((row * p.T + begin) * per_token);
    return Vector(first, first + static_cast<std::ptrdiff_t>(part.T * per_token));
  };
  part.q = slice(p.q, p.H * p.K);
  part.k = slice(p.k, p.H * p.K);
  part.v = slice(p.v, p.H * p.V);
  part.g = slice(p.g, p.H * p.K);
  part.beta = slice(p.beta, p.H);
  part.g_f32 = slice(p.g_f32, p.H * p.K);
  part.beta_f32 = slice(p.beta_f32, p.H);
  part.layer.out_gate = slice(p.layer.out_gate, p.H * p.V);
  for (std::vector<float>& state : part.layer.conv_state) state.clear();
  return part;
}

AccuracyTargets accuracy_targets(fkda_dtype state_dtype, bool slow_decay) {
  const bool bf16 = state_dtype == FKDA_DTYPE_BF16;
  if (slow_decay) return bf16 ? AccuracyTargets{3.0e-3, 2.0e-3} : AccuracyTargets{3.0e-3, 1.0e-3};
  return bf16 ? AccuracyTargets{6.0e-3, 5.0e-3} : AccuracyTargets{4.0e-3, 2.9e-3};
}

// ------------------------------------------------ the fp64 recurrence ---

namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// log(1 + e^x), taken as x above 20 like the library's gate (flashkda.h).
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }

// The natural log-decay of channel c of activation row `row` ((b·T + t)·H + h)
// under p's gate mode (flashkda.h, fkda_gate_mode).
double log_decay_at(const Problem& p, int64_t row, int64_t h, int64_t c) {
  const size_t at = static_cast<size_t>(row * p.K + c);
  const double g = p.g_f32.empty() ? double(from_bf16(p.g[at])) : double(p.g_f32[at]);
  if (p.gate_mode == FKDA_GATE_LOG_DECAY) return std::min(g, 0.0);
  // Absent A_log and dt_bias mean exp(A_log) = 1 and dt_bias = 0.
  const double a_scale = p.A_log.empty() ? 1.0 : std::exp(static_cast<double>(p.A_log[static_cast<size_t>(h)]));
  const double gate = g + (p.dt_bias.empty() ? 0.0 : static_cast<double>(p.dt_bias[static_cast<size_t>(h * p.K + c)]));
  if (p.gate_mode == FKDA_GATE_SOFTPLUS) return -a_scale * softplus(gate);
  if (p.gate_mode == FKDA_GATE_BOUNDED) return static_cast<double>(p.lower_bound) * sigmoid(a_scale * gate);
  throw std::invalid_argument("reference: unknown gate_mode " + std::to_string(p.gate_mode));
}

// The delta rule's step size b of activation row `row` under p's beta mode.
double step_size_at(const Problem& p, int64_t row) {
  const size_t at = static_cast<size_t>(row);
  const double beta = p.beta_f32.empty() ? double(from_bf16(p.beta[at])) : double(p.beta_f32[at]);
  if (p.beta_mode == FKDA_BETA_LOGITS) return sigmoid(beta);
  if (p.beta_mode == FKDA_BETA_PROBABILITIES) return std::clamp(beta, 0.0, 1.0);
  throw std::invalid_argument("reference: unknown beta_mode " + std::to_string(p.beta_mode));
}

// x / sqrt(Σ x² + 1e-6) of one token's row.
void unit_vector(const std::vector<double>& x, std::vector<double>& unit) {
  double sum = 0.0;
  for (double value : x) sum += value * value;
  const double inverse_norm = 1.0 / std::sqrt(sum + 1e-6);
  for (size_t i = 0; i < x.size(); ++i) unit[i] = x[i] * inverse_norm;
}

// The inputs of one (sequence, head) token by token: q, k and v as passed,
// or, with the layer's convolution, silu(bias + Σ_j w[j] x[t-W+1+j]) of the
// raw inputs, the conv state before the first token. Each channel keeps a
// window of its last W inputs (before the first token: the conv state's last
// W columns, zeros where it has fewer or the sequence has none).
class LayerInputs {
 public:
  LayerInputs(const Problem& p, int64_t n, int64_t h) : p_(p), l_(p.layer), n_(n), h_(h) {
    const int64_t K = p.K, W = l_.conv_width, Wc = l_.conv_state_width;
    for (int projection = 0; projection < 3; ++projection) {
      windows_[projection].assign(static_cast<size_t>(K * W), 0.0);
      const std::vector<float>& state = l_.conv_state[projection];
      if (state.empty()) continue;
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < W; ++j) {
          const int64_t column = Wc - W + j;
          if (column >= 0) windows_[projection][static_cast<size_t>(i * W + j)] = state[state_index(i, column)];
        }
    }
  }

  // Token row `token` ((b·T + t)·H + h) of q, k or v (0, 1, 2) into x.
  void next(int projection, int64_t token, std::vector<double>& x) {
    const std::vector<uint16_t>& raw = projection == 0 ? p_.q : projection == 1 ? p_.k : p_.v;
    const int64_t n = static_cast<int64_t>(x.size()), W = l_.conv_width;
    for (int64_t i = 0; i < n; ++i) {
      const double input = from_bf16(raw[static_cast<size_t>(token * n + i)]);
      if (!l_.has_conv()) {
        x[static_cast<size_t>(i)] = input;
        continue;
      }
      double* window = &windows_[projection][static_cast<size_t>(i * W)];
      std::copy(window + 1, window + W, window);
      window[W - 1] = input;
      const size_t channel = static_cast<size_t>(h_ * p_.K + i);
      double sum = l_.conv_bias[projection].empty() ? 0.0 : l_.conv_bias[projection][channel];
      for (int64_t j = 0; j < W; ++j) sum += double(l_.conv_weight[projection][channel * size_t(W) + size_t(j)]) * window[j];
      x[static_cast<size_t>(i)] = sum / (1.0 + std::exp(-sum));
    }
  }

  // The conv states the windows hold now, into this sequence's rows of `states` ([N, H*K, Wc] each).
  void store(std::array<std::vector<double>, 3>& states) const {
    const int64_t W = l_.conv_width, Wc = l_.conv_state_width;
    for (int projection = 0; projection < 3; ++projection)
      for (int64_t i = 0; i < p_.K; ++i)
        for (int64_t j = 0; j < Wc; ++j)
          states[projection][state_index(i, j)] = windows_[projection][static_cast<size_t>(i * W + W - Wc + j)];
  }

 private:
  size_t state_index(int64_t i, int64_t column) const {
    return static_cast<size_t>(((n_ * p_.H + h_) * p_.K + i) * l_.conv_state_width + column);
  }
  const Problem& p_;
  const LayerStep& l_;
  int64_t n_, h_;
  std::vector<double> windows_[3];
};

// The output gate of one head's row of V outputs, in fp64, in place:
// o / sqrt(mean(o²) + eps) · w · sigmoid(g_out).
void gate_output(const LayerStep& l, const uint16_t* gate, double* o, int64_t V) {
  double sum = 0.0;
  for (int64_t e = 0; e < V; ++e) sum += o[e] * o[e];
  const double inverse_rms = 1.0 / std::sqrt(sum / double(V) + double(l.out_norm_eps));
  for (int64_t e = 0; e < V; ++e)
    o[e] *= inverse_rms * double(l.out_norm_weight[static_cast<size_t>(e)]) * sigmoid(from_bf16(gate[e]));
}

}  // namespace

Reference reference_recurrence(const Problem& p, const std::vector<int64_t>& state_tokens) {
  const int64_t N = p.num_seqs(), H = p.H, K = p.K, V = p.V;
  const bool varlen = !p.cu_seqlens.empty();
  Reference ref;
  ref.out.assign(static_cast<size_t>(p.B * p.T * H * V), 0.0);
  ref.final_state.assign(static_cast<size_t>(N * H * V * K), 0.0);
  ref.states_after.assign(state_tokens.size(), ref.final_state);
  const bool convolution = p.layer.has_conv();
  std::array<std::vector<double>, 3> conv_state;
  if (convolution) {
    for (std::vector<double>& states : conv_state)
      states.assign(static_cast<size_t>(N * H * K * p.layer.conv_state_width), 0.0);
  }
  ref.conv_states_after.assign(convolution ? state_tokens.size() : 0, conv_state);

  // Each (sequence, head) pair writes its own rows and states, so the pairs
  // run on threads: at long context (LM4, T = 65536) one thread takes minutes.
  auto run_pair = [&](int64_t n, int64_t h) {
    std::vector<double> state(static_cast<size_t>(V * K));  // S[e][c], V-first
    std::vector<double> q_in(K), k_in(K), v_in(V), q_unit(K), k_unit(K), decay(K);
    LayerInputs inputs(p, n, h);
    const int64_t row = varlen ? 0 : n;
    const int64_t begin = varlen ? p.cu_seqlens[n] : 0;
    const int64_t end = varlen ? p.cu_seqlens[n + 1] : p.T;
    const size_t state_base = static_cast<size_t>((n * H + h) * V * K);
    for (size_t i = 0; i < state.size(); ++i)
      state[i] = p.initial_state.empty() ? 0.0 : static_cast<double>(p.initial_state[state_base + i]);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t token = (row * p.T + t) * H + h;
      inputs.next(0, token, q_in);
      inputs.next(1, token, k_in);
      inputs.next(2, token, v_in);
      unit_vector(q_in, q_unit);
      unit_vector(k_in, k_unit);
      // exp(-inf) = 0: total forgetting zeroes the state, never NaN.
      for (int64_t c = 0; c < K; ++c) decay[c] = std::exp(log_decay_at(p, token, h, c));
      const double b = step_size_at(p, token);

      for (int64_t e = 0; e < V; ++e) {
        double* s_row = &state[e * K];
        double predicted = 0.0;
        for (int64_t c = 0; c < K; ++c) {
          s_row[c] *= decay[c];
          predicted += s_row[c] * k_unit[c];
        }
        const double correction = b * (v_in[e] - predicted);
        double output = 0.0;
        for (int64_t c = 0; c < K; ++c) {
          s_row[c] += correction * k_unit[c];
          output += s_row[c] * q_unit[c];
        }
        ref.out[token * V + e] = static_cast<double>(p.scale) * output;
      }
      if (p.layer.has_out_gate()) gate_output(p.layer, &p.layer.out_gate[token * V], &ref.out[token * V], V);
      for (size_t c = 0; c < state_tokens.size(); ++c) {
        if (state_tokens[c] != t - begin + 1) continue;
        std::copy(state.begin(), state.end(), ref.states_after[c].begin() + static_cast<std::ptrdiff_t>(state_base));
        if (convolution) inputs.store(ref.conv_states_after[c]);
      }
    }
    std::copy(state.begin(), state.end(), ref.final_state.begin() + static_cast<std::ptrdiff_t>(state_base));
    if (convolution) inputs.store(conv_state);
  };

  const int64_t pairs = N * H;
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::string failure;
  std::mutex failure_mutex;
  auto work = [&] {
    for (int64_t pair = next++; pair < pairs && !failed; pair = next++) {
      try {
        run_pair(pair / H, pair % H);
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        failure = e.what();
        failed = true;
      }
    }
  };
  const int64_t threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, std::max<int64_t>(pairs, 1));
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(work);
  work();
  for (std::thread& thread : pool) thread.join();
  if (failed) throw std::invalid_argument(failure);
  for (int projection = 0; projection < 3; ++projection) ref.conv_state[projection] = std::move(conv_state[projection]);
  return ref;
}

ReferenceTransitions reference_transitions(const Problem& p) {
  if (p.K != p.V) throw std::invalid_argument("reference_transitions: the identity run needs K == V");
  ReferenceTransitions t;
  Problem from_zeros = p;
  from_zeros.initial_state.clear();
  t.e = reference_recurrence(from_zeros).final_state;
  Problem from_identity = from_zeros;
  std::fill(from_identity.v.begin(), from_identity.v.end(), uint16_t(0));  // bf16 +0
  from_identity.initial_state.assign(static_cast<size_t>(p.state_elems()), 0.f);
  for (int64_t head = 0; head < p.num_seqs() * p.H; ++head)
    for (int64_t i = 0; i < p.K; ++i) from_identity.initial_state[static_cast<size_t>((head * p.K + i) * p.K + i)] = 1.f;
  t.m = reference_recurrence(from_identity).final_state;
  return t;
}

std::vector<double> log_decays(const Problem& p) {
  std::vector<double> decays(static_cast<size_t>(p.B * p.T * p.H * p.K));
  for (int64_t row = 0; row < p.B * p.T * p.H; ++row)
    for (int64_t c = 0; c < p.K; ++c) decays[static_cast<size_t>(row * p.K + c)] = log_decay_at(p, row, row % p.H, c);
  return decays;
}

Problem as_log_decay(const Problem& p, bool f32) {
  const std::vector<double> decays = log_decays(p);
  Problem q = p;
  q.gate_mode = FKDA_GATE_LOG_DECAY;
  q.lower_bound = -5.f;
  q.A_log.clear();
  q.dt_bias.clear();
  q.g.clear();
  q.g_f32.clear();
  for (double a : decays) {
    if (f32)
      q.g_f32.push_back(static_cast<float>(a));
    else
      q.g.push_back(to_bf16(static_cast<float>(a)));
  }
  return q;
}

Problem as_probabilities(const Problem& p, bool f32) {
  Problem q = p;
  q.beta_mode = FKDA_BETA_PROBABILITIES;
  q.beta.clear();
  q.beta_f32.clear();
  for (int64_t row = 0; row < p.B * p.T * p.H; ++row) {
    const float b = static_cast<float>(step_size_at(p, row));
    if (f32)
      q.beta_f32.push_back(b);
    else
      q.beta.push_back(to_bf16(b));
  }
  return q;
}

std::vector<GateVariant> gate_variants(const ProblemShape& shape, uint64_t seed) {
  Problem bounded_without_A_log = random_problem(slow_decay(shape), seed);
  bounded_without_A_log.A_log.clear();
  Problem bounded_without_dt_bias = random_problem(slow_decay(shape), seed + 1);
  bounded_without_dt_bias.dt_bias.clear();
  const Problem realistic = random_problem(realistic_softplus(shape), seed + 2);
  const Problem extreme = random_problem(extreme_softplus(shape), seed + 3);
  Problem softplus_without_dt_bias = random_problem(realistic_softplus(shape), seed + 4);
  softplus_without_dt_bias.dt_bias.clear();
  return {
      {"bounded without A_log", bounded_without_A_log},
      {"bounded without dt_bias", bounded_without_dt_bias},
      {"softplus, realistic gates", realistic},
      {"softplus, extreme gates", extreme},
      {"softplus without dt_bias", softplus_without_dt_bias},
      {"log-decay bf16 g (realistic)", as_log_decay(realistic, false)},
      {"log-decay f32 g (realistic)", as_log_decay(realistic, true)},
      {"log-decay bf16 g (extreme)", as_log_decay(extreme, false)},
      {"log-decay f32 g (extreme)", as_log_decay(extreme, true)},
      {"beta probabilities bf16 (softplus)", as_probabilities(realistic, false)},
      {"beta probabilities f32 (log-decay f32)", as_probabilities(as_log_decay(extreme, true), true)},
  };
}

Problem with_edge_log_decays(Problem p, int64_t all_minus_inf, int64_t all_minus_300) {
  if (p.gate_mode != FKDA_GATE_LOG_DECAY) throw std::invalid_argument("with_edge_log_decays: not a log-decay problem");
  const float infinity = std::numeric_limits<float>::infinity();
  const float channel_decays[] = {-1e4f, 0.f, -infinity};
  auto in_sequence = [&](int64_t t, int64_t n) {
    return !p.cu_seqlens.empty() && n >= 0 && n < p.num_seqs() && t >= p.cu_seqlens[size_t(n)] &&
           t < p.cu_seqlens[size_t(n) + 1];
  };
  auto edge = [&](int64_t t, int64_t c, float as_was) {
    if (in_sequence(t, all_minus_inf)) return -infinity;
    if (in_sequence(t, all_minus_300)) return -300.f;
    return c % 4 == 3 ? as_was : channel_decays[c % 4];
  };
  for (int64_t row = 0; row < p.B * p.T * p.H; ++row) {
    const int64_t t = row / p.H % p.T;
    for (int64_t c = 0; c < p.K; ++c) {
      const size_t at = static_cast<size_t>(row * p.K + c);
      if (p.g_f32.empty())
        p.g[at] = to_bf16(edge(t, c, from_bf16(p.g[at])));
      else
        p.g_f32[at] = edge(t, c, p.g_f32[at]);
    }
  }
  return p;
}

double rel_l2(const std::vector<float>& a, const std::vector<double>& b) {
  const double infinity = std::numeric_limits<double>::infinity();
  if (a.size() != b.size()) return infinity;
  double error = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return infinity;
    const double difference = static_cast<double>(a[i]) - b[i];
    error += difference * difference;
    norm += b[i] * b[i];
  }
  if (norm == 0.0) return error == 0.0 ? 0.0 : infinity;
  return std::sqrt(error / norm);
}

// ------------------------------------------------------------ arguments ---

fkda_tensor tensor(void* data, fkda_dtype dtype, std::vector<int64_t> shape) {
  if (shape.size() > FKDA_MAX_RANK) throw std::invalid_argument("tensor: rank above FKDA_MAX_RANK");
  fkda_tensor t = FKDA_TENSOR_NONE;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int32_t>(shape.size());
  int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[i] = shape[static_cast<size_t>(i)];
    t.strides[i] = stride;
    stride *= shape[static_cast<size_t>(i)];
  }
  return t;
}

fkda_fwd_args make_args(const Problem& p, const Buffers& buffers, fkda_dtype state_dtype) {
  fkda_fwd_args args = FKDA_FWD_ARGS_INIT;
  const int64_t N = p.num_seqs();
  args.q = tensor(buffers.q, FKDA_DTYPE_BF16, {p.B, p.T, p.H, p.K});
  args.k = tensor(buffers.k, FKDA_DTYPE_BF16, {p.B, p.T, p.H, p.K});
  args.v = tensor(buffers.v, FKDA_DTYPE_BF16, {p.B, p.T, p.H, p.V});
  args.g = tensor(buffers.g, p.g_f32.empty() ? FKDA_DTYPE_BF16 : FKDA_DTYPE_F32, {p.B, p.T, p.H, p.K});
  args.beta = tensor(buffers.beta, p.beta_f32.empty() ? FKDA_DTYPE_BF16 : FKDA_DTYPE_F32, {p.B, p.T, p.H});
  if (!p.A_log.empty()) args.A_log = tensor(buffers.A_log, FKDA_DTYPE_F32, {p.H});
  if (!p.dt_bias.empty()) args.dt_bias = tensor(buffers.dt_bias, FKDA_DTYPE_F32, {p.H, p.K});
  args.out = tensor(buffers.out, FKDA_DTYPE_BF16, {p.B, p.T, p.H, p.V});
  if (buffers.initial_state != nullptr)
    args.initial_state = tensor(buffers.initial_state, state_dtype, {N, p.H, p.V, p.K});
  if (buffers.final_state != nullptr)
    args.final_state = tensor(buffers.final_state, state_dtype, {N, p.H, p.V, p.K});
  if (buffers.cu_seqlens != nullptr) args.cu_seqlens = tensor(buffers.cu_seqlens, FKDA_DTYPE_I64, {N + 1});
  args.scale = p.scale;
  return args;
}

fkda_decode_args make_decode_args(const Problem& p, const Buffers& buffers) {
  const fkda_fwd_args fwd = make_args(p, buffers, FKDA_DTYPE_F32);
  fkda_decode_args args = FKDA_DECODE_ARGS_INIT;
  args.q = fwd.q;
  args.k = fwd.k;
  args.v = fwd.v;
  args.g = fwd.g;
  args.beta = fwd.beta;
  args.A_log = fwd.A_log;
  args.dt_bias = fwd.dt_bias;
  args.out = fwd.out;
  args.cu_seqlens = fwd.cu_seqlens;
  args.scale = fwd.scale;
  return args;
}

fkda_transition_args make_transition_args(const Problem& p, const Buffers& buffers, void* m, void* e) {
  const fkda_fwd_args fwd = make_args(p, buffers, FKDA_DTYPE_F32);
  fkda_transition_args args = FKDA_TRANSITION_ARGS_INIT;
  args.k = fwd.k;
  args.v = fwd.v;
  args.g = fwd.g;
  args.beta = fwd.beta;
  args.A_log = fwd.A_log;
  args.dt_bias = fwd.dt_bias;
  args.cu_seqlens = fwd.cu_seqlens;
  const int64_t N = p.num_seqs();
  args.transition_m = tensor(m, FKDA_DTYPE_F32, {N, p.H, p.K, p.K});
  args.transition_e = tensor(e, FKDA_DTYPE_F32, {N, p.H, p.V, p.K});
  return args;
}

Buffers host_buffers(Problem& p, void* out) {
  Buffers buffers{p.q.data(),
                  p.k.data(),
                  p.v.data(),
                  p.g_f32.empty() ? static_cast<void*>(p.g.data()) : p.g_f32.data(),
                  p.beta_f32.empty() ? static_cast<void*>(p.beta.data()) : p.beta_f32.data(),
                  p.A_log.data(),
                  p.dt_bias.data(),
                  out};
  if (!p.cu_seqlens.empty()) buffers.cu_seqlens = p.cu_seqlens.data();
  return buffers;
}

void apply_gate(const Problem& p, fkda_plan_desc* desc) {
  desc->gate_mode = p.gate_mode;
  desc->beta_mode = p.beta_mode;
  desc->lower_bound = p.gate_mode == FKDA_GATE_BOUNDED ? p.lower_bound : fkda_plan_desc FKDA_PLAN_DESC_INIT.lower_bound;
}

}  // namespace fkda_ref
