/* SPDX-License-Identifier: MIT */
/* Parameters of the prefill kernels, shared by the launch code in
 * src/gpu/gpu_backend.cpp and the device code in kernels/. Plain C with fixed-width
 * types and no CUDA types, so that host translation units include it as is.
 * The struct is passed by value as the single kernel argument. */
#ifndef FLASHKDA_KERNELS_KDA_PARAMS_H
#define FLASHKDA_KERNELS_KDA_PARAMS_H

#include <stdint.h>

/* The size helpers below are used by the launch code and the kernels alike. */
#if defined(__CUDACC__)
#define FKDA_HOST_DEVICE __host__ __device__
#else
#define FKDA_HOST_DEVICE
#endif

/* Tokens per chunk and the one head dimension (K = V) the kernels support. */
#define FKDA_CHUNK 16
#define FKDA_HEAD_DIM 128

/* log2(e) as an f32: the gates are computed in base 2 (docs/ARCHITECTURE.md,
 * section 4). The CPU backend uses this constant too, so that it rounds
 * exactly where the kernels do. */
#define FKDA_LOG2E 1.4426950408889634f

/* The workspace holds one record per (chunk slot, head), written by the
 * preparation kernel and read by the recurrence kernel (byte offsets):
 *   Kd, Qd, Kr   f16 [16][128] each (token-major)
 *   decay        f32 [128]
 *   W, Mqk       f16 [16][16] each (row-major)
 * The recurrence copies a record byte for byte into shared memory and reads
 * it with ldmatrix, so the tiles are stored swizzled, free of bank conflicts
 * without padding: the 16-byte piece p of row r sits at piece p ^ (r % 8) in a
 * 128-wide tile, and at p ^ ((r / 4) % 2) in a 16-wide one. */
#define FKDA_WS_KD_OFFSET 0
#define FKDA_WS_QD_OFFSET 4096
#define FKDA_WS_KR_OFFSET 8192
#define FKDA_WS_DECAY_OFFSET 12288
#define FKDA_WS_W_OFFSET 12800
#define FKDA_WS_MQK_OFFSET 13312
#define FKDA_WS_RECORD_BYTES 13824

/* Sequence n's chunks occupy slots [slot_base(n), slot_base(n) + ceil(len/16))
 * with slot_base(n) = floor(start_n / 16) + n, start_n its first token in the
 * packed token order. Slots never overlap for sorted offsets, and the count
 * below bounds them without reading the offsets. */
static inline FKDA_HOST_DEVICE int64_t fkda_num_chunk_slots(int64_t total_tokens, int64_t num_seqs) {
  return total_tokens / FKDA_CHUNK + num_seqs + 1;
}

/* The slots are processed in windows of consecutive slots, each by one
 * preparation and one recurrence launch, so that the workspace holds the
 * records of one window only. A sequence whose slots run across a window's
 * end hands its state to the next window through a carry matrix: f32
 * [num_heads][V][K] per window boundary (the state is never rounded between
 * windows). Sorted sequences occupy disjoint slot ranges, so at most one
 * sequence crosses each boundary and one matrix per head suffices. */
#define FKDA_CARRY_BYTES_PER_HEAD (FKDA_HEAD_DIM * FKDA_HEAD_DIM * 4)

/* The recurrence kernel: one block per (sequence, head, V slice); a warp owns
 * 16 rows of V, so a block has 8 / vsplit warps, and there is one kernel per
 * vsplit (1, 2, 4, 8). Its dynamic shared memory is a ring of
 * FKDA_RECURRENCE_STAGES stages, each a chunk's record followed by its v rows
 * (padded against bank conflicts), plus one output tile per warp. */
#define FKDA_RECURRENCE_STAGES 4
#define FKDA_STAGE_V FKDA_WS_RECORD_BYTES
#define FKDA_OUT_TILE_PITCH_BYTES 48 /* a 16-wide bf16 row plus 16 bytes */
#define FKDA_OUT_TILE_BYTES (FKDA_CHUNK * FKDA_OUT_TILE_PITCH_BYTES)

static inline FKDA_HOST_DEVICE int32_t fkda_recurrence_warps(int32_t vsplit) { return 8 / vsplit; }
static inline FKDA_HOST_DEVICE int32_t fkda_v_tile_pitch_bytes(int32_t vsplit) {
  return (FKDA_HEAD_DIM / vsplit) * 2 + 16;
}
static inline FKDA_HOST_DEVICE int32_t fkda_recurrence_stage_bytes(int32_t vsplit) {
  return FKDA_STAGE_V + FKDA_CHUNK * fkda_v_tile_pitch_bytes(vsplit);
}
static inline FKDA_HOST_DEVICE int32_t fkda_recurrence_smem_bytes(int32_t vsplit) {
  return FKDA_RECURRENCE_STAGES * fkda_recurrence_stage_bytes(vsplit) +
         fkda_recurrence_warps(vsplit) * FKDA_OUT_TILE_BYTES;
}

/* The preparation kernel: one block of this many threads per (slot, head),
 * compiled for this many resident blocks per multiprocessor (64 registers a
 * thread) from sm_90 on (prefill_prepare.cuh). */
#define FKDA_PREPARE_THREADS 128
#define FKDA_PREPARE_MIN_BLOCKS 8

/* How the per-channel log-decay and beta's step size are formed: the values
 * of flashkda.h's fkda_gate_mode and fkda_beta_mode (src/gpu/kernel_library.h
 * asserts that they agree). A_log and dt_bias may be NULL (exp(A_log) = 1,
 * dt_bias = 0) where the mode allows it. */
#define FKDA_KERNEL_GATE_BOUNDED 0
#define FKDA_KERNEL_GATE_SOFTPLUS 1
#define FKDA_KERNEL_GATE_LOG_DECAY 2
#define FKDA_KERNEL_BETA_LOGITS 0
#define FKDA_KERNEL_BETA_PROBABILITIES 1

/* Per-token base-2 log-decays of the unbounded gates are clamped to this
 * floor: 2^-150 rounds to 0 in f32, so no decay factor changes, while the
 * running sums over a chunk stay finite (>= -2400) and -inf gives no NaN. */
#define FKDA_LOG2_DECAY_FLOOR (-150.0f)

typedef struct FkdaGate {
  int32_t mode;      /* FKDA_KERNEL_GATE_* */
  int32_t beta_mode; /* FKDA_KERNEL_BETA_* */
  int32_t g_is_f32;  /* else bf16 (f32 with LOG_DECAY only) */
  int32_t beta_is_f32;
} FkdaGate;

/* An activation [B, T, H, D] (or [B, T, H] for beta): element strides of the
 * batch, token and head axes; the D axis is contiguous. */
typedef struct FkdaActivation {
  const void* data;
  int64_t stride_b;
  int64_t stride_t;
  int64_t stride_h;
} FkdaActivation;

typedef struct FkdaOutput {
  void* data;
  int64_t stride_b;
  int64_t stride_t;
  int64_t stride_h;
} FkdaOutput;

/* Per-sequence integers on the device ([rows] or [rows, cols]: slot
 * indices, counts, offsets, flags), never read by the host; element (r, c)
 * at r * stride_row + c * stride_col. */
typedef struct FkdaIndexTable {
  const void* data; /* NULL: absent */
  int64_t stride_row;
  int64_t stride_col;
  int32_t element_bytes; /* 1 (bool), 4 (i32) or 8 (i64) */
  int32_t cols;
} FkdaIndexTable;

/* What the prefill, decode and transition kernels share, embedded first in
 * each one's parameters (the host's RecurrenceCall, src/prefill_problem.h):
 * the activations, the gate, the state's form, the sequence offsets, sizes
 * and scalars. */
typedef struct FkdaRecurrenceCall {
  FkdaActivation q, k, v, g, beta; /* bf16 (g, beta: or f32, see gate) */
  FkdaOutput out;                  /* bf16 */
  const float* A_log;              /* [H] or NULL */
  const float* dt_bias;            /* [H, K] or NULL */
  FkdaGate gate;

  const void* cu_seqlens; /* NULL: sequence n is batch row n */
  int64_t cu_seqlens_stride;
  int32_t cu_seqlens_is_i64; /* else i32 */
  int32_t num_heads;

  int64_t seq_len;  /* T: tokens per row (the packed total with cu_seqlens) */
  int64_t num_seqs; /* N */

  float scale;
  float gate_scale;        /* lower_bound * log2(e) */
  int32_t state_is_bf16;   /* else f32 */
  int32_t state_is_kv;     /* [.., H, K, V]; else [.., H, V, K] */
  int32_t first_real_slot; /* 0 or 1: smaller pool indices are null (fkda_null_slot_rule) */
  int32_t reserved;        /* zero */
} FkdaRecurrenceCall;

/* The layer step's convolution and output gate (flashkda.h, "The layer
 * step"; layer_params.h has the kernels that run it around the prefill):
 * here because the preparation kernel convolves q and k itself. */

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
  /* fkda_fwd's preparation kernels: q's and k's weights and biases as
   * fkda_layer_pack_conv_weights wrote them (FKDA_CONV_TABLE_*,
   * layer_params.h); NULL in other kernels. */
  const float* conv_table;
} FkdaLayerStep;

typedef struct FkdaPrefillParams {
  FkdaRecurrenceCall call;

  const void* initial_state; /* NULL: zeros */
  void* final_state;         /* NULL: not written */

  unsigned char* workspace; /* the window's records: (slot - window_first) * num_heads + head */
  int64_t num_slots;        /* of the whole call (fkda_num_chunk_slots) */
  int64_t window_first;     /* the slots [window_first, window_end) of this launch pair */
  int64_t window_end;
  const float* carry_in; /* the state entering this window; NULL in the first */
  float* carry_out;      /* the state leaving it; NULL in the last */

  int32_t vsplit; /* 1, 2, 4 or 8 blocks share one head's V rows */
  /* Non-zero: the next window's preparation follows as a programmatic
   * dependent launch, and the recurrence lets it start at once. */
  int32_t overlap_next;

  /* States in a pool instead of initial_state / final_state (state_pool
   * non-NULL): sequence n starts from and ends in slot state_indices[n]; a
   * null index or one outside the pool makes it padding (zero output rows, no
   * state read or written). */
  void* state_pool; /* [slots, H, V, K] (or KV), the state dtype */
  int64_t pool_slots;
  int64_t pool_slot_stride;   /* elements */
  FkdaIndexTable state_indices;     /* [N] */
  FkdaIndexTable has_initial_state; /* [N], optional: 0 starts from zeros (either state form) */

  /* Checkpoints (checkpoint_offsets.data non-NULL): the state after
   * checkpoint_offsets[n][c] tokens (a multiple of 16 in [16, length]; others
   * are skipped) goes to checkpoints + n * stride_n + c * stride_c (an
   * [H, V, K] block, or KV) or, when checkpoints is NULL, to pool slot
   * checkpoint_slots[n][c] (null or outside the pool: skipped). */
  FkdaIndexTable checkpoint_offsets; /* [N, C] */
  void* checkpoints;
  int64_t checkpoint_stride_n; /* elements */
  int64_t checkpoint_stride_c;
  FkdaIndexTable checkpoint_slots; /* [N, C] */
  int32_t checkpoint_is_bf16;      /* else f32 */
  int32_t reserved;                /* zero */

  /* Chunk-parallel prefill (segment_chunks > 0): each sequence's chunks in
   * the window are cut into segments of segment_chunks chunks, counted from
   * the sequence's first chunk. The recurrence grid's x is then
   * num_seqs * segments_per_seq, block x = n * segments_per_seq + s - s0
   * (s0: the sequence's first segment in the window). Segment s of sequence
   * n has the record index fkda_segment_index (below); seg_m and seg_e hold
   * per (segment, head) an f32 V x K matrix: the segment's transition
   * (docs/ARCHITECTURE.md, "Chunk-parallel prefill") and, after the scan,
   * the state leaving it. */
  int64_t segment_chunks;
  int64_t segments_per_seq;
  int64_t segment_capacity; /* records in seg_m and in seg_e, per head */
  float* seg_m;
  float* seg_e;
  /* fkda_transitions: every segment from zero / the identity (no incoming
   * state), and the scan composes them all into trans_m / trans_e, which
   * also carry the running transition from one window to the next. */
  int32_t transitions_only;
  int32_t reserved2; /* zero */
  float* trans_m; /* [N, H, K, K] */
  float* trans_e; /* [N, H, V, K] (KV plans: [N, H, K, V]) */

  /* fkda_fwd's convolution (layer.conv_width > 0): q and k are the raw
   * projections, which the preparation kernel convolves as it loads them
   * (v comes convolved). Sequence n's conv state row is the pool slot of
   * its recurrent state (state_indices, pool_slots; padding reads none) or
   * row n, read where the sequence reads a recurrent state (initial_state
   * or the pool) unless has_initial_state[n] is 0. */
  FkdaLayerStep layer;
} FkdaPrefillParams;

/* The record of segment s (counted from the sequence's chunk 0) of sequence
 * n, from its nominal first slot slot_base + s * segment_chunks (before the
 * window's first slot for a sequence that entered from the previous window,
 * but by less than segment_chunks). Along a sequence the index steps by one
 * per segment; sorted sequences occupy ascending, disjoint slot ranges, so
 * the + n makes it unique within the window and keeps it below
 * fkda_segment_capacity. Unsorted offsets can give an index outside: the
 * kernels then skip the segment. */
static inline FKDA_HOST_DEVICE int64_t fkda_segment_index(int64_t nominal_first_slot, int64_t window_first,
                                                          int64_t segment_chunks, int64_t n) {
  return (nominal_first_slot - window_first + segment_chunks) / segment_chunks + n;
}
static inline FKDA_HOST_DEVICE int64_t fkda_segment_capacity(int64_t window_slots, int64_t segment_chunks,
                                                             int64_t num_seqs) {
  return (window_slots + segment_chunks - 1) / segment_chunks + num_seqs;
}

/* fkda_apply_transitions: S <- S M_r + E_r for r = 0 .. R-1 (flashkda.h,
 * "Segment transitions"), one block of FKDA_SCAN_THREADS threads per
 * (sequence, head, FKDA_SCAN_ROWS rows of S). */
typedef struct FkdaApplyParams {
  const float* m;  /* [R, N, H, K, K] (KV plans: each transposed) */
  const float* e;  /* [R, N, H, V, K] (KV plans: [R, N, H, K, V]) */
  int64_t num_transitions;
  int64_t num_seqs;
  int32_t num_heads;
  int32_t state_is_kv;
  const void* initial_state; /* NULL: zeros */
  void* final_state;
  int32_t state_is_bf16;
  int32_t reserved; /* zero */
} FkdaApplyParams;
#define FKDA_APPLY_SMEM_BYTES (FKDA_HEAD_DIM * FKDA_HEAD_DIM * 4 + FKDA_HEAD_DIM * FKDA_SCAN_ROWS * 4 * 5)

/* The scan over a window's segments: one block of FKDA_SCAN_THREADS threads
 * per (sequence, head, FKDA_SCAN_ROWS rows of the state), holding M of the
 * current and the next segment in shared memory. */
#define FKDA_SCAN_ROWS 8
#define FKDA_SCAN_THREADS 256
/* Two M stages, X^T, and the four partial products of the K split. */
#define FKDA_SCAN_SMEM_BYTES \
  (2 * FKDA_HEAD_DIM * FKDA_HEAD_DIM * 4 + FKDA_HEAD_DIM * FKDA_SCAN_ROWS * 4 * 5)

#endif /* FLASHKDA_KERNELS_KDA_PARAMS_H */
