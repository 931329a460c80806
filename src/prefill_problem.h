/* SPDX-License-Identifier: MIT */
// The validated description of one forward call, as the backends see it.
// validate_fwd.cpp builds it from fkda_fwd_args; backends trust it completely.
#pragma once

#include <cstdint>

#include "flashkda.h"
#include "tuning.h"

namespace fkda {

// An activation tensor [B, T, H, D] (or [B, T, H] for beta): strides in
// elements for the batch, token and head axes; the D axis is contiguous.
struct ActView {
  const void* data = nullptr;
  int64_t stride_b = 0;
  int64_t stride_t = 0;
  int64_t stride_h = 0;
};

// Optional per-sequence integers on the host or the device: [rows] or
// [rows, cols], dtype FKDA_DTYPE_I32, I64 or BOOL (0 when absent). Element
// (r, c) sits at r * stride_row + c * stride_col elements.
struct IndexView {
  const void* data = nullptr;
  int32_t dtype = 0;
  int64_t rows = 0;
  int64_t cols = 1;
  int64_t stride_row = 0;
  int64_t stride_col = 0;

  bool present() const { return data != nullptr; }
  // Element (row, col) of a host-readable view, widened to i64.
  int64_t at(int64_t row, int64_t col = 0) const {
    const int64_t offset = row * stride_row + col * stride_col;
    if (dtype == FKDA_DTYPE_I64) return static_cast<const int64_t*>(data)[offset];
    if (dtype == FKDA_DTYPE_I32) return static_cast<const int32_t*>(data)[offset];
    return static_cast<const uint8_t*>(data)[offset] != 0 ? 1 : 0;
  }
};

// States addressed by slot: [slots, H, V, K] (or KV) in the plan's state
// dtype; the slot stride (elements) is free, the rest contiguous.
struct PoolView {
  void* data = nullptr;
  int64_t slots = 0;
  int64_t slot_stride = 0;
};

// Optional [N + 1] sequence offsets, dtype FKDA_DTYPE_I32 or I64 (0 when
// absent). The CPU backend may read them (validated); the GPU backend never
// reads them on the host.
struct SeqOffsets {
  const void* data = nullptr;
  int32_t dtype = 0;
  int64_t stride = 1;

  bool present() const { return data != nullptr; }
  // Offset i of a host-readable view (CPU plans). The kernels read device-side
  // offsets with their own reader (kernels/device_common.cuh).
  int64_t at(int64_t i) const {
    if (dtype == FKDA_DTYPE_I32) return static_cast<const int32_t*>(data)[i * stride];
    return static_cast<const int64_t*>(data)[i * stride];
  }
};

// Tokens [begin, end) of sequence n, in batch row `row`.
struct TokenRange {
  int64_t row, begin, end;
  int64_t length() const { return end - begin; }
};

// Where sequence n lies: batch row n without cu_seqlens, else its offsets
// (host-readable), clamped into [0, seq_len] so that even unchecked offsets
// stay inside the tensors.
inline TokenRange sequence_tokens(const SeqOffsets& cu_seqlens, int64_t seq_len, int64_t n) {
  if (!cu_seqlens.present()) return {n, 0, seq_len};
  auto clamp = [](int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); };
  const int64_t begin = clamp(cu_seqlens.at(n), 0, seq_len);
  return {0, begin, clamp(cu_seqlens.at(n + 1), begin, seq_len)};
}

// Whether a slot index means "no sequence here" under the plan's rule.
inline bool is_null_slot(int64_t index, int32_t null_slot_rule) {
  return null_slot_rule == FKDA_NULL_SLOT_NONPOSITIVE ? index <= 0 : index < 0;
}

// How the decay and the step size are formed from g, A_log, dt_bias and
// beta: the plan's fkda_gate_mode and fkda_beta_mode, and the dtypes the
// call passed g and beta in. A_log and dt_bias may be NULL where the mode
// allows it (exp(A_log) = 1, dt_bias = 0).
struct GateForm {
  int32_t gate_mode = FKDA_GATE_BOUNDED;
  int32_t beta_mode = FKDA_BETA_LOGITS;
  bool g_is_f32 = false;  // else bf16; f32 with LOG_DECAY only
  bool beta_is_f32 = false;
};

// One projection's convolution (flashkda.h, "The layer step"): weight
// [H*K, W] and optional bias [H*K] in weight_dtype; state [rows, H*K, Wc]
// in state_dtype, absent (NULL) when the call passed no conv states. Strides
// in elements.
struct ConvView {
  const void* weight = nullptr;
  int64_t weight_stride_c = 0, weight_stride_w = 0;
  const void* bias = nullptr;  // optional
  int64_t bias_stride = 0;
  void* state = nullptr;  // optional, read and written in place
  int64_t state_stride_row = 0, state_stride_c = 0, state_stride_w = 0;
};

// The layer step around the recurrence, as validated. conv_width 0: no
// convolution; out_gate.data NULL: no output gate.
struct LayerStep {
  int32_t conv_width = 0;        // W, 2..4
  int32_t conv_state_width = 0;  // Wc, W - 1 or W (0 without states)
  int32_t conv_dtype = 0;        // of weights and biases: bf16 or f32
  int32_t conv_state_dtype = 0;  // bf16 or f32
  ConvView conv[3];              // q, k, v
  ActView out_gate;              // bf16 [B, T, H, V]
  const void* norm_weight = nullptr;  // [V]
  int32_t norm_weight_dtype = 0;      // bf16 or f32
  int64_t norm_weight_stride = 0;
  float norm_eps = 1e-5f;

  bool has_conv() const { return conv_width > 0; }
  bool has_conv_state() const { return conv[0].state != nullptr; }
  bool has_out_gate() const { return out_gate.data != nullptr; }
};

// What every call that runs the recurrence over a batch of activations
// shares (fkda_fwd, fkda_decode, fkda_transitions): the sizes, the
// activations and gate parameters, the state's form, the sequence offsets
// and the plan's scalars at the call's start. Each problem below is one of
// these plus its own fields; a call without q or out (fkda_transitions)
// leaves them empty.
struct RecurrenceCall {
  int64_t batch = 0;      // B
  int64_t seq_len = 0;    // T (tokens per batch row; the packed total with cu_seqlens)
  int64_t num_seqs = 0;   // N: B, or cu_seqlens length - 1
  int32_t num_heads = 0;  // H
  int32_t head_dim_k = 128;
  int32_t head_dim_v = 128;

  ActView q, k, v, g, beta;  // bf16 (g, beta: or f32, see gate)
  ActView out;               // bf16, written (data is writable)
  const float* A_log = nullptr;    // [H], optional (GateForm)
  const float* dt_bias = nullptr;  // [H, K], optional
  GateForm gate;

  int32_t state_dtype = 0;     // fkda_dtype of the states the call reads and writes
  int32_t state_layout = 0;    // fkda_state_layout
  int32_t null_slot_rule = 0;  // fkda_null_slot_rule of pool indices

  SeqOffsets cu_seqlens;  // absent: sequence n is batch row n

  float scale = 0.f;
  float lower_bound = -5.f;   // BOUNDED only
  bool debug_checks = false;  // GPU: check device-side indices on the host first

  LayerStep layer;  // fkda_fwd and fkda_decode; empty for fkda_transitions
};

struct PrefillProblem : RecurrenceCall {
  // Optional states, contiguous, in state_dtype.
  const void* initial_state = nullptr;
  void* final_state = nullptr;

  // States in a pool instead of initial_state / final_state: sequence n
  // reads and writes pool slot state_indices[n] (null: padding, see
  // null_slot_rule). Both absent unless the call passed them.
  PoolView pool;
  IndexView state_indices;      // [N]
  IndexView has_initial_state;  // [N]: 0 starts from zeros (with either state form)

  // Checkpoints: the state after checkpoint_offsets[n][c] tokens of sequence
  // n (multiples of 16, ascending, negative = none), written either to
  // checkpoints (+ n * checkpoint_stride_n + c * checkpoint_stride_c
  // elements, [H, V, K] contiguous, dtype checkpoint_dtype) or to pool slot
  // checkpoint_slots[n][c].
  IndexView checkpoint_offsets;  // [N, C]
  void* checkpoints = nullptr;
  int32_t checkpoint_dtype = 0;
  int64_t checkpoint_stride_n = 0;
  int64_t checkpoint_stride_c = 0;
  IndexView checkpoint_slots;  // [N, C]

  Tuning tuning;  // the plan's, read at its creation
  // Plans with layer_step: the front of the workspace holds the convolved
  // projections the plan's backend stages, the last conv_staged_projections
  // of q, k, v (layer_step.h); the backend's part follows it.
  int32_t conv_staged_projections = 0;
  size_t conv_staging_bytes = 0;
  bool conv_weight_table = false;  // the staging area ends with the GPU's weight table
};

}  // namespace fkda
