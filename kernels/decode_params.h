/* SPDX-License-Identifier: MIT */
/* Parameters of the decode kernel (kernels/decode_recurrence.cuh), shared
 * with its launch code in src/gpu/gpu_decode.cpp. Plain C like
 * prefill_params.h, whose shared fields (FkdaRecurrenceCall) and head size
 * it reuses; passed by value as the kernel's single argument. */
#ifndef FLASHKDA_KERNELS_DECODE_PARAMS_H
#define FLASHKDA_KERNELS_DECODE_PARAMS_H

#include <stdint.h>

#include "layer_params.h"
#include "prefill_params.h"

/* The longest sequence a decode call serves (tokens). */
#define FKDA_DECODE_MAX_TOKENS 16

/* Each warp owns this many V rows of one (sequence, head) state, four per
 * group of 8 lanes; the 8 lanes of a group split the 128 K columns. A block
 * has 1, 2 or 4 warps, so 8, 4 or 2 blocks share a head's 128 rows. */
#define FKDA_DECODE_ROWS_PER_WARP 16
#define FKDA_DECODE_MAX_WARPS 4

/* Dynamic shared memory of a block, for sequences of at most max_tokens
 * tokens, in this order (byte offsets below):
 *   write_slots  int64 [FKDA_DECODE_MAX_TOKENS]  pool slot of each token's state (table), -1: none
 *   key          f32 [max_tokens][128]          k / |k|
 *   query        f32 [max_tokens][128]          scale q / |q|
 *   decay        f32 [max_tokens][128]          exp(a_t)
 *   value        f32 [max_tokens][rows]         the block's V rows of v
 *   beta         f32 [max_tokens]               sigmoid(beta)
 * Every array starts on a 16-byte boundary. */
static inline FKDA_HOST_DEVICE int32_t fkda_decode_key_offset(void) { return FKDA_DECODE_MAX_TOKENS * 8; }
static inline FKDA_HOST_DEVICE int32_t fkda_decode_query_offset(int32_t max_tokens) {
  return fkda_decode_key_offset() + max_tokens * FKDA_HEAD_DIM * 4;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_decay_offset(int32_t max_tokens) {
  return fkda_decode_query_offset(max_tokens) + max_tokens * FKDA_HEAD_DIM * 4;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_value_offset(int32_t max_tokens) {
  return fkda_decode_decay_offset(max_tokens) + max_tokens * FKDA_HEAD_DIM * 4;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_beta_offset(int32_t max_tokens, int32_t warps) {
  return fkda_decode_value_offset(max_tokens) + max_tokens * warps * FKDA_DECODE_ROWS_PER_WARP * 4;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_smem_bytes(int32_t max_tokens, int32_t warps) {
  return fkda_decode_beta_offset(max_tokens, warps) + ((max_tokens * 4 + 15) / 16) * 16;
}

/* The layer step's decode: the head's blocks together read and write the
 * head's conv state channels and see every value the output's RMSNorm sums.
 * On sm_90 and later they are two of the plain kernel's blocks of
 * FKDA_DECODE_MAX_WARPS warps (src/gpu/gpu_decode.cpp), launched as one
 * cluster whose blocks push the convolved q and k of their channels and
 * their sums of squares into each other's shared memory; on sm_80 a single
 * block of FKDA_DECODE_LAYER_WARPS warps takes all 128 rows. After the
 * arrays above:
 *   gated         f32 [max_tokens][128]  outputs waiting for the gate (a block uses its rows' places)
 *   sums          f32 [FKDA_DECODE_MAX_TOKENS][FKDA_DECODE_LAYER_HEAD_BLOCKS]  per token, over each block's rows
 *   barriers      2 x 8 bytes  the mbarriers the pushes count down (decode_recurrence.cuh, HeadExchange)
 *   convolved_qk  f32 [max_tokens][2][128]  the convolved q and k of the head */
#define FKDA_DECODE_LAYER_WARPS 8
#define FKDA_DECODE_LAYER_HEAD_BLOCKS (FKDA_HEAD_DIM / (FKDA_DECODE_ROWS_PER_WARP * FKDA_DECODE_MAX_WARPS))
static inline FKDA_HOST_DEVICE int32_t fkda_decode_layer_barriers_offset(int32_t max_tokens, int32_t warps) {
  return fkda_decode_smem_bytes(max_tokens, warps) + max_tokens * FKDA_HEAD_DIM * 4 +
         FKDA_DECODE_MAX_TOKENS * FKDA_DECODE_LAYER_HEAD_BLOCKS * 4;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_layer_conv_offset(int32_t max_tokens, int32_t warps) {
  return fkda_decode_layer_barriers_offset(max_tokens, warps) + 16;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_layer_smem_bytes(int32_t max_tokens, int32_t warps) {
  return fkda_decode_layer_conv_offset(max_tokens, warps) + max_tokens * 2 * FKDA_HEAD_DIM * 4;
}

/* The layer kernels' state, staged where they run in clusters (code for
 * sm_90 and later; decode_recurrence.cuh): after every array above, each thread's
 * pieces of its four rows, where its asynchronous copies from the pool put
 * them: 256 bytes a thread for an f32 pool, 128 for a bf16 one
 * (decode_recurrence.cuh, "Staging"). */
static inline FKDA_HOST_DEVICE int32_t fkda_decode_staged_state_bytes(int32_t warps, int32_t state_is_bf16) {
  return warps * 32 * (state_is_bf16 ? 128 : 256);
}

/* The streamed decode (kernels/decode_streamed.cuh, sm_90 and later): a
 * persistent block of consumer warps and one producer warp takes items of
 * `rows` rows of one (sequence, head) state in turn, the producer's bulk
 * copies filling `stages` stages ahead of the consumers. The plain form:
 * items of FKDA_DECODE_STREAM_ROWS (64) rows, FKDA_DECODE_MAX_WARPS
 * consumer warps, two blocks a multiprocessor. The layer form (the layer
 * step): items of a whole head, FKDA_DECODE_STREAM_LAYER_WARPS consumer
 * warps, one block a multiprocessor, so that a block sees all 128 values
 * of a token's output for the output gate's RMSNorm. A stage holds:
 *   header    128 bytes        where the item's tokens and state are (StreamHeader)
 *   state     rows x 128       the item's rows as in the pool (f32 or bf16)
 *   dt_bias   f32 [128]        the head's row
 *   tokens    FKDA_DECODE_STREAM_TOKENS x {q bf16 [128], k bf16 [128], g [128] (f32 room), v bf16 [rows]}
 *   conv      the layer form's conv states, in their dtype: q, k, v [128][Wc]
 *             (none without conv states; the layer form copies them, so it
 *             serves conv states whose channels are contiguous, stride_c =
 *             Wc and stride_w = 1, with 16-byte aligned rows)
 * Every part, so every stage, starts on a 128-byte boundary. Tokens past
 * the first FKDA_DECODE_STREAM_TOKENS of a sequence are read from global
 * memory by the consumers. */
#define FKDA_DECODE_STREAM_ROWS (FKDA_DECODE_MAX_WARPS * FKDA_DECODE_ROWS_PER_WARP)
#define FKDA_DECODE_STREAM_LAYER_WARPS 8
#define FKDA_DECODE_STREAM_TOKENS 2
#define FKDA_DECODE_STREAM_MAX_STAGES 6
#define FKDA_DECODE_STREAM_HEADER_BYTES 128
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_state_bytes(int32_t rows, int32_t state_is_bf16) {
  return rows * FKDA_HEAD_DIM * (state_is_bf16 ? 2 : 4);
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_token_bytes(int32_t rows) {
  return 2 * FKDA_HEAD_DIM * 2 + FKDA_HEAD_DIM * 4 + rows * 2;
}
/* conv_state_width 0: no conv states (or the plain form). */
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_conv_bytes(int32_t conv_state_width,
                                                                     int32_t conv_state_is_f32) {
  return 3 * FKDA_HEAD_DIM * conv_state_width * (conv_state_is_f32 ? 4 : 2);
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_stage_bytes(int32_t rows, int32_t state_is_bf16,
                                                                      int32_t conv_bytes) {
  return FKDA_DECODE_STREAM_HEADER_BYTES + fkda_decode_stream_state_bytes(rows, state_is_bf16) + FKDA_HEAD_DIM * 4 +
         FKDA_DECODE_STREAM_TOKENS * fkda_decode_stream_token_bytes(rows) + conv_bytes;
}
/* A block's threads: `warps` consumer warps, the producer warp, and in the
 * layer form a gate warp, which applies the output gate to each token's
 * outputs while the consumers go on to the next token. A macro, so that the
 * kernels' launch bounds take it too. */
#define FKDA_DECODE_STREAM_THREADS(warps) (32 * ((warps) + 1 + ((warps) == FKDA_DECODE_STREAM_LAYER_WARPS ? 1 : 0)))
/* A block's shared memory, for `warps` consumer warps: the consumers
 * prepare one token at a time, into one of two places (the arrays of
 * fkda_decode_smem_bytes for 2 tokens); then come the layer form's own
 * arrays, the barriers (8 bytes each) and the stages. The layer form's
 * arrays: the outputs of two tokens waiting for the gate warp (f32 [2][128])
 * and where each goes (2 x 16 bytes: its row of `out` and of g_out), then
 * the channel histories (f32 [2][FKDA_CONV_MAX_WIDTH][threads], each
 * consumer thread's last inputs of its one or two channels). The barriers:
 * each stage's full and empty, then, for each of the two outputs' places,
 * ready (the consumers have written it) and gated (the gate warp is done
 * with it). */
#define FKDA_DECODE_STREAM_PREPARED_TOKENS 2
#define FKDA_DECODE_STREAM_GATE_PLACES 2
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_layer_offset(int32_t warps) {
  return (fkda_decode_smem_bytes(FKDA_DECODE_STREAM_PREPARED_TOKENS, warps) + 127) / 128 * 128;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_layer_bytes(int32_t warps) {
  return warps == FKDA_DECODE_STREAM_LAYER_WARPS
             ? FKDA_DECODE_STREAM_GATE_PLACES * (FKDA_HEAD_DIM * 4 + 16) + 2 * FKDA_CONV_MAX_WIDTH * 32 * warps * 4
             : 0;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_barriers_offset(int32_t warps) {
  return fkda_decode_stream_layer_offset(warps) + fkda_decode_stream_layer_bytes(warps);
}
#define FKDA_DECODE_STREAM_BARRIER_BYTES 128
#if 8 * (2 * FKDA_DECODE_STREAM_MAX_STAGES + 2 * FKDA_DECODE_STREAM_GATE_PLACES) > FKDA_DECODE_STREAM_BARRIER_BYTES
#error "the barriers exceed their place"
#endif
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_stages_offset(int32_t warps) {
  return fkda_decode_stream_barriers_offset(warps) + FKDA_DECODE_STREAM_BARRIER_BYTES;
}
static inline FKDA_HOST_DEVICE int32_t fkda_decode_stream_smem_bytes(int32_t warps, int32_t stages,
                                                                     int32_t stage_bytes) {
  return fkda_decode_stream_stages_offset(warps) + stages * stage_bytes;
}

typedef struct FkdaDecodeParams {
  FkdaRecurrenceCall call;

  void* pool;               /* [slots, H, V, K] (or [slots, H, K, V]) */
  int64_t pool_slots;
  int64_t pool_slot_stride; /* elements */

  FkdaIndexTable state_indices;   /* [N] (cols 1) or [N, W] */
  FkdaIndexTable num_accepted;    /* [N], with a table; data NULL means 1 */
  int32_t indices_are_table;
  int32_t max_tokens; /* sequences longer than this are treated as padding; <= FKDA_DECODE_MAX_TOKENS */
  int32_t warps;      /* per block: 1, 2 or 4; or FKDA_DECODE_LAYER_WARPS (layer step, sm_80);
                       * the streamed kernels: their consumer warps */
  int32_t stages;     /* the streamed kernels' stages a block (below); 0 for the others */
  FkdaLayerStep layer; /* conv states' rows are pool slots */
} FkdaDecodeParams;

#endif /* FLASHKDA_KERNELS_DECODE_PARAMS_H */
