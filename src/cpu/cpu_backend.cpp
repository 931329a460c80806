// SPDX-License-Identifier: MIT
// The CPU backend follows docs/NUMERICS.md step by step; each step of the
// contract is a function below, marked with its step number. It exists so
// that every machine can run the library, and so that the GPU kernels have a
// partner that rounds at the same points and can be compared with it tightly.

#include "cpu/cpu_backend.h"
#include "cpu/cpu_chunks.h"
#include "cpu/cpu_layer_step.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "checked_arith.h"
#include "cpu/cpu_rounding.h"
#include "flashkda.h"
#include "layer_step.h"
#include "prefill_params.h"

namespace fkda::cpu {
namespace {

constexpr int kChunk = FKDA_CHUNK;
constexpr float kLog2e = FKDA_LOG2E;
constexpr float kLn2 = 0.693147182f;  // ln 2 rounded to f32 (0x3F317218)
// The any-decay products pair the tokens of blocks of 2, 4, 8 and 16.
constexpr int kLevels = 4;
static_assert(kChunk == 1 << kLevels, "a chunk is one block of the last level");

// One (sequence, head) pair: the unit of work, since the recurrence is a
// sequential chain over the chunks of one sequence and one head.
struct HeadTask {
  int64_t seq;
  int32_t head;
  int64_t batch_row;
  int64_t begin;  // tokens [begin, end) of batch_row
  int64_t end;
};

}  // namespace

// Everything one worker needs: the state of the (sequence, head) pair it is
// on and the operands of the current chunk. It lives in the caller's
// workspace (one region per worker), so a call allocates nothing large and
// nothing inside a worker can throw.
struct ChunkScratch {
  int K = 0, V = 0;
  int len = 0;  // tokens of this chunk (the last chunk of a sequence may be partial)

  // The chunk's inputs widened to f32, [kChunk][K] or [kChunk][V]; rows >= len are zero.
  float *q, *k, *g, *v;
  float beta[kChunk] = {};

  // Step 1 and 2.
  float* gate_cumsum;  // c, [kChunk][K]
  float* decay;        // 2^c_last, [K]
  float rq[kChunk] = {}, rk[kChunk] = {}, b[kChunk] = {};

  // Step 3 of the bounded gate: bf16 operands of the 16x16 products, [kChunk][K].
  float *kd_bf16, *ki_bf16, *qd_bf16;
  // The any-decay gates' operands of the same products, [kChunk][K], in the
  // same memory (a chunk takes one path or the other): each token's decay
  // 2^a2, and one level's key and query factors P_l and Qn_l at a time.
  float *token_decay, *level_keys, *level_queries;
  // Step 3: f16 operands of the recurrence. Kd and Qd are stored K-major,
  // [K][kChunk], so that the products with the state run along the 16 tokens.
  float *kd_f16_kmajor, *qd_f16_kmajor;
  float* kr_f16;  // [kChunk][K]

  // Steps 4 and 5.
  float L[kChunk][kChunk] = {};
  float Mqk[kChunk][kChunk] = {};
  float W[kChunk][kChunk] = {};

  // Step 6.
  float* state;                // S, [V][K], f32 for the whole sequence
  float* state_f16;            // Sh, [V][K]
  float *X_vmajor, *Oi_vmajor;  // [V][kChunk]
  float *Y, *Uh;                // [kChunk][V]
  float* out_f32;              // one output row, [V]

  // Floats of workspace one worker carves its arrays from.
  static size_t floats_needed(int head_dim_k, int head_dim_v) {
    const size_t rows_k = size_t(kChunk) * head_dim_k, rows_v = size_t(kChunk) * head_dim_v;
    return 9 * rows_k + 6 * rows_v + head_dim_k + 2 * size_t(head_dim_v) * head_dim_k + head_dim_v;
  }

  ChunkScratch(int head_dim_k, int head_dim_v, float* memory) : K(head_dim_k), V(head_dim_v) {
    const size_t rows_k = size_t(kChunk) * K, rows_v = size_t(kChunk) * V;
    auto take = [&memory](size_t count) {
      float* region = memory;
      memory += count;
      return region;
    };
    q = take(rows_k);
    k = take(rows_k);
    g = take(rows_k);
    v = take(rows_v);
    gate_cumsum = take(rows_k);
    decay = take(size_t(K));
    kd_bf16 = token_decay = take(rows_k);
    ki_bf16 = level_keys = take(rows_k);
    qd_bf16 = level_queries = take(rows_k);
    kd_f16_kmajor = take(rows_k);
    qd_f16_kmajor = take(rows_k);
    kr_f16 = take(rows_k);
    state = take(size_t(V) * K);
    state_f16 = take(size_t(V) * K);
    X_vmajor = take(rows_v);
    Oi_vmajor = take(rows_v);
    Y = take(rows_v);
    Uh = take(rows_v);
    out_f32 = take(size_t(V));
  }
};

namespace {

// ----------------------------------------------------------- addressing ---

// Element offset of the row of `view` at the task's batch row and head and `token`.
int64_t row_offset(const ActView& view, const HeadTask& task, int64_t token) {
  return task.batch_row * view.stride_b + token * view.stride_t + int64_t(task.head) * view.stride_h;
}

const uint16_t* token_row(const ActView& view, const HeadTask& task, int64_t token) {
  return static_cast<const uint16_t*>(view.data) + row_offset(view, task, token);
}

// The first n elements of a row of g or beta, bf16 or f32, widened to f32.
void read_row(const ActView& view, bool is_f32, const HeadTask& task, int64_t token, int n, float* values) {
  if (is_f32) {
    const float* row = static_cast<const float*>(view.data) + row_offset(view, task, token);
    std::copy(row, row + n, values);
    return;
  }
  const uint16_t* row = token_row(view, task, token);
  for (int c = 0; c < n; ++c) values[c] = float_of_bf16(row[c]);
}

uint16_t* out_row(const ActView& out, const HeadTask& task, int64_t token) {
  // The out view's data is writable; ActView only carries it as const.
  return const_cast<uint16_t*>(token_row(out, task, token));
}

std::vector<HeadTask> head_tasks(const PrefillProblem& p) {
  std::vector<HeadTask> tasks;
  tasks.reserve(size_t(p.num_seqs) * p.num_heads);
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const TokenRange range = sequence_tokens(p.cu_seqlens, p.seq_len, n);
    for (int32_t h = 0; h < p.num_heads; ++h) tasks.push_back({n, h, range.row, range.begin, range.end});
  }
  // Longest first, so that the last task a worker picks up is a short one.
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const HeadTask& a, const HeadTask& b) { return a.end - a.begin > b.end - b.begin; });
  return tasks;
}

// ------------------------------------------------------- state (step 7) ---

// Index of S[e, k] within one head's state in the caller's layout.
size_t state_index(int32_t layout, int V, int K, int e, int k) {
  return layout == FKDA_STATE_LAYOUT_KV ? size_t(k) * V + e : size_t(e) * K + k;
}

// A head's [V, K] state somewhere in caller memory: a row of initial_state or
// final_state, a pool slot or a checkpoint. `elements` counts from `base`.
struct StateRef {
  void* base = nullptr;  // nullptr: no state (zeros when read, nothing written)
  int32_t dtype = FKDA_DTYPE_F32;

  void* at(int64_t elements) const {
    return static_cast<char*>(base) + elements * (dtype == FKDA_DTYPE_BF16 ? 2 : 4);
  }
};

StateRef pool_slot(const PoolView& pool, int32_t dtype, int64_t slot, int64_t head_offset) {
  return {StateRef{pool.data, dtype}.at(slot * pool.slot_stride + head_offset), dtype};
}

// Widens a stored state into the f32 `state` ([V][K]); zeros when absent.
void read_state(const StateRef& from, int32_t layout, int V, int K, float* state) {
  if (from.base == nullptr) {
    std::fill(state, state + size_t(V) * K, 0.f);
    return;
  }
  for (int e = 0; e < V; ++e)
    for (int k = 0; k < K; ++k) {
      const size_t index = state_index(layout, V, K, e, k);
      state[size_t(e) * K + k] = from.dtype == FKDA_DTYPE_BF16 ? float_of_bf16(static_cast<const uint16_t*>(from.base)[index])
                                                               : static_cast<const float*>(from.base)[index];
    }
}

// Rounds the f32 `state` to the destination's dtype (round to nearest even).
void write_state(const StateRef& to, int32_t layout, int V, int K, const float* state) {
  if (to.base == nullptr) return;
  for (int e = 0; e < V; ++e)
    for (int k = 0; k < K; ++k) {
      const size_t index = state_index(layout, V, K, e, k);
      const float value = state[size_t(e) * K + k];
      if (to.dtype == FKDA_DTYPE_BF16)
        static_cast<uint16_t*>(to.base)[index] = bf16_bits_of(value);
      else
        static_cast<float*>(to.base)[index] = value;
    }
}

size_t head_state_elems(const PrefillProblem& p) { return size_t(p.head_dim_v) * p.head_dim_k; }

// Where a (sequence, head) pair starts from and ends in. A null slot makes
// the sequence padding.
struct StatePlaces {
  bool padding = false;
  StateRef initial, final;
};

StatePlaces state_places(const PrefillProblem& p, const HeadTask& task) {
  StatePlaces places;
  const int64_t head_offset = int64_t(task.head) * int64_t(head_state_elems(p));
  const bool starts_from_zeros = p.has_initial_state.present() && p.has_initial_state.at(task.seq) == 0;
  if (p.state_indices.present()) {
    const int64_t slot = p.state_indices.at(task.seq);
    if (is_null_slot(slot, p.null_slot_rule)) {
      places.padding = true;
      return places;
    }
    places.final = pool_slot(p.pool, p.state_dtype, slot, head_offset);
    if (!starts_from_zeros) places.initial = places.final;
    return places;
  }
  const int64_t row_offset = task.seq * p.num_heads * int64_t(head_state_elems(p)) + head_offset;
  if (p.initial_state != nullptr && !starts_from_zeros) {
    places.initial = StateRef{const_cast<void*>(p.initial_state), p.state_dtype};
    places.initial.base = places.initial.at(row_offset);
  }
  if (p.final_state != nullptr) {
    places.final = StateRef{p.final_state, p.state_dtype};
    places.final.base = places.final.at(row_offset);
  }
  return places;
}

// Checkpoint c of the pair's sequence: an element of `checkpoints` or a pool
// slot (none for a null slot).
StateRef checkpoint_place(const PrefillProblem& p, const HeadTask& task, int64_t c) {
  const int64_t head_offset = int64_t(task.head) * int64_t(head_state_elems(p));
  if (p.checkpoint_slots.present()) {
    const int64_t slot = p.checkpoint_slots.at(task.seq, c);
    if (is_null_slot(slot, p.null_slot_rule)) return {};
    return pool_slot(p.pool, p.state_dtype, slot, head_offset);
  }
  const StateRef all{p.checkpoints, p.checkpoint_dtype};
  return {all.at(task.seq * p.checkpoint_stride_n + c * p.checkpoint_stride_c + head_offset), p.checkpoint_dtype};
}

// Writes the checkpoints due after `tokens_done` tokens of the sequence.
void store_checkpoints(const PrefillProblem& p, const HeadTask& task, int64_t tokens_done, const ChunkScratch& s) {
  if (!p.checkpoint_offsets.present()) return;
  for (int64_t c = 0; c < p.checkpoint_offsets.cols; ++c) {
    if (p.checkpoint_offsets.at(task.seq, c) != tokens_done) continue;
    write_state(checkpoint_place(p, task, c), p.state_layout, s.V, s.K, s.state);
  }
}

// ------------------------------------------------------- gate and beta ---

float sigmoid(float x) { return 1.f / (1.f + std::exp2(-x * kLog2e)); }

// One head's gate parameters; absent A_log and dt_bias take their neutral
// values (exp(A_log) = 1, dt_bias = 0).
struct HeadGate {
  int32_t mode = FKDA_GATE_BOUNDED;
  float a_scale = 1.f;              // exp(A_log[h])
  const float* dt_bias = nullptr;   // the head's [K] row
  float gate_scale = 0.f;           // BOUNDED: lower_bound · log2 e
};

template <typename Problem>
HeadGate head_gate(const Problem& p, int32_t head) {
  HeadGate gate;
  gate.mode = p.gate.gate_mode;
  if (p.A_log != nullptr) gate.a_scale = std::exp(p.A_log[head]);
  if (p.dt_bias != nullptr) gate.dt_bias = p.dt_bias + size_t(head) * size_t(p.head_dim_k);
  gate.gate_scale = p.lower_bound * kLog2e;
  return gate;
}

// Which softplus the gate uses: the prefill's base-2 form (what the
// kernels compute with exp2 and log2), or decode's accurate one.
enum class Softplus { kBase2, kAccurate };

float softplus(float x, Softplus form) {
  if (x > 20.f) return x;
  if (form == Softplus::kAccurate) return std::log1p(std::exp(x));
  return std::fmax(x, 0.f) + kLn2 * std::log2(1.f + std::exp2(-std::fabs(x) * kLog2e));
}

// The base-2 log-decay of channel c of one token with gate input g (step 1;
// decode step 2). The bounded gate stays within [lower_bound · log2 e, 0];
// the others are floored at FKDA_LOG2_DECAY_FLOOR, where 2^a2 is already 0
// in f32, so that -inf and total forgetting make no NaN in a running sum.
float log2_decay(const HeadGate& gate, float g, int c, Softplus form) {
  const float bias = gate.dt_bias != nullptr ? gate.dt_bias[c] : 0.f;
  if (gate.mode == FKDA_GATE_BOUNDED) return gate.gate_scale * sigmoid(gate.a_scale * (g + bias));
  const float a = gate.mode == FKDA_GATE_SOFTPLUS ? -gate.a_scale * softplus(g + bias, form) : std::fmin(g, 0.f);
  return std::fmax(a * kLog2e, FKDA_LOG2_DECAY_FLOOR);
}

// The delta rule's step size from beta: sigmoid of a logit, or a
// probability clamped into [0, 1].
float step_size(int32_t beta_mode, float beta) {
  if (beta_mode == FKDA_BETA_PROBABILITIES) return std::fmin(std::fmax(beta, 0.f), 1.f);
  return sigmoid(beta);
}

// ------------------------------------------------------- chunk steps 1-5 ---

void load_chunk(const PrefillProblem& p, const HeadTask& task, int64_t first_token, ChunkMode mode,
                ChunkScratch& s) {
  const int K = s.K, V = s.V;
  // Transitions have no q; their Qd and Mqk are formed from zeros and unused.
  const bool with_queries = mode == ChunkMode::kOutput;
  const bool with_values = mode != ChunkMode::kIdentity;
  for (int i = 0; i < kChunk; ++i) {
    float* q = &s.q[size_t(i) * K];
    float* k = &s.k[size_t(i) * K];
    float* g = &s.g[size_t(i) * K];
    float* v = &s.v[size_t(i) * V];
    if (i >= s.len) {
      // Rows past the end of a partial chunk are zero in every operand.
      std::fill(q, q + K, 0.f);
      std::fill(k, k + K, 0.f);
      std::fill(g, g + K, 0.f);
      std::fill(v, v + V, 0.f);
      s.beta[i] = 0.f;
      continue;
    }
    const int64_t token = first_token + i;
    const uint16_t* k_in = token_row(p.k, task, token);
    for (int c = 0; c < K; ++c) k[c] = float_of_bf16(k_in[c]);
    if (with_queries) {
      const uint16_t* q_in = token_row(p.q, task, token);
      for (int c = 0; c < K; ++c) q[c] = float_of_bf16(q_in[c]);
    } else {
      std::fill(q, q + K, 0.f);
    }
    read_row(p.g, p.gate.g_is_f32, task, token, K, g);
    if (with_values) {
      const uint16_t* v_in = token_row(p.v, task, token);
      for (int e = 0; e < V; ++e) v[e] = float_of_bf16(v_in[e]);
    } else {
      std::fill(v, v + V, 0.f);
    }
    read_row(p.beta, p.gate.beta_is_f32, task, token, 1, &s.beta[i]);
  }
}

// Step 1: the gate in base 2 and its running sum over the chunk's tokens;
// the any-decay gates keep each token's decay 2^a2 as well.
void gate_cumsum(const PrefillProblem& p, const HeadTask& task, ChunkScratch& s) {
  const int K = s.K;
  const HeadGate gate = head_gate(p, task.head);
  const bool any_decay = gate.mode != FKDA_GATE_BOUNDED;
  for (int c = 0; c < K; ++c) {
    float running = 0.f;
    for (int i = 0; i < s.len; ++i) {
      const size_t at = size_t(i) * K + c;
      const float a2 = log2_decay(gate, s.g[at], c, Softplus::kBase2);
      if (any_decay) s.token_decay[at] = std::exp2(a2);
      running += a2;
      s.gate_cumsum[at] = running;
    }
    for (int i = s.len; i < kChunk; ++i) {
      s.gate_cumsum[size_t(i) * K + c] = 0.f;
      if (any_decay) s.token_decay[size_t(i) * K + c] = 1.f;
    }
    s.decay[c] = std::exp2(running);
  }
}

// Step 2: inverse L2 norms of q and k, and b from beta.
void norms_and_beta(int32_t beta_mode, ChunkScratch& s) {
  const int K = s.K;
  for (int i = 0; i < kChunk; ++i) {
    if (i >= s.len) {
      s.rq[i] = s.rk[i] = s.b[i] = 0.f;
      continue;
    }
    float sum_q = 0.f, sum_k = 0.f;
    for (int c = 0; c < K; ++c) {
      sum_q += s.q[size_t(i) * K + c] * s.q[size_t(i) * K + c];
      sum_k += s.k[size_t(i) * K + c] * s.k[size_t(i) * K + c];
    }
    s.rq[i] = 1.f / std::sqrt(sum_q + 1e-6f);
    s.rk[i] = 1.f / std::sqrt(sum_k + 1e-6f);
    s.b[i] = step_size(beta_mode, s.beta[i]);
  }
}

// Step 3, the recurrence's operands: all at most 1 (or |scale|) in magnitude,
// in f16 for its finer mantissa. 2^c only shrinks, whatever the gate. The
// bounded gate takes 2^c and 2^(c_last - c) as exp2 of the sums; the
// unbounded ones as the GPU forms them, exp2 at one token of each half of
// the chunk and running products of the token decays from there (rows past
// the chunk's end continue the sum with a2 = 0, d = 1).
void recurrence_operands(float scale, bool running_products, ChunkScratch& s) {
  const int K = s.K;
  constexpr int kHalf = kChunk / 2;
  for (int c = 0; c < K; ++c) {
    const float cumsum_last = s.gate_cumsum[size_t(s.len - 1) * K + c];
    auto cumsum = [&](int i) { return i < s.len ? s.gate_cumsum[size_t(i) * K + c] : cumsum_last; };
    auto token_decay = [&](int i) { return s.token_decay[size_t(i) * K + c]; };
    float up[kChunk], after[kChunk];
    for (int i = 0; i < kChunk; ++i) {
      up[i] = running_products && i % kHalf != 0 ? up[i - 1] * token_decay(i) : std::exp2(cumsum(i));
    }
    for (int i = kChunk - 1; i >= 0; --i) {
      after[i] = running_products && i % kHalf != kHalf - 1 ? after[i + 1] * token_decay(i + 1)
                                                            : std::exp2(cumsum_last - cumsum(i));
    }
    for (int i = 0; i < kChunk; ++i) {
      const size_t at = size_t(i) * K + c;
      const size_t at_kmajor = size_t(c) * kChunk + i;
      if (i >= s.len) {
        s.kr_f16[at] = 0.f;
        s.kd_f16_kmajor[at_kmajor] = s.qd_f16_kmajor[at_kmajor] = 0.f;
        continue;
      }
      const float k_unit = s.k[at] * s.rk[i];
      const float q_scaled = s.q[at] * s.rq[i] * scale;
      s.kd_f16_kmajor[at_kmajor] = round_to_f16_satfinite(k_unit * up[i]);
      s.qd_f16_kmajor[at_kmajor] = round_to_f16_satfinite(q_scaled * up[i]);
      s.kr_f16[at] = round_to_f16_satfinite(k_unit * after[i]);
    }
  }
}

// Step 3, the bounded gate's operands of the 16x16 products: Ki spans up to
// 2^115, so they use bf16 (f32's exponent range).
void bounded_product_operands(float scale, ChunkScratch& s) {
  const int K = s.K;
  for (int i = 0; i < kChunk; ++i) {
    for (int c = 0; c < K; ++c) {
      const size_t at = size_t(i) * K + c;
      if (i >= s.len) {
        s.kd_bf16[at] = s.ki_bf16[at] = s.qd_bf16[at] = 0.f;
        continue;
      }
      const float cumsum = s.gate_cumsum[at];
      const float k_unit = s.k[at] * s.rk[i];
      const float q_scaled = s.q[at] * s.rq[i] * scale;
      s.kd_bf16[at] = round_to_bf16(k_unit * std::exp2(cumsum));
      s.ki_bf16[at] = round_to_bf16(k_unit * std::exp2(-cumsum));
      s.qd_bf16[at] = round_to_bf16(q_scaled * std::exp2(cumsum));
    }
  }
}

float dot(const float* a, const float* b, int n) {
  float sum = 0.f;
  for (int c = 0; c < n; ++c) sum += a[c] * b[c];
  return sum;
}

// Step 4 of the bounded gate: L = strict_lower(Kd Kiᵀ) with row i scaled by
// b_i, and Mqk = lower_incl_diag(Qd Kiᵀ) rounded to f16.
void intra_chunk_products(ChunkScratch& s) {
  const int K = s.K;
  for (int i = 0; i < kChunk; ++i) {
    for (int j = 0; j < kChunk; ++j) {
      s.L[i][j] = 0.f;
      s.Mqk[i][j] = 0.f;
      if (i >= s.len || j > i) continue;
      const float* ki = &s.ki_bf16[size_t(j) * K];
      if (j < i) s.L[i][j] = s.b[i] * dot(&s.kd_bf16[size_t(i) * K], ki, K);
      s.Mqk[i][j] = round_to_f16_satfinite(dot(&s.qd_bf16[size_t(i) * K], ki, K));
    }
  }
}

// The any-decay factors of one level (docs/NUMERICS.md, "Any decay"): in
// each block of 2^(level+1) tokens, with m the last token of its left half,
// a right token i gets ρ = d[m+1]·…·d[i] and a left one λ = d[i+1]·…·d[m].
// P = f16(kn·factor) for every token, Qn = f16(qn·ρ) for the right ones.
void level_factors(int level, ChunkScratch& s) {
  const int K = s.K, half = 1 << level;
  for (int block = 0; block < kChunk; block += 2 * half) {
    const int m = block + half - 1;
    for (int c = 0; c < K; ++c) {
      float rho = 1.f;
      for (int i = m + 1; i < block + 2 * half; ++i) {
        const size_t at = size_t(i) * K + c;
        rho *= s.token_decay[at];
        s.level_keys[at] = round_to_f16_satfinite(s.k[at] * s.rk[i] * rho);
        s.level_queries[at] = round_to_f16_satfinite(s.q[at] * s.rq[i] * rho);
      }
      float lambda = 1.f;
      for (int i = m; i >= block; --i) {
        const size_t at = size_t(i) * K + c;
        s.level_keys[at] = round_to_f16_satfinite(s.k[at] * s.rk[i] * lambda);
        s.level_queries[at] = 0.f;
        lambda *= s.token_decay[at];
      }
    }
  }
}

// Steps 3 and 4 of the any-decay gates: A and B pair tokens j < i at the
// level where they split (bit `level` of i set, of j clear, in one block),
// from factors that are products of decays <= 1, so that no operand exceeds
// 1 however strong the decay; the diagonal of B needs no decay at all.
// Then L and Mqk as in the bounded gate's step 4.
void any_decay_products(float scale, ChunkScratch& s) {
  const int K = s.K;
  for (int i = 0; i < kChunk; ++i)
    for (int j = 0; j < kChunk; ++j) s.L[i][j] = s.Mqk[i][j] = 0.f;
  for (int i = 0; i < s.len; ++i) {
    const float* q = &s.q[size_t(i) * K];
    const float* k = &s.k[size_t(i) * K];
    s.Mqk[i][i] = round_to_f16_satfinite(scale * s.rq[i] * s.rk[i] * dot(q, k, K));
  }
  for (int level = 0; level < kLevels; ++level) {
    level_factors(level, s);
    const int half = 1 << level;
    for (int i = 0; i < s.len; ++i) {
      if ((i & half) == 0) continue;  // a left token of this level
      const float* key_i = &s.level_keys[size_t(i) * K];
      const float* query_i = &s.level_queries[size_t(i) * K];
      const int block = i & ~(2 * half - 1);
      for (int j = block; j < block + half; ++j) {
        const float* key_j = &s.level_keys[size_t(j) * K];
        s.L[i][j] = s.b[i] * dot(key_i, key_j, K);
        s.Mqk[i][j] = round_to_f16_satfinite(scale * dot(query_i, key_j, K));
      }
    }
  }
}

using Tile = float[kChunk][kChunk];

void multiply(const Tile& a, const Tile& b, Tile& product) {
  for (int i = 0; i < kChunk; ++i) {
    for (int j = 0; j < kChunk; ++j) product[i][j] = 0.f;
    for (int m = 0; m < kChunk; ++m)
      for (int j = 0; j < kChunk; ++j) product[i][j] += a[i][m] * b[m][j];
  }
}

void identity_plus(const Tile& a, float sign, Tile& result) {
  for (int i = 0; i < kChunk; ++i)
    for (int j = 0; j < kChunk; ++j) result[i][j] = (i == j ? 1.f : 0.f) + sign * a[i][j];
}

// Step 5: L is strictly lower triangular, so L^16 = 0 and
// (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8) exactly; then W = f16(INV diag(b)).
void invert_unit_lower(ChunkScratch& s) {
  Tile power, next_power, factor, inverse, partial;
  identity_plus(s.L, -1.f, inverse);
  multiply(s.L, s.L, power);  // L^2
  for (int step = 0; step < 3; ++step) {
    identity_plus(power, 1.f, factor);
    multiply(inverse, factor, partial);
    std::copy(&partial[0][0], &partial[0][0] + kChunk * kChunk, &inverse[0][0]);
    if (step < 2) {
      multiply(power, power, next_power);  // L^4, then L^8
      std::copy(&next_power[0][0], &next_power[0][0] + kChunk * kChunk, &power[0][0]);
    }
  }
  for (int i = 0; i < kChunk; ++i)
    for (int j = 0; j < kChunk; ++j) s.W[i][j] = round_to_f16_satfinite(inverse[i][j] * s.b[j]);
}

// ---------------------------------------------------- recurrence (step 6) ---

// Step 6: X = Kd Shᵀ and Oi = Qd Shᵀ, both kept V-major so the inner loop runs along
// the 16 tokens and every state element is read once.
void project_state(ChunkScratch& s) {
  const int K = s.K, V = s.V;
  for (size_t at = 0; at < size_t(s.V) * s.K; ++at) s.state_f16[at] = round_to_f16_satfinite(s.state[at]);
  for (int e = 0; e < V; ++e) {
    float* x = &s.X_vmajor[size_t(e) * kChunk];
    float* o = &s.Oi_vmajor[size_t(e) * kChunk];
    std::fill(x, x + kChunk, 0.f);
    std::fill(o, o + kChunk, 0.f);
    const float* sh = &s.state_f16[size_t(e) * K];
    for (int c = 0; c < K; ++c) {
      const float* kd = &s.kd_f16_kmajor[size_t(c) * kChunk];
      const float* qd = &s.qd_f16_kmajor[size_t(c) * kChunk];
      const float state_value = sh[c];
      for (int i = 0; i < kChunk; ++i) {
        x[i] += kd[i] * state_value;
        o[i] += qd[i] * state_value;
      }
    }
  }
}

// Step 6: Y = f16(v - X), then Uh = f16(W Y): the chunk's corrections to the state.
void delta_updates(ChunkScratch& s) {
  const int V = s.V;
  for (int i = 0; i < kChunk; ++i) {
    float* y = &s.Y[size_t(i) * V];
    for (int e = 0; e < V; ++e)
      y[e] = i < s.len ? round_to_f16_satfinite(s.v[size_t(i) * V + e] - s.X_vmajor[size_t(e) * kChunk + i])
                       : 0.f;
  }
  for (int i = 0; i < kChunk; ++i) {
    float* u = &s.Uh[size_t(i) * V];
    std::fill(u, u + V, 0.f);
    // W is lower triangular and zero past len.
    for (int j = 0; j <= i && j < s.len; ++j) {
      const float w = s.W[i][j];
      const float* y = &s.Y[size_t(j) * V];
      for (int e = 0; e < V; ++e) u[e] += w * y[e];
    }
    for (int e = 0; e < V; ++e) u[e] = round_to_f16_satfinite(u[e]);
  }
}

// Step 6: O = Oi + Mqk Uh, written as bf16 for the chunk's real tokens.
void write_output(const PrefillProblem& p, const HeadTask& task, int64_t first_token, ChunkScratch& s) {
  const int V = s.V;
  float* o = s.out_f32;
  for (int i = 0; i < s.len; ++i) {
    for (int e = 0; e < V; ++e) o[e] = s.Oi_vmajor[size_t(e) * kChunk + i];
    for (int j = 0; j <= i; ++j) {
      const float m = s.Mqk[i][j];
      const float* u = &s.Uh[size_t(j) * V];
      for (int e = 0; e < V; ++e) o[e] += m * u[e];
    }
    uint16_t* out = out_row(p.out, task, first_token + i);
    for (int e = 0; e < V; ++e) out[e] = bf16_bits_of(o[e]);
  }
}

// Step 6: S <- S diag(decay) + Uhᵀ Kr.
void advance_state(ChunkScratch& s) {
  const int K = s.K, V = s.V;
  for (int e = 0; e < V; ++e) {
    float* state_row = &s.state[size_t(e) * K];
    for (int c = 0; c < K; ++c) state_row[c] *= s.decay[c];
    for (int i = 0; i < s.len; ++i) {
      const float u = s.Uh[size_t(i) * V + e];
      const float* kr = &s.kr_f16[size_t(i) * K];
      for (int c = 0; c < K; ++c) state_row[c] += u * kr[c];
    }
  }
}

// ------------------------------------------------------------- drivers ---

// Advances s.state over tokens [begin, end) of the task's sequence, chunk by
// chunk on the sequence's grid of 16 (begin - task.begin is a multiple of
// 16). kOutput also writes out and the checkpoints due in the range.
void advance_chunks(const PrefillProblem& p, const HeadTask& task, int64_t begin, int64_t end, ChunkMode mode,
                    ChunkScratch& s) {
  for (int64_t first = begin; first < end; first += kChunk) {
    s.len = static_cast<int>(std::min<int64_t>(kChunk, end - first));
    load_chunk(p, task, first, mode, s);
    gate_cumsum(p, task, s);
    norms_and_beta(p.gate.beta_mode, s);
    recurrence_operands(p.scale, p.gate.gate_mode != FKDA_GATE_BOUNDED, s);
    if (p.gate.gate_mode == FKDA_GATE_BOUNDED) {
      bounded_product_operands(p.scale, s);
      intra_chunk_products(s);
    } else {
      any_decay_products(p.scale, s);
    }
    invert_unit_lower(s);
    project_state(s);
    delta_updates(s);
    if (mode == ChunkMode::kOutput) write_output(p, task, first, s);
    advance_state(s);
    if (mode == ChunkMode::kOutput) store_checkpoints(p, task, first + s.len - task.begin, s);
  }
}

void zero_output_rows(const PrefillProblem& p, const HeadTask& task, int V) {
  for (int64_t token = task.begin; token < task.end; ++token) {
    uint16_t* out = out_row(p.out, task, token);
    std::fill(out, out + V, uint16_t(0));
  }
}

void run_head(const PrefillProblem& p, const HeadTask& task, ChunkScratch& s) {
  const StatePlaces places = state_places(p, task);
  if (places.padding) {
    zero_output_rows(p, task, s.V);
    return;
  }
  read_state(places.initial, p.state_layout, s.V, s.K, s.state);
  advance_chunks(p, task, task.begin, task.end, ChunkMode::kOutput, s);
  write_state(places.final, p.state_layout, s.V, s.K, s.state);
}

// Below about this many chunks in all, starting a thread costs more than it saves.
constexpr int64_t kChunksPerExtraThread = 8;

// Workers for a call of at most this many chunks over this many (sequence,
// head) pairs: one per core, no more than there are pairs or chunks to share.
int64_t workers_for(int64_t pairs, int64_t chunks) {
  const int64_t hardware = std::max<int64_t>(1, std::thread::hardware_concurrency());
  return std::clamp<int64_t>(std::min<int64_t>(pairs, chunks / kChunksPerExtraThread), 1, hardware);
}

// Runs tasks 0 .. count-1 on `workers` threads (the caller's included), each
// task on one worker: run(worker, task). Nothing in `run` may throw.
template <typename Run>
void run_on_workers(size_t count, int64_t workers, const Run& run) {
  std::atomic<size_t> next_task{0};
  auto work = [&](int64_t worker) {
    for (size_t t = next_task++; t < count; t = next_task++) run(worker, t);
  };
  std::vector<std::thread> threads;
  threads.reserve(size_t(workers - 1));
  for (int64_t w = 1; w < workers; ++w) {
    try {
      threads.emplace_back(work, w);
    } catch (...) {
      break;  // no thread to spare: the calling thread does the remaining work
    }
  }
  work(0);
  for (std::thread& thread : threads) thread.join();
}

// ---------------------------------------------------------------- decode ---

// One (sequence, head) pair of a decode call; tokens [begin, end) of `row`.
// The token-by-token recurrence in f32 (docs/NUMERICS.md, "Decode").
struct DecodeScratch {
  std::vector<float> state, q, k, v, decay, out;
  DecodeConvScratch conv;  // the layer step's convolution
  DecodeScratch(int K, int V)
      : state(size_t(V) * K), q(size_t(K)), k(size_t(K)), v(size_t(V)), decay(size_t(K)), out(size_t(V)), conv(K) {}
};

// Slot of column `column` of sequence n's indices ([N] views have one column).
int64_t decode_slot(const DecodeProblem& p, int64_t n, int64_t column) {
  return p.state_indices.at(n, p.indices_are_table ? column : 0);
}

// A row of f32 values made a unit vector, times `factor`, in place:
// x · factor / sqrt(Σx² + 1e-6), f32 (step 1's norm).
void normalize(float* x, int n, float factor) {
  float sum = 0.f;
  for (int c = 0; c < n; ++c) sum += x[c] * x[c];
  const float inverse_norm = 1.f / std::sqrt(sum + 1e-6f) * factor;
  for (int c = 0; c < n; ++c) x[c] *= inverse_norm;
}

void widen_row(const uint16_t* bits, int n, float* values) {
  for (int c = 0; c < n; ++c) values[c] = float_of_bf16(bits[c]);
}

void decode_head(const DecodeProblem& p, const HeadTask& task, DecodeScratch& s) {
  const int K = p.head_dim_k, V = p.head_dim_v;
  const int64_t n = task.seq, length = task.end - task.begin;
  const int64_t start_column = p.num_accepted_tokens.present() ? p.num_accepted_tokens.at(n) - 1 : 0;
  const int64_t start = decode_slot(p, n, start_column);
  const int64_t head_offset = int64_t(task.head) * V * K;
  if (is_null_slot(start, p.null_slot_rule)) {
    for (int64_t token = task.begin; token < task.end; ++token) {
      uint16_t* out = out_row(p.out, task, token);
      std::fill(out, out + V, uint16_t(0));
    }
    return;
  }
  read_state(pool_slot(p.pool, p.state_dtype, start, head_offset), p.state_layout, V, K, s.state.data());
  const bool convolution = p.layer.has_conv();
  if (convolution) convolve_decode_head(p, task.head, task.batch_row, task.begin, length, start, s.conv);

  const HeadGate gate = head_gate(p, task.head);
  for (int64_t t = 0; t < length; ++t) {
    const int64_t token = task.begin + t;
    // The token's q, k and v: the bf16 inputs, or their convolution kept in f32.
    if (convolution) {
      std::copy(s.conv.row(0, t, K), s.conv.row(0, t, K) + K, s.q.begin());
      std::copy(s.conv.row(1, t, K), s.conv.row(1, t, K) + K, s.k.begin());
      std::copy(s.conv.row(2, t, K), s.conv.row(2, t, K) + V, s.v.begin());
    } else {
      widen_row(token_row(p.q, task, token), K, s.q.data());
      widen_row(token_row(p.k, task, token), K, s.k.data());
      widen_row(token_row(p.v, task, token), V, s.v.data());
    }
    normalize(s.q.data(), K, p.scale);
    normalize(s.k.data(), K, 1.f);
    // The token's g, widened in place of the decays it becomes.
    read_row(p.g, p.gate.g_is_f32, task, token, K, s.decay.data());
    for (int c = 0; c < K; ++c) {
      s.decay[size_t(c)] = std::exp2(log2_decay(gate, s.decay[size_t(c)], c, Softplus::kAccurate));
    }
    float beta = 0.f;
    read_row(p.beta, p.gate.beta_is_f32, task, token, 1, &beta);
    const float b = step_size(p.gate.beta_mode, beta);
    for (int e = 0; e < V; ++e) {
      float* row = &s.state[size_t(e) * K];
      float predicted = 0.f;
      for (int c = 0; c < K; ++c) {
        row[c] *= s.decay[size_t(c)];
        predicted += row[c] * s.k[size_t(c)];
      }
      const float correction = b * (s.v[size_t(e)] - predicted);
      float output = 0.f;
      for (int c = 0; c < K; ++c) {
        row[c] += correction * s.k[size_t(c)];
        output += row[c] * s.q[size_t(c)];
      }
      s.out[size_t(e)] = output;
    }
    // The output gate takes the f32 outputs; they are rounded once.
    if (p.layer.has_out_gate()) {
      gate_output_row(p.layer, out_gate_row(p.layer, task.batch_row, token, task.head), V, s.out.data());
    }
    uint16_t* out = out_row(p.out, task, token);
    for (int e = 0; e < V; ++e) out[e] = bf16_bits_of(s.out[size_t(e)]);
    // A slot table keeps the state after every token (null columns excepted).
    if (p.indices_are_table) {
      const int64_t slot = decode_slot(p, n, t);
      if (!is_null_slot(slot, p.null_slot_rule))
        write_state(pool_slot(p.pool, p.state_dtype, slot, head_offset), p.state_layout, V, K, s.state.data());
    }
  }
  if (!p.indices_are_table)
    write_state(pool_slot(p.pool, p.state_dtype, start, head_offset), p.state_layout, V, K, s.state.data());
}

}  // namespace

// ------------------------------------------------- pieces of sequences ---

size_t ChunkRunner::floats_needed(int head_dim_k, int head_dim_v) {
  return ChunkScratch::floats_needed(head_dim_k, head_dim_v);
}

ChunkRunner::ChunkRunner(int head_dim_k, int head_dim_v, float* memory)
    : scratch_(new ChunkScratch(head_dim_k, head_dim_v, memory)) {}
ChunkRunner::ChunkRunner(ChunkRunner&&) noexcept = default;
ChunkRunner::~ChunkRunner() = default;

float* ChunkRunner::state() { return scratch_->state; }

void ChunkRunner::advance(const PrefillProblem& p, const Pair& pair, int64_t begin, int64_t end, ChunkMode mode) {
  advance_chunks(p, HeadTask{pair.seq, pair.head, pair.row, pair.begin, pair.end}, begin, end, mode, *scratch_);
}

bool read_initial_state(const PrefillProblem& p, const Pair& pair, float* state) {
  const HeadTask task{pair.seq, pair.head, pair.row, pair.begin, pair.end};
  const StatePlaces places = state_places(p, task);
  if (places.padding) {
    zero_output_rows(p, task, p.head_dim_v);
    return false;
  }
  read_state(places.initial, p.state_layout, p.head_dim_v, p.head_dim_k, state);
  return true;
}

void write_final_state(const PrefillProblem& p, const Pair& pair, const float* state) {
  const StatePlaces places = state_places(p, HeadTask{pair.seq, pair.head, pair.row, pair.begin, pair.end});
  if (!places.padding) write_state(places.final, p.state_layout, p.head_dim_v, p.head_dim_k, state);
}

int64_t worker_count(int64_t tasks, int64_t chunks) { return workers_for(tasks, chunks); }

void run_parallel(size_t count, int64_t workers, const std::function<void(int64_t, size_t)>& run) {
  run_on_workers(count, workers, run);
}

int64_t prefill_workers(int64_t total_tokens, int64_t num_seqs, int32_t num_heads) {
  // Each sequence adds at most one partial chunk to total_tokens / 16 full
  // ones, and each head runs every chunk. Any size is answered: past int64
  // the bounds only need to be large.
  const int64_t chunk_bound = saturating_mul(saturating_add(total_tokens / kChunk, num_seqs), num_heads);
  return workers_for(saturating_mul(num_seqs, num_heads), chunk_bound);
}

size_t workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int32_t head_dim_k,
                      int32_t head_dim_v, const Tuning& tuning) {
  if (use_chunk_parallel(tuning)) {
    return chunk_parallel_workspace_size(total_tokens, num_seqs, num_heads, head_dim_k, head_dim_v, tuning);
  }
  return size_t(prefill_workers(total_tokens, num_seqs, num_heads)) *
         ChunkScratch::floats_needed(head_dim_k, head_dim_v) * sizeof(float);
}

int64_t fwd_workers(const PrefillProblem& problem, size_t workspace_bytes) {
  const size_t per_worker = ChunkScratch::floats_needed(problem.head_dim_k, problem.head_dim_v);
  const int64_t affordable = int64_t(workspace_bytes / (per_worker * sizeof(float)));
  const int64_t wanted = prefill_workers(problem.batch * problem.seq_len, problem.num_seqs, problem.num_heads);
  return std::max<int64_t>(1, std::min(wanted, affordable));
}

namespace {

// The recurrence of fkda_fwd on q, k and v as the problem holds them.
void fwd_recurrence(const PrefillProblem& problem, const Tuning& tuning, void* workspace, size_t workspace_bytes) {
  if (use_chunk_parallel(tuning)) {
    fwd_chunk_parallel(problem, tuning, workspace, workspace_bytes);
    return;
  }
  const std::vector<HeadTask> tasks = head_tasks(problem);
  if (tasks.empty()) return;

  const size_t per_worker = ChunkScratch::floats_needed(problem.head_dim_k, problem.head_dim_v);
  const int64_t workers = fwd_workers(problem, workspace_bytes);

  std::vector<ChunkScratch> scratch;
  scratch.reserve(size_t(workers));
  for (int64_t w = 0; w < workers; ++w) {
    scratch.emplace_back(problem.head_dim_k, problem.head_dim_v, static_cast<float*>(workspace) + size_t(w) * per_worker);
  }
  run_on_workers(tasks.size(), workers,
                 [&](int64_t worker, size_t t) { run_head(problem, tasks[t], scratch[size_t(worker)]); });
}

}  // namespace

// Plans with layer_step keep the staging area at the front of the
// workspace whether or not the call convolves; the recurrence's scratch
// follows it. With the convolution the recurrence reads the staged, bf16
// q, k and v; the output gate then rewrites the bf16 output rows.
void fwd(const PrefillProblem& problem, const Tuning& tuning, void* workspace, size_t workspace_bytes) {
  // Without tokens a call only carries states over; with no state to write
  // it has no effect at all, however many sequences q's empty batch claims.
  if (problem.batch * problem.seq_len == 0 && problem.final_state == nullptr && problem.pool.data == nullptr) {
    return;
  }
  if (problem.conv_staging_bytes == 0) {
    fwd_recurrence(problem, tuning, workspace, workspace_bytes);
  } else {
    const ConvStaging staging = conv_staging(problem, workspace, workspace_bytes);
    PrefillProblem staged = problem;
    if (problem.layer.has_conv()) {
      convolve_prefill(problem, staging);
      staged.q = staging.view_of(staging.q);
      staged.k = staging.view_of(staging.k);
      staged.v = staging.view_of(staging.v);
    }
    fwd_recurrence(staged, tuning, staging.rest, staging.rest_bytes);
  }
  if (problem.layer.has_out_gate()) gate_prefill_output(problem);
}

void decode(const DecodeProblem& problem) {
  std::vector<HeadTask> tasks;
  int64_t pair_tokens = 0;
  for (int64_t n = 0; n < problem.num_seqs; ++n) {
    const TokenRange range = sequence_tokens(problem.cu_seqlens, problem.seq_len, n);
    if (range.length() == 0) continue;  // touches nothing, not even its indices
    for (int32_t h = 0; h < problem.num_heads; ++h) tasks.push_back({n, h, range.row, range.begin, range.end});
    pair_tokens += range.length() * problem.num_heads;
  }
  // A token of one pair costs about what a chunk of the forward pass does.
  const int64_t workers = workers_for(int64_t(tasks.size()), pair_tokens);
  // Allocated here, before any worker starts, so that no worker can throw.
  std::vector<DecodeScratch> scratch(size_t(workers), DecodeScratch(problem.head_dim_k, problem.head_dim_v));
  run_on_workers(tasks.size(), workers,
                 [&](int64_t worker, size_t t) { decode_head(problem, tasks[t], scratch[size_t(worker)]); });
}

}  // namespace fkda::cpu
