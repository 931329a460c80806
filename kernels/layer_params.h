/* SPDX-License-Identifier: MIT */
/* Parameters of fkda_fwd's layer step kernels around the recurrence
 * (flashkda.h, "The layer step"; kernels/layer_step.cuh). Plain C like
 * prefill_params.h, which holds FkdaLayerStep: the decode kernel and the
 * prefill's preparation kernel carry it in their own parameters. */
#ifndef FLASHKDA_KERNELS_LAYER_PARAMS_H
#define FLASHKDA_KERNELS_LAYER_PARAMS_H

#include <stdint.h>

#include "prefill_params.h"

/* fkda_fwd's convolution and gate kernels. `call` holds the raw q, k, v
 * (the projections), out, the offsets and sizes; the convolved v goes to
 * staged_v, packed bf16 [B * T, H, K] (the preparation kernel convolves q
 * and k itself). */
typedef struct FkdaLayerParams {
  FkdaRecurrenceCall call;
  FkdaLayerStep layer;
  void* staged_v;
  float* conv_table; /* written by fkda_layer_pack_conv_weights (FKDA_CONV_TABLE_*) */
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
 * FKDA_CONV_CHANNELS_PER_THREAD channels of v of FKDA_CONV_TILE_TOKENS
 * tokens; the output gate: blocks of FKDA_GATE_WARPS warps, each
 * FKDA_GATE_ROWS_PER_WARP (token, head) rows. */
#define FKDA_CONV_TILE_TOKENS 64
#define FKDA_CONV_THREADS 128
#define FKDA_CONV_CHANNELS_PER_THREAD 4
#define FKDA_CONV_CHANNELS_PER_BLOCK (FKDA_CONV_THREADS * FKDA_CONV_CHANNELS_PER_THREAD)
/* The table of q's and k's conv weights (projection 0 and 1) that
 * fkda_layer_pack_conv_weights writes, a thread per (channel, projection),
 * before the preparation kernels read it: every thread of those would
 * otherwise load, convert and address 20 weights and biases of any dtype
 * and stride. With C = H * K channels, f32 throughout: the weights of
 * channel c by distance (b: the input b tokens back; 0 for b >= W) at
 * floats 4 (proj C + c) + b, and its bias (0 without) at
 * FKDA_CONV_TABLE_BIAS(C) + proj C + c. */
#define FKDA_CONV_TABLE_PROJECTIONS 2
#define FKDA_CONV_TABLE_FLOATS_PER_CHANNEL (FKDA_CONV_TABLE_PROJECTIONS * (FKDA_CONV_MAX_WIDTH + 1))
#define FKDA_CONV_TABLE_BIAS(channels) (FKDA_CONV_TABLE_PROJECTIONS * FKDA_CONV_MAX_WIDTH * (channels))
#define FKDA_GATE_WARPS 4
#define FKDA_GATE_ROWS_PER_WARP 8
#define FKDA_GATE_ROWS_PER_BLOCK (FKDA_GATE_WARPS * FKDA_GATE_ROWS_PER_WARP)

#endif /* FLASHKDA_KERNELS_LAYER_PARAMS_H */
