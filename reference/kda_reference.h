/* SPDX-License-Identifier: MIT */
// Host-side support shared by the tests, fkda-demo and fkda-bench: random
// KDA problems, bf16 conversions, the fp64 token-by-token recurrence (the
// accuracy reference, docs/ARCHITECTURE.md section 1), and fkda_tensor builders.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "flashkda.h"

namespace fkda_ref {

uint16_t to_bf16(float x);    // round to nearest even; NaN stays NaN
float from_bf16(uint16_t bits);
uint16_t to_f16(float x);     // round to nearest even, saturating to ±65504
float from_f16(uint16_t bits);

// The layer step around the recurrence (flashkda.h, "The layer step around
// the recurrence"), every part optional: a convolution when conv_width > 0,
// an output gate when out_gate is non-empty.
struct LayerStep {
  int64_t conv_width = 0;        // W, 2..4
  int64_t conv_state_width = 0;  // Wc, W - 1 or W
  // q, k and v's weights [H*K, W] and biases [H*K] (empty: none), as the
  // library reads them (bf16 ones as their f32 values), and each sequence's
  // conv state before the call, [N, H*K, Wc] (empty: zeros).
  std::vector<float> conv_weight[3], conv_bias[3], conv_state[3];
  std::vector<uint16_t> out_gate;      // bf16 [B, T, H, V]
  std::vector<float> out_norm_weight;  // [V]
  float out_norm_eps = 1e-5f;

  bool has_conv() const { return conv_width > 0; }
  bool has_out_gate() const { return !out_gate.empty(); }
};

// One problem on the host. Activations are bf16 bit patterns, contiguous
// [B, T, H, D]; with cu_seqlens, B == 1 and T is the packed total. With a
// convolution in `layer`, q, k and v are the raw projections.
struct Problem {
  int64_t B = 1, T = 0, H = 1;
  int64_t K = 128, V = 128;
  std::vector<int64_t> cu_seqlens;  // empty: one sequence per batch row
  std::vector<uint16_t> q, k, v, g, beta;
  std::vector<float> A_log, dt_bias;  // empty: absent (where gate_mode allows it)
  std::vector<float> initial_state;  // empty: absent (zeros); else [N, H, V, K] in f32
  float scale = 0.08838834764831845f;
  float lower_bound = -5.f;  // BOUNDED only
  int32_t gate_mode = FKDA_GATE_BOUNDED;  // fkda_gate_mode
  int32_t beta_mode = FKDA_BETA_LOGITS;   // fkda_beta_mode
  // Non-empty: g (LOG_DECAY only) or beta passed as f32 [B, T, H, K] /
  // [B, T, H] instead of their bf16 bits, which are then unused
  // (as_log_decay and as_probabilities leave them empty).
  std::vector<float> g_f32, beta_f32;
  LayerStep layer;

  int64_t num_seqs() const { return cu_seqlens.empty() ? B : int64_t(cu_seqlens.size()) - 1; }
  int64_t state_elems() const { return num_seqs() * H * V * K; }
};

// The shape of a random problem. lengths non-empty means varlen (B = 1).
struct ProblemShape {
  int64_t B = 1, T = 0, H = 1;
  std::vector<int64_t> lengths;
  bool with_initial_state = true;
  float lower_bound = -5.f;
  // g ~ N(gate_mean, gate_std^2); initial state ~ initial_state_std N(0, 1).
  float gate_mean = 0.f;
  float gate_std = 1.f;
  float initial_state_std = 0.1f;
  int32_t gate_mode = FKDA_GATE_BOUNDED;
  // SOFTPLUS: A_log = log U(1, 16) and dt_bias the inverse softplus of a
  // log-uniform value in [0.001, 0.1] instead of U(0, 1) (Kimi-Linear's
  // initialisation); with g ~ N(0, 1) the log-decays reach about -27.
  bool model_gate_parameters = false;
};

// The softplus-gate distributions of docs/BENCHMARKS.md: realistic (model
// gate parameters, g ~ N(0, 1)) and extreme (g ~ N(0, 4): log-decays down
// to about -230).
ProblemShape realistic_softplus(ProblemShape shape);
ProblemShape extreme_softplus(ProblemShape shape);

// The natural-log decay (<= 0) of every [B, T, H, K] element of p under its
// gate mode, in fp64 from the inputs as passed (bf16 g, f32 A_log, dt_bias).
std::vector<double> log_decays(const Problem& p);

// p with its gate replaced by the LOG_DECAY form carrying the same
// log-decays (log_decays(p)), rounded to f32 g when `f32`, else to bf16.
Problem as_log_decay(const Problem& p, bool f32);

// p with beta replaced by sigmoid(beta) (PROBABILITIES), rounded to f32 when
// `f32`, else to bf16.
Problem as_probabilities(const Problem& p, bool f32);

// A problem of every gate and beta mode a plan takes on `shape` (whose own
// gate fields are ignored): the bounded gate without A_log and without
// dt_bias (slow decays), the softplus gate on realistic and extreme
// distributions and without dt_bias, their log-decays as bf16 and f32 g, and
// beta as bf16 and f32 probabilities. Named for messages; deterministic in seed.
struct GateVariant {
  std::string name;
  Problem p;
};
std::vector<GateVariant> gate_variants(const ProblemShape& shape, uint64_t seed);

// A LOG_DECAY problem's log-decays pushed to the edges, in g_f32 or g,
// whichever p uses: channel c of every token at -1e4, exactly 0, -inf or as
// it was (c % 4 = 0, 1, 2, 3), and sequences `all_minus_inf` and
// `all_minus_300` (varlen) forgetting everything at every token.
Problem with_edge_log_decays(Problem p, int64_t all_minus_inf, int64_t all_minus_300);

// q, k, v, beta ~ N(0, 1); A_log, dt_bias ~ U(0, 1) (or as
// model_gate_parameters says; none with the LOG_DECAY gate, whose g is then
// the log-decay itself); g and the initial state as the shape says (by
// default the fast-decay accuracy case of docs/BENCHMARKS.md). The gate mode
// is the shape's, beta holds logits. Deterministic in seed.
Problem random_problem(const ProblemShape& shape, uint64_t seed);

// The same shape with slow decays (the long-memory case LM1): g ~ N(-6, 1)
// at lower_bound -5 makes 99% of the channels decay slower than e^-0.01 per
// token, and the initial state ~ N(0, 1). With the default fast decays a
// lost initial state or chunk hand-off changes the final state by less than
// 1e-10, so every test of state handling also runs on these inputs.
ProblemShape slow_decay(ProblemShape shape);

// Tokens [begin, end) of batch row `row` (of the packed row with
// cu_seqlens) as a problem of its own: B = 1, no cu_seqlens, and no initial
// state nor conv state, which the caller sets for the sequence it cut from.
// g_f32, beta_f32 and the layer's out_gate are cut like g and beta.
Problem token_range(const Problem& p, int64_t row, int64_t begin, int64_t end);

// docs/BENCHMARKS.md's accuracy targets: the relative L2 error against the
// fp64 recurrence a backend must stay within, on the default (fast-decay)
// inputs or on slow_decay() ones, where the state carries most of the output.
struct AccuracyTargets {
  double out;
  double state;
};
AccuracyTargets accuracy_targets(fkda_dtype state_dtype, bool slow_decay);

// The fp64 token-by-token recurrence on the inputs as passed (bf16, or
// g_f32 and beta_f32 where present) under p's gate and beta modes. A decay
// of exp(-inf) is 0: total forgetting never makes a NaN.
// out: [B, T, H, V]; final_state: [N, H, V, K] (V-first). states_after[c]
// ([N, H, V, K]) is the state of every sequence after its first
// state_tokens[c] tokens (zeros for a sequence shorter than that): what
// checkpoints and speculative slot tables keep.
// With p.layer, the whole layer step in fp64: q, k and v convolved with the
// SiLU from the raw inputs and the conv states, none of it rounded, and the
// output gate on the fp64 output. conv_state[3] (q, k, v) is every
// sequence's conv state after the call, [N, H*K, Wc], and
// conv_states_after[c] after its first state_tokens[c] tokens.
struct Reference {
  std::vector<double> out;
  std::vector<double> final_state;
  std::vector<std::vector<double>> states_after;
  std::vector<double> conv_state[3];
  std::vector<std::array<std::vector<double>, 3>> conv_states_after;
};
Reference reference_recurrence(const Problem& p, const std::vector<int64_t>& state_tokens = {});

// The fp64 segment transitions of every (sequence, head) of p
// (flashkda.h, "Segment transitions"), V-first whatever a plan's layout:
// m [N, H, K, K] with S_out = S_in M + E, e [N, H, V, K]. E is the
// token-by-token recurrence from a zero state, M the same recurrence from
// the identity (K rows) with v = 0. p's initial state is ignored.
struct ReferenceTransitions {
  std::vector<double> m;
  std::vector<double> e;
};
ReferenceTransitions reference_transitions(const Problem& p);

// ‖a − b‖ / ‖b‖; infinity when a holds a NaN or infinity.
double rel_l2(const std::vector<float>& a, const std::vector<double>& b);

std::vector<float> bf16_to_float(const std::vector<uint16_t>& bits);

// Contiguous fkda_tensor over `data` with this dtype and shape.
fkda_tensor tensor(void* data, fkda_dtype dtype, std::vector<int64_t> shape);

// fkda_fwd_args over the given buffers (host or device pointers alike):
// q, k, v, g, beta, out are [B, T, H, D]; states [N, H, V, K] in state_dtype;
// cu_seqlens i64 when non-null. Null optional pointers leave that tensor
// absent, and so do p's empty A_log and dt_bias. g is f32 where p.g_f32 is
// non-empty, beta where p.beta_f32 is.
struct Buffers {
  void *q, *k, *v, *g, *beta, *A_log, *dt_bias, *out;
  void* initial_state = nullptr;
  void* final_state = nullptr;
  void* cu_seqlens = nullptr;
};
fkda_fwd_args make_args(const Problem& p, const Buffers& buffers, fkda_dtype state_dtype);

// fkda_decode_args over the same buffers (states ignored): the caller adds
// state_pool, state_indices and num_accepted_tokens.
fkda_decode_args make_decode_args(const Problem& p, const Buffers& buffers);

// fkda_transition_args over the same buffers (q, out and states unused):
// transition_m f32 [N, H, K, K] at m, transition_e f32 [N, H, V, K] at e
// (KV layouts [N, H, K, V]; with K == V the extents are the same).
fkda_transition_args make_transition_args(const Problem& p, const Buffers& buffers, void* m, void* e);

// Buffers over p's own host vectors (g_f32 and beta_f32 where p has them,
// cu_seqlens where p is varlen) and `out`; states are left to the caller.
Buffers host_buffers(Problem& p, void* out);

// Sets desc's gate_mode, beta_mode and lower_bound to p's (lower_bound at
// its FKDA_PLAN_DESC_INIT value, -5, for gates without a floor).
void apply_gate(const Problem& p, fkda_plan_desc* desc);

}  // namespace fkda_ref
