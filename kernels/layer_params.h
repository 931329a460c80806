/* SPDX-License-Identifier: MIT */
/* Parameters of the layer step around the recurrence (flashkda.h, "The
 * layer step"): the convolution of q, k and v and the output gate. Plain C
 * like prefill_params.h. The decode kernel carries FkdaLayerStep in its own
 * parameters; fkda_fwd runs three kernels of its own (kernels/layer_step.cuh)
 * around the recurrence, with FkdaLayerParams. */
#ifndef FLASHKDA_KERNELS_LAYER_PARAMS_H
#define FLASHKDA_KERNELS_LAYER_PARAMS_H

#include <stdint.h>

#include "prefill_params.h"

/* The widest convolution. */
#define FKDA_CONV_MAX_WIDTH 4

/* One projection's convolution: weight [H*K, W] and bias [H*K] (NULL: none)
 * in one dtype; state [rows, H*K, Wc] (NULL: none). Strides in elements. */
typedef struct FkdaConv {
  const void* weight;
  int64_t weight_stride_c;
  int64_t weight_stride_w;
  const void* bias;
  int64_t bias_stride;
  void* state;
  int64_t state_stride_row;
  int64_t state_stride_c;
  int64_t state_stride_w;
} FkdaConv;

typedef struct FkdaLayerStep {
  FkdaConv conv[3];         /* q, k, v */
  int32_t conv_width;       /* W, 2..4; 0: no convolution */
  int32_t conv_state_width; /* Wc, W - 1 or W; 0: no states */
  int32_t conv_is_f32;      /* weights and biases; else bf16 */
  int32_t conv_state_is_f32;
  FkdaActivation out_gate;  /* bf16 [B, T, H, V]; data NULL: no output gate */
  const void* norm_weight;  /* [V] */
  int64_t norm_weight_stride;
  int32_t norm_weight_is_f32;
  float norm_eps;
} FkdaLayerStep;

/* fkda_fwd's convolution and gate kernels. `call` holds the raw q, k, v
 * (the projections), out, the offsets and sizes; the convolved q, k, v go to
 * staged[0..2], packed bf16 [B * T, H, K]. */
typedef struct FkdaLayerParams {
  FkdaRecurrenceCall call;
  FkdaLayerStep layer;
  void* staged[3];
  int64_t batch; /* B: N without cu_seqlens, 1 with */
  /* Which conv state row a sequence reads and writes: pool slot
   * state_indices[n] (null or outside the pool: padding, nothing touched)
   * when state_indices.data is non-NULL, else row n. It reads it when
   * reads_state (an initial state or a pool) and has_initial_state[n] is
   * not 0 (absent: read). */
  FkdaIndexTable state_indices;
  int64_t pool_slots;
  FkdaIndexTable has_initial_state;
  int32_t reads_state;
  int32_t reserved; /* zero */
  /* Checkpoints to pool slots: the conv state at each checkpoint too. */
  FkdaIndexTable checkpoint_offsets; /* [N, C]; data NULL: none */
  FkdaIndexTable checkpoint_slots;   /* [N, C] */
} FkdaLayerParams;

/* The convolution kernel: blocks of FKDA_CONV_THREADS threads, each thread
 * eight channels of FKDA_CONV_TILE_TOKENS tokens; the output gate: blocks of
 * FKDA_GATE_WARPS warps, each FKDA_GATE_ROWS_PER_WARP (token, head) rows. */
#define FKDA_CONV_TILE_TOKENS 64
#define FKDA_CONV_THREADS 128
#define FKDA_CONV_CHANNELS_PER_BLOCK (FKDA_CONV_THREADS * 8)
#define FKDA_GATE_WARPS 4
#define FKDA_GATE_ROWS_PER_WARP 4
#define FKDA_GATE_ROWS_PER_BLOCK (FKDA_GATE_WARPS * FKDA_GATE_ROWS_PER_WARP)

#endif /* FLASHKDA_KERNELS_LAYER_PARAMS_H */
