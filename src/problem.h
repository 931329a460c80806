// The validated description of one forward call, as the backends see it.
// validate.cpp builds it from fkda_fwd_args; backends trust it completely.
#pragma once

#include <cstdint>

namespace fkda {

// An activation tensor [B, T, H, D] (or [B, T, H] for beta): strides in
// elements for the batch, token and head axes; the D axis is contiguous.
struct ActView {
  const void* data = nullptr;
  int64_t stride_b = 0;
  int64_t stride_t = 0;
  int64_t stride_h = 0;
};

struct FwdProblem {
  int64_t batch = 0;      // B
  int64_t seq_len = 0;    // T (tokens per batch row; the packed total with cu_seqlens)
  int64_t num_seqs = 0;   // N: B, or cu_seqlens length - 1
  int32_t num_heads = 0;  // H
  int32_t head_dim_k = 128;
  int32_t head_dim_v = 128;

  ActView q, k, v, g, beta;  // bf16
  ActView out;               // bf16, written (data is writable)
  const float* A_log = nullptr;    // [H]
  const float* dt_bias = nullptr;  // [H, K]

  // Optional states, contiguous, dtype bf16 or f32 (fkda_dtype values).
  const void* initial_state = nullptr;
  void* final_state = nullptr;
  int32_t state_dtype = 0;
  int32_t state_layout = 0;  // fkda_state_layout

  // Optional [N + 1] offsets; dtype FKDA_DTYPE_I32 or I64 (0 when absent).
  // On the CPU backend their contents are validated; on the GPU they are not read by the host.
  const void* cu_seqlens = nullptr;
  int32_t cu_seqlens_dtype = 0;
  int64_t cu_seqlens_stride = 1;

  float scale = 0.f;
  float lower_bound = -5.f;
};

// Start and end token of sequence n along the row's token axis, for the
// batched case (row n, [0, T)) or the varlen case (cu_seqlens, batch row 0).
// Backends that read cu_seqlens on the host use this; it clamps to [0, T].
struct SeqRange {
  int64_t batch_row;
  int64_t begin;
  int64_t end;
};

}  // namespace fkda
