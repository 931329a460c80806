/* SPDX-License-Identifier: MIT */
/*
 * flashkda.h - the public C ABI of libflashkda.
 *
 * libflashkda computes Kimi Delta Attention (KDA) forward passes. Its
 * default gate is bounded: the gate floor `lower_bound` (in [-5, 0]) keeps
 * the chunked exp(cumsum(g)) factors of 16-token chunks inside bf16/f32
 * range. Plans may instead take the unbounded softplus gate or precomputed
 * log-decays (fkda_gate_mode), and beta as logits or probabilities.
 *
 * Rules of this header:
 *  - C99, no CUDA or C++ types. Streams are `struct CUstream_st*`, the same
 *    type as cudaStream_t and CUstream.
 *  - Every function returns fkda_status (FKDA_SUCCESS == 0) except the few
 *    that return static text or a version number. On failure,
 *    fkda_last_error() holds a thread-local message naming the argument.
 *  - Structs passed by pointer begin with `size_t struct_size`; fill them
 *    with their _INIT macro. Fields are only ever appended. The sizes
 *    accepted are exactly the sizeof of each release of this header that
 *    changed the struct (fkda_plan_desc: 40 in 0.1, 48 in 0.2, 56 in 0.3,
 *    80 in 0.4, 88 in 0.5; fkda_fwd_args: 1248 in 0.1, 1920 in 0.2, 3160
 *    in 0.5; fkda_decode_args 1360 in 0.2, 2600 in 0.5; fkda_device_info
 *    296, fkda_build_info 80; fkda_launch_report: 32
 *    in 0.2, 48 in 0.4; fkda_transition_args 1016, fkda_apply_args 456; all
 *    on LP64): a program built against an older header keeps working, only
 *    the fields its release had are read, and the others take their _INIT
 *    values. A larger size, from a newer header, is accepted when every byte
 *    past the last field this library knows is zero (the program sets no
 *    field this library lacks) and the size is at most 4096 bytes past this
 *    header's; the first non-zero byte is named otherwise. Any other size is
 *    an error naming the struct. The library reads struct_size bytes of an
 *    input struct: zero a struct from a newer header whole (memset) before
 *    filling it, as its padding counts. Output structs (fkda_device_info,
 *    fkda_build_info, fkda_launch_report) obey the same sizes; only the
 *    fields of the caller's release are written, nothing past them.
 *  - The caller owns all memory. GPU calls take workspace and stream per
 *    call, allocate nothing and never synchronise the host.
 */
#ifndef FLASHKDA_H
#define FLASHKDA_H

#include <stddef.h>
#include <stdint.h>

#define FKDA_VERSION_MAJOR 0
#define FKDA_VERSION_MINOR 5
#define FKDA_VERSION_PATCH 0
/* MAJOR * 10000 + MINOR * 100 + PATCH, the value fkda_version() returns. */
#define FKDA_VERSION_NUMBER \
  (FKDA_VERSION_MAJOR * 10000 + FKDA_VERSION_MINOR * 100 + FKDA_VERSION_PATCH)

#if defined(_WIN32)
#  if defined(FLASHKDA_BUILDING)
#    define FKDA_API __declspec(dllexport)
#  else
#    define FKDA_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__)
#  define FKDA_API __attribute__((visibility("default")))
#else
#  define FKDA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Status                                                                   */
/* ------------------------------------------------------------------------ */

typedef enum fkda_status {
  FKDA_SUCCESS = 0,
  FKDA_ERROR_INVALID_ARGUMENT = 1,   /* bad pointer, dtype, shape, stride, value */
  FKDA_ERROR_UNSUPPORTED = 2,        /* valid request this build cannot serve */
  FKDA_ERROR_NO_DEVICE = 3,          /* no driver, no GPU, or no current context */
  FKDA_ERROR_DRIVER = 4,             /* a CUDA driver call failed */
  FKDA_ERROR_UNSUPPORTED_ARCH = 5,   /* no kernel image for this GPU */
  FKDA_ERROR_WORKSPACE_TOO_SMALL = 6,
  FKDA_ERROR_LAUNCH_FAILED = 7,
  FKDA_ERROR_OUT_OF_MEMORY = 8,      /* host allocation failed */
  FKDA_ERROR_INTERNAL = 9
} fkda_status;

/* Static text for a status ("invalid argument", ...); never NULL. */
FKDA_API const char* fkda_status_string(fkda_status status);

/* The message of the last failing call on this thread, naming the argument
 * and what was expected ("q: expected dtype bf16, got f32"). A successful
 * call empties it, except fkda_plan_destroy, which leaves it as it is (a
 * destroy run by a garbage collector or destructor between a failing call
 * and this read keeps its message), and the functions that return no status.
 * Valid until the next fkda_* call on this thread. */
FKDA_API const char* fkda_last_error(void);

/* FKDA_VERSION_NUMBER of the library actually loaded. */
FKDA_API uint32_t fkda_version(void);
/* "MAJOR.MINOR.PATCH" of the library actually loaded. */
FKDA_API const char* fkda_version_string(void);

/* ------------------------------------------------------------------------ */
/* Tensors                                                                  */
/* ------------------------------------------------------------------------ */

typedef enum fkda_dtype {
  FKDA_DTYPE_INVALID = 0,
  FKDA_DTYPE_BF16 = 1,
  FKDA_DTYPE_F16 = 2,
  FKDA_DTYPE_F32 = 3,
  FKDA_DTYPE_I32 = 4,
  FKDA_DTYPE_I64 = 5,
  FKDA_DTYPE_BOOL = 6 /* one byte, nonzero is true (has_initial_state) */
} fkda_dtype;

#define FKDA_MAX_RANK 6

/* A strided view of memory. The layout of this struct is frozen.
 * `dtype` holds an fkda_dtype; strides count elements, not bytes.
 * An optional tensor is absent when data == NULL and rank == 0.
 * Every call accepts a present tensor only when:
 *  - its extents are >= 0. A tensor with a zero extent is empty: nothing of
 *    it is read or written, and its data (NULL too), strides and alignment
 *    are not checked;
 *  - its strides are >= 0 (negative strides are rejected). The stride of an
 *    axis of extent 1 is never used and not checked;
 *  - data is aligned to the element size (2 bytes for bf16, 4 for f32 and
 *    i32, 8 for i64);
 *  - its byte span, element size * (1 + sum of (extent - 1) * stride over
 *    the axes), fits in int64_t and data + span does not pass the end of the
 *    address space;
 *  - the axes its argument's description calls contiguous are: "last axis
 *    contiguous" means stride 1 there, "packed" means row-major strides.
 * A tensor a call writes must not map two elements to one address. */
typedef struct fkda_tensor {
  void* data;
  int32_t dtype;
  int32_t rank;
  int64_t shape[FKDA_MAX_RANK];
  int64_t strides[FKDA_MAX_RANK];
} fkda_tensor;

#define FKDA_TENSOR_NONE \
  { NULL, FKDA_DTYPE_INVALID, 0, {0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0} }

/* ------------------------------------------------------------------------ */
/* Plans                                                                    */
/* ------------------------------------------------------------------------ */

typedef enum fkda_backend {
  FKDA_BACKEND_AUTO = 0, /* GPU when a usable device with kernels exists, else CPU */
  FKDA_BACKEND_CPU = 1,  /* reference backend on host memory */
  FKDA_BACKEND_GPU = 2   /* CUDA backend on device memory */
} fkda_backend;

typedef enum fkda_state_layout {
  FKDA_STATE_LAYOUT_VK = 0, /* [N, H, V, K]: V-first, decays along the last axis */
  FKDA_STATE_LAYOUT_KV = 1  /* [N, H, K, V] */
} fkda_state_layout;

/* Which slot indices of a state pool mean "no sequence here" (padding):
 * nothing is read or written for such a sequence and its output rows are
 * zero. Runtimes differ: some pad with -1 and use slot 0, others reserve
 * slot 0 as the null slot. */
typedef enum fkda_null_slot_rule {
  FKDA_NULL_SLOT_NEGATIVE = 0,    /* index < 0 is padding; slot 0 is a real slot (default) */
  FKDA_NULL_SLOT_NONPOSITIVE = 1  /* index <= 0 is padding; slot 0 is never touched */
} fkda_null_slot_rule;

/* How the per-channel decay of each token is formed (appended in 0.3). In
 * every mode the decay is exp(a) with a log-decay a <= 0:
 *   BOUNDED    a = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))
 *              in [lower_bound, 0]. A_log and dt_bias are optional: absent
 *              means exp(A_log) = 1 and dt_bias = 0.
 *   SOFTPLUS   a = -exp(A_log[h]) * softplus(g + dt_bias[h]), softplus(x) =
 *              log(1 + exp(x)), taken as x above 20 (Kimi-Linear's gate).
 *              A_log is required, dt_bias optional. No floor: any decay, down
 *              to total forgetting, is computed without overflow.
 *   LOG_DECAY  a = g: the log-decay itself, computed by the caller (bf16 or
 *              f32; values above 0 are read as 0). A_log and dt_bias must be
 *              absent.
 * lower_bound belongs to BOUNDED only. */
typedef enum fkda_gate_mode {
  FKDA_GATE_BOUNDED = 0,  /* default */
  FKDA_GATE_SOFTPLUS = 1,
  FKDA_GATE_LOG_DECAY = 2
} fkda_gate_mode;

/* How beta becomes the delta rule's step size b (appended in 0.3). */
typedef enum fkda_beta_mode {
  FKDA_BETA_LOGITS = 0,       /* b = sigmoid(beta) (default) */
  FKDA_BETA_PROBABILITIES = 1 /* b = beta, already in [0, 1] (clamped into it) */
} fkda_beta_mode;

typedef struct fkda_plan_s* fkda_plan_t;
typedef struct CUstream_st* fkda_stream_t;

typedef struct fkda_plan_desc {
  size_t struct_size;   /* sizeof(fkda_plan_desc) */
  int32_t num_heads;    /* H, > 0 */
  int32_t head_dim_k;   /* K, 128 */
  int32_t head_dim_v;   /* V, 128 */
  int32_t state_dtype;  /* fkda_dtype of initial/final state: BF16 or F32 */
  int32_t state_layout; /* fkda_state_layout */
  int32_t backend;      /* fkda_backend */
  float lower_bound;    /* gate floor in [-5, 0]; BOUNDED gate only (other
                           gates need it left at the _INIT value, -5) */
  /* Appended in 0.2 (a desc of the 0.1 size takes the _INIT values): */
  int32_t null_slot_rule; /* fkda_null_slot_rule for state_indices and slot tables */
  int32_t debug_checks;   /* 0 or 1. 1: GPU calls copy device-side indices,
                             offsets and slot tables to the host and check them
                             before the launch (synchronises; not for graph
                             capture); every plan then also reports two
                             sequences sharing a slot. The environment variable
                             FKDA_DEBUG_CHECKS=1 turns it on for every plan
                             created while it is set. */
  /* Appended in 0.3 (a desc of an earlier size takes the _INIT values): */
  int32_t gate_mode;      /* fkda_gate_mode */
  int32_t beta_mode;      /* fkda_beta_mode */
  /* Appended in 0.4: how GPU prefill is launched, fixed for the plan's
   * lifetime (section "Launch report and tuning" below). 0 everywhere is the
   * automatic choice. None of them changes the result beyond rounding. */
  int32_t vsplit;          /* 0, or 1, 2, 4, 8: blocks sharing a head's V rows */
  int32_t chunk_parallel;  /* fkda_chunk_parallel */
  int64_t window_slots;    /* 0, or > 0: chunk slots per window */
  int64_t segment_chunks;  /* 0, or > 0: chunks per segment of the
                              chunk-parallel path */
  /* Appended in 0.5: */
  int32_t layer_step;      /* 0 or 1. 1: fkda_fwd calls may pass the
                              convolution of the layer step (fkda_layer_step);
                              fkda_plan_workspace_size then counts the
                              workspace it needs. fkda_decode and the output
                              gate need no flag. */
} fkda_plan_desc;

/* Whether GPU prefill cuts long sequences into segments that run in
 * parallel (appended in 0.4; docs/ARCHITECTURE.md, "Chunk-parallel
 * prefill"). AUTO decides from the call's T, N and H alone. CPU plans take
 * their chunk-parallel path only with ON (segments of segment_chunks chunks,
 * 64 when 0; the workspace size grows with it); AUTO keeps them serial. */
typedef enum fkda_chunk_parallel {
  FKDA_CHUNK_PARALLEL_AUTO = 0,
  FKDA_CHUNK_PARALLEL_OFF = 1, /* one chain of chunks per sequence */
  FKDA_CHUNK_PARALLEL_ON = 2   /* segments whenever a sequence may have more than one */
} fkda_chunk_parallel;

#define FKDA_PLAN_DESC_INIT                                                 \
  { sizeof(fkda_plan_desc), 0, 128, 128, FKDA_DTYPE_F32,                    \
    FKDA_STATE_LAYOUT_VK, FKDA_BACKEND_AUTO, -5.0f,                         \
    FKDA_NULL_SLOT_NEGATIVE, 0, FKDA_GATE_BOUNDED, FKDA_BETA_LOGITS,        \
    0, FKDA_CHUNK_PARALLEL_AUTO, 0, 0, 0 }

/* Validates `desc` and creates a plan. A plan is a small host object: it
 * allocates no device memory and loads nothing until its first GPU call.
 * A plan of FKDA_BACKEND_CPU never loads or initialises the CUDA driver: it
 * asks the driver where memory lives only when the process has already
 * started CUDA (AUTO asks the driver at creation to choose).
 *
 * Threads: every call taking a plan may run on it from any number of
 * threads at once, fkda_set_lower_bound and fkda_plan_destroy included. A
 * call holds the plan from its start to its return. */
FKDA_API fkda_status fkda_plan_create(const fkda_plan_desc* desc,
                                      fkda_plan_t* plan);
/* NULL is accepted and ignored. Returns at once, also while other threads'
 * calls on the plan run: those finish normally (GPU work they enqueued is
 * unaffected), and the plan's memory is freed when the last of them
 * returns. Any call that starts after fkda_plan_destroy returned, a second
 * destroy included, fails with FKDA_ERROR_INVALID_ARGUMENT ("plan: not a
 * live plan"); a handle is never given to another plan. */
FKDA_API fkda_status fkda_plan_destroy(fkda_plan_t plan);

/* The backend the plan resolved to (CPU or GPU; never AUTO). */
FKDA_API fkda_status fkda_plan_get_backend(fkda_plan_t plan,
                                           fkda_backend* backend);

/* The gate floor of a BOUNDED plan (other gate modes have none: both calls
 * fail on them). Accepted range [-5, 0]: below -5 the 16-token chunk's
 * exp(16 * |lower_bound|) key factor leaves bf16 range. NaN and infinities
 * are rejected. fkda_fwd and fkda_decode read the floor once, at their
 * start: one running while the floor is set uses the old or the new value
 * throughout. */
FKDA_API fkda_status fkda_set_lower_bound(fkda_plan_t plan, float lower_bound);
FKDA_API fkda_status fkda_get_lower_bound(fkda_plan_t plan, float* lower_bound);

/* Bytes of workspace fkda_fwd needs for `total_tokens` tokens in `num_seqs`
 * sequences (B*T and B without cu_seqlens; T and N with them). Any sizes
 * >= 0 are answered, except GPU workspaces larger than int64_t can count
 * (FKDA_ERROR_UNSUPPORTED). The workspace passed to fkda_fwd must be 16-byte
 * aligned (malloc and cudaMalloc memory is). */
FKDA_API fkda_status fkda_plan_workspace_size(fkda_plan_t plan,
                                              int64_t total_tokens,
                                              int64_t num_seqs,
                                              size_t* bytes);

/* ------------------------------------------------------------------------ */
/* The layer step around the recurrence (appended in 0.5)                   */
/* ------------------------------------------------------------------------ */

/* A KDA layer (Kimi-Linear) does between its input and output projections:
 *   q, k, v = SiLU(causal depthwise convolution of width W of their
 *             projections, plus an optional bias), per channel c of H*K:
 *             x'[t][c] = silu(bias[c] + sum_{j<W} weight[c][j] x[t-W+1+j][c])
 *   the recurrence of fkda_fwd / fkda_decode on q, k, v;
 *   o = RMSNorm(o) * w * sigmoid(g_out), over each head's V values:
 *             o'[v] = o[v] / sqrt(mean_v(o^2) + eps) * w[v] * sigmoid(g_out[v]).
 * fkda_fwd and fkda_decode do both parts in the same call when given this
 * struct (a member of their arguments). Every field is optional: the
 * convolution runs when conv_weight_q is present, the output gate when
 * out_gate is.
 *
 * Convolution: q, k and v are then the raw projections (any strides of the
 * token and head axes, so three views into one packed [T, 3*H*K] buffer
 * work). conv_weight_q, _k, _v are bf16 or f32 [H*K, W] (one dtype for the
 * three, W in 2..4, any strides; torch's [H*K, 1, W] weight viewed as
 * [H*K, W]); the biases, all three or none, [H*K] in the weights' dtype.
 * The convolution state of a sequence is the raw inputs before its first
 * token, oldest first: conv_state_q, _k, _v, all three or none, bf16 or f32
 * (one dtype), [rows, H*K, Wc] with Wc = W - 1 or W (the last W - 1
 * columns are read; any strides, so channel-last pools work), rows being
 * the pool's slots when the call takes state_indices and the sequences
 * otherwise. They are written, so they share memory with nothing, with one
 * exception: the three may be the q, k and v channel blocks of one
 * [rows, 3*H*K, Wc] tensor (the same strides, k's data H*K channels after
 * q's and v's 2*H*K after), as a runtime keeps one conv pool. A sequence reads it when it reads a recurrent state
 * (initial_state, or a pool slot, unless has_initial_state is 0) and starts
 * from zeros otherwise, as does every sequence without conv states. After
 * the call, a sequence's row holds its last Wc raw inputs (from the old
 * state where it had fewer tokens, zeros where it read none): updated in
 * place, every read of a row before any write to it. Padding and
 * zero-length sequences touch nothing (not even the row a zero-length
 * sequence's recurrent state is written back to). Checkpoints to pool slots
 * (checkpoint_slots) write the convolution state at each checkpoint too
 * (the Wc raw inputs before its offset), so conv states with
 * checkpoint_slots need state_indices; checkpoints to a tensor carry the
 * recurrent state only. fkda_decode with an [N, W] slot table (speculative
 * verify) refuses the convolution (FKDA_ERROR_UNSUPPORTED): a rejected
 * draft would need the convolution state of every column.
 *
 * Output gate: out_gate (g_out) bf16 [B, T, H, V] like v (last axis
 * contiguous); out_norm_weight (w) bf16 or f32 [V], required with it and
 * refused without it; out_norm_eps finite and > 0 (read only with out_gate).
 * Padding sequences' output rows stay zero. reserved must be 0.
 *
 * fkda_fwd rounds the convolved q, k and v to bf16, as they would be
 * stored between two kernels, and gates the bf16 output of the recurrence;
 * fkda_decode keeps both in f32. On GPU plans, fkda_decode of large batches
 * is fastest with conv states whose channels are contiguous (stride 1 along
 * Wc, Wc along the channels, rows 16-byte aligned): other strides take a
 * slower kernel. The layout of this struct is frozen. */
typedef struct fkda_layer_step {
  fkda_tensor conv_weight_q;
  fkda_tensor conv_weight_k;
  fkda_tensor conv_weight_v;
  fkda_tensor conv_bias_q;
  fkda_tensor conv_bias_k;
  fkda_tensor conv_bias_v;
  fkda_tensor conv_state_q;
  fkda_tensor conv_state_k;
  fkda_tensor conv_state_v;
  fkda_tensor out_gate;
  fkda_tensor out_norm_weight;
  float out_norm_eps; /* default 1e-5 */
  int32_t reserved;   /* zero */
} fkda_layer_step;

#define FKDA_LAYER_STEP_INIT                                                 \
  { FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,  \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,  \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, 1e-5f, 0 }

/* ------------------------------------------------------------------------ */
/* Forward (prefill)                                                        */
/* ------------------------------------------------------------------------ */

/* Shapes (K = V = 128; N = B, or cu_seqlens' length - 1 with B == 1), under
 * the rules of fkda_tensor above:
 *   q, k         bf16 [B, T, H, K]    last axis contiguous
 *   g            bf16 [B, T, H, K]    last axis contiguous (bf16 or f32 with
 *                                     the LOG_DECAY gate)
 *   v, out       bf16 [B, T, H, V]    last axis contiguous
 *   beta         bf16 or f32 [B, T, H] any strides (logits or probabilities:
 *                                     the plan's beta_mode)
 *   A_log        f32  [H]             packed; optional with the BOUNDED gate,
 *                                     absent with LOG_DECAY (fkda_gate_mode)
 *   dt_bias      f32  [H, K]          packed; optional, absent with LOG_DECAY
 *   initial_state, final_state        optional, plan's state dtype,
 *                                     [N, H, V, K] (or [N, H, K, V]), packed;
 *                                     they may be the same buffer (updated in place)
 *   cu_seqlens   optional i64 or i32 [N + 1], stride > 0, non-decreasing,
 *                from 0 to T
 * GPU plans need device memory, and for q, k, v, g, out, dt_bias and the
 * states data 16-byte aligned and strides (but the last) that are multiples
 * of 8 elements.
 *
 * States in a pool (instead of initial_state / final_state):
 *   state_pool         plan's state dtype, [slots, H, V, K] (or [slots, H, K, V]):
 *                      the slot stride is free (>= H*V*K), the rest contiguous
 *   state_indices      i32 or i64 [N]: sequence n starts from
 *                      state_pool[state_indices[n]] and its final state is
 *                      written back there, in place. A null index (the
 *                      plan's null_slot_rule) makes sequence n padding: its
 *                      output rows are zero and no state is read or written.
 *   has_initial_state  optional bool, i32 or i64 [N], with initial_state or
 *                      state_indices: 0 starts sequence n from zeros.
 * Checkpoints (prefix caching): the state after given token counts of each
 * sequence, before the final one is written:
 *   checkpoint_offsets i32 or i64 [N, C]: token counts from the sequence's
 *                      start, multiples of 16 in [16, length], ascending;
 *                      a negative entry means "none" (rows may be padded).
 *   and exactly one destination:
 *   checkpoints        bf16 or f32 [N, C, H, V, K] (or [N, C, H, K, V]): the
 *                      N and C strides are free, the rest contiguous; or
 *   checkpoint_slots   i32 or i64 [N, C]: pool slots of state_pool (null
 *                      indices are skipped).
 * On CPU plans every index and offset the call reads is checked, and a bad
 * one is an error naming the element and the sequence. The call does not
 * read, so never checks: the checkpoint_offsets and checkpoint_slots of a
 * padding sequence, and the checkpoint_slots entry of a negative offset.
 * On GPU plans indices and offsets stay on the device and are not read by
 * the host: an index outside the pool is treated as a null index, a bad
 * checkpoint offset is skipped; nothing is ever read or written outside the
 * tensors. Two sequences writing the same slot in one call is undefined
 * (debug_checks reports it).
 * state_indices excludes initial_state and final_state; a padding sequence
 * writes no checkpoint either. What the call writes (out, final_state,
 * checkpoints, the pool, and the workspace: workspace_bytes from
 * workspace) must not share memory with any other argument, measured from
 * each tensor's first to its last byte. The exception: initial_state and
 * final_state may be the very same memory (updated in place), or disjoint;
 * a partial overlap is an error naming final_state. */
typedef struct fkda_fwd_args {
  size_t struct_size; /* sizeof(fkda_fwd_args) */
  fkda_tensor q;
  fkda_tensor k;
  fkda_tensor v;
  fkda_tensor g;
  fkda_tensor beta;
  fkda_tensor A_log;   /* optional but with the SOFTPLUS gate */
  fkda_tensor dt_bias; /* optional */
  fkda_tensor out;
  fkda_tensor initial_state; /* optional: absent means zeros */
  fkda_tensor final_state;   /* optional */
  fkda_tensor cu_seqlens;    /* optional: absent means one sequence per row */
  float scale;               /* finite; usually K^-0.5 */
  /* Appended in 0.2 (args of the 0.1 size leave them absent): */
  fkda_tensor state_pool;         /* optional, with state_indices or checkpoint_slots */
  fkda_tensor state_indices;      /* optional [N] */
  fkda_tensor has_initial_state;  /* optional [N] */
  fkda_tensor checkpoint_offsets; /* optional [N, C] */
  fkda_tensor checkpoints;        /* optional [N, C, H, V, K] */
  fkda_tensor checkpoint_slots;   /* optional [N, C] */
  /* Appended in 0.5: */
  fkda_layer_step layer; /* optional parts; the convolution needs a plan
                            created with layer_step = 1 */
} fkda_fwd_args;

#define FKDA_FWD_ARGS_INIT                                                   \
  { sizeof(fkda_fwd_args), FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,               \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,  \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,  \
    FKDA_TENSOR_NONE, 0.08838834764831845f, FKDA_TENSOR_NONE,                \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,  \
    FKDA_TENSOR_NONE, FKDA_LAYER_STEP_INIT }

/* Runs the KDA forward pass. Every argument is checked, every kernel
 * resolved and every launch limit checked before any work starts: a call
 * that fails has written nothing and enqueued nothing, with one exception,
 * FKDA_ERROR_LAUNCH_FAILED after the driver accepted earlier launches of
 * the call (a context that failed meanwhile), which leaves in-place states
 * undefined. GPU plans enqueue on `stream` (NULL: the legacy default stream)
 * in the calling thread's current context; CPU plans ignore `stream`.
 * On a GPU plan the contents of cu_seqlens stay on the device and are not
 * read by the host; out-of-range offsets are clamped so that nothing is
 * read or written outside the tensors. */
FKDA_API fkda_status fkda_fwd(fkda_plan_t plan, const fkda_fwd_args* args,
                              void* workspace, size_t workspace_bytes,
                              fkda_stream_t stream);

/* ------------------------------------------------------------------------ */
/* Decode (one or a few tokens per sequence, states in a pool)              */
/* ------------------------------------------------------------------------ */

/* The token-by-token recurrence for 1 to 16 tokens per sequence, on states
 * kept in a pool and updated in place. Same gate, norms, beta and scale as
 * fkda_fwd.
 *   q, k, g, v, out, beta  as in fkda_fwd: batched [N, T, H, *] (T <= 16
 *                      tokens for each of N sequences), or packed [1, T, H, *]
 *                      with cu_seqlens (lengths 0 to 16; zero-length
 *                      sequences are allowed and touch nothing)
 *   A_log, dt_bias     as in fkda_fwd, as are the dtypes of g and beta and the
 *                      plan's gate and beta modes
 *   state_pool         plan's state dtype, [slots, H, V, K] (or [slots, H, K, V]),
 *                      slot stride free (>= H*V*K), the rest contiguous
 *   state_indices      i32 or i64, [N]: start from slot state_indices[n], write
 *                      the state after the sequence's last token back to it;
 *                      or [N, W] (speculative verify, W >= the longest
 *                      sequence): start from the slot in column
 *                      num_accepted_tokens[n] - 1 and write the state after
 *                      token t into the slot in column t (null columns are
 *                      not written)
 *   num_accepted_tokens optional i32 or i64 [N], in [1, W], with [N, W]
 *                      indices only; absent means 1 (column 0)
 *   cu_seqlens         optional i32 or i64 [N + 1]
 * out and the pool must not share memory with each other or any other
 * argument (spans from first to last byte). A sequence whose starting index
 * is null (plan's null_slot_rule) is padding: output rows zero, no state
 * read or written. On CPU plans every index, count and offset the call
 * reads is checked, and a bad one is an error naming the element and the
 * sequence. The call does not read, so never checks: the state_indices
 * row and num_accepted_tokens entry of a zero-length sequence, a slot
 * table's columns at and past a sequence's length (but its starting
 * column, num_accepted_tokens[n] - 1), and the columns of a padding
 * sequence (one whose starting column is null) other than that one. On
 * GPU plans they are not read by the host and a bad one makes its sequence
 * padding.
 * Two sequences writing the same slot in one call is undefined. */
typedef struct fkda_decode_args {
  size_t struct_size; /* sizeof(fkda_decode_args) */
  fkda_tensor q;
  fkda_tensor k;
  fkda_tensor v;
  fkda_tensor g;
  fkda_tensor beta;
  fkda_tensor A_log;
  fkda_tensor dt_bias;
  fkda_tensor out;
  fkda_tensor state_pool;
  fkda_tensor state_indices;
  fkda_tensor num_accepted_tokens; /* optional */
  fkda_tensor cu_seqlens;          /* optional */
  float scale;                     /* finite; usually K^-0.5 */
  /* Appended in 0.5: */
  fkda_layer_step layer; /* optional parts (conv_state rows are pool slots) */
} fkda_decode_args;

#define FKDA_DECODE_ARGS_INIT                                                \
  { sizeof(fkda_decode_args), FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,            \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,  \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,  \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, 0.08838834764831845f,                \
    FKDA_LAYER_STEP_INIT }

/* Bytes of workspace fkda_decode needs for these sizes (0 today: a NULL
 * workspace is then accepted; ask anyway, later versions may need some). */
FKDA_API fkda_status fkda_plan_decode_workspace_size(fkda_plan_t plan,
                                                     int64_t total_tokens,
                                                     int64_t num_seqs,
                                                     size_t* bytes);

/* Runs the decode step. GPU plans enqueue on `stream` with no allocation and
 * no host synchronisation (unless debug_checks is on). As with fkda_fwd, a
 * call that fails has written and enqueued nothing (decode is one launch). */
FKDA_API fkda_status fkda_decode(fkda_plan_t plan, const fkda_decode_args* args,
                                 void* workspace, size_t workspace_bytes,
                                 fkda_stream_t stream);

/* ------------------------------------------------------------------------ */
/* Segment transitions (appended in 0.4): context parallelism               */
/* ------------------------------------------------------------------------ */

/* A segment of a sequence's tokens maps any state entering it to the state
 * leaving it affinely. With S the V x K state (V-first):
 *     S_out = S_in M + E
 * M (K x K) is the ordered product over the segment's tokens of
 * diag(exp(a_t)) (I - b_t k_t k_t^T) (k normalised), and E (V x K) is the
 * segment's final state from a zero state. Two segments in order compose as
 * (M1, E1) then (M2, E2) = (M1 M2, E1 M2 + E2). A runtime that holds a
 * sequence's tokens on several ranks computes each rank's transitions
 * (fkda_transitions), gathers them, applies those of the ranks before it to
 * the sequence's initial state (fkda_apply_transitions) and runs fkda_fwd on
 * its own tokens from that state. The library never communicates.
 *
 * Layouts follow the plan's state layout:
 *   VK plans  M [.., H, K, K] with S_out[v][j] = sum_i S_in[v][i] M[i][j] + E[v][j],
 *             E [.., H, V, K]
 *   KV plans  M and E stored transposed: M [.., H, K, K] holding M^T and
 *             E [.., H, K, V] holding E^T, so S_out^T = M^T S_in^T + E^T
 * Both are f32, packed. An empty segment has M = I and E = 0. M and E are
 * formed with the chunked arithmetic of fkda_fwd (E: its run from a zero
 * state; M: its run from the identity with v = 0), so applying them and
 * running fkda_fwd on the following tokens matches one fkda_fwd over all
 * of them to the f32 state's accuracy, not bit for bit.
 *
 * fkda_transitions: the transitions of each sequence's tokens, as if each
 * started from an unknown state.
 *   k, v, g, beta, A_log, dt_bias, cu_seqlens   as in fkda_fwd (q and out are
 *                      not needed; the plan's gate and beta modes apply)
 *   transition_m       f32 [N, H, K, K], written
 *   transition_e       f32 [N, H, V, K] (KV plans [N, H, K, V]), written;
 *                      must not overlap transition_m
 * GPU plans enqueue on `stream`, allocate nothing and never synchronise;
 * the workspace is sized by fkda_plan_transitions_workspace_size (any sizes
 * >= 0 are answered, as by fkda_plan_workspace_size). CPU plans check the
 * contents of cu_seqlens as fkda_fwd does. */
typedef struct fkda_transition_args {
  size_t struct_size; /* sizeof(fkda_transition_args) */
  fkda_tensor k;
  fkda_tensor v;
  fkda_tensor g;
  fkda_tensor beta;
  fkda_tensor A_log;   /* as in fkda_fwd */
  fkda_tensor dt_bias; /* optional */
  fkda_tensor cu_seqlens; /* optional */
  fkda_tensor transition_m;
  fkda_tensor transition_e;
} fkda_transition_args;

#define FKDA_TRANSITION_ARGS_INIT                                            \
  { sizeof(fkda_transition_args), FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,        \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,  \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE, FKDA_TENSOR_NONE }

FKDA_API fkda_status fkda_plan_transitions_workspace_size(fkda_plan_t plan,
                                                          int64_t total_tokens,
                                                          int64_t num_seqs,
                                                          size_t* bytes);
FKDA_API fkda_status fkda_transitions(fkda_plan_t plan,
                                      const fkda_transition_args* args,
                                      void* workspace, size_t workspace_bytes,
                                      fkda_stream_t stream);

/* fkda_apply_transitions: R transitions per sequence applied in order,
 * r = 0 first, to each sequence's state:
 *   transition_m       f32 [R, N, H, K, K] (R >= 0), layouts as above
 *   transition_e       f32 [R, N, H, V, K] (KV plans [R, N, H, K, V])
 *   initial_state      optional, plan's state dtype and layout, [N, H, V, K]:
 *                      absent means zeros
 *   final_state        plan's state dtype and layout, [N, H, V, K], written;
 *                      may be the same buffer as initial_state, and must not
 *                      overlap it otherwise, nor the transitions
 * The state is carried in f32 between transitions and rounded once. No
 * workspace is needed today (NULL and 0 are accepted). */
typedef struct fkda_apply_args {
  size_t struct_size; /* sizeof(fkda_apply_args) */
  fkda_tensor transition_m;
  fkda_tensor transition_e;
  fkda_tensor initial_state; /* optional */
  fkda_tensor final_state;
} fkda_apply_args;

#define FKDA_APPLY_ARGS_INIT                                                 \
  { sizeof(fkda_apply_args), FKDA_TENSOR_NONE, FKDA_TENSOR_NONE,             \
    FKDA_TENSOR_NONE, FKDA_TENSOR_NONE }

FKDA_API fkda_status fkda_apply_transitions(fkda_plan_t plan,
                                            const fkda_apply_args* args,
                                            void* workspace,
                                            size_t workspace_bytes,
                                            fkda_stream_t stream);

/* ------------------------------------------------------------------------ */
/* Devices                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct fkda_device_info {
  size_t struct_size;     /* sizeof(fkda_device_info), set by the caller */
  int32_t driver_loaded;  /* 1 when libcuda.so.1 loaded and cuInit succeeded */
  int32_t driver_version; /* cuDriverGetVersion, e.g. 13000; 0 if none */
  int32_t device_count;
  int32_t device;         /* ordinal described below, -1 if none */
  int32_t cc_major;       /* compute capability */
  int32_t cc_minor;
  int32_t has_kernels;    /* 1 when this build has a kernel image for it */
  char name[256];
} fkda_device_info;

#define FKDA_DEVICE_INFO_INIT                                               \
  { sizeof(fkda_device_info), 0, 0, 0, -1, 0, 0, 0, { 0 } }

/* Describes device `device` (an ordinal), or with device == -1 the device of
 * the calling thread's current context, else device 0. Succeeds without a
 * driver or GPU (driver_loaded or device_count say so). A driver older than
 * the kernels need (fkda_get_build_info) fails with FKDA_ERROR_NO_DEVICE, the
 * message naming both versions; info->driver_version holds the one found. */
FKDA_API fkda_status fkda_query_device(int32_t device, fkda_device_info* info);

/* ------------------------------------------------------------------------ */
/* Launch report and tuning (appended in 0.2)                               */
/* ------------------------------------------------------------------------ */

/* How the GPU prefill of a call was cut into launches. The V rows of each
 * (sequence, head) state are shared by `vsplit` blocks; the chunk slots
 * (16-token chunks, plus one per sequence) are processed in `windows`
 * windows of `slots_per_window` slots (the last may hold fewer), each one
 * preparation and one recurrence launch, the state crossing a window
 * boundary in f32. Neither changes a bit of the result. With
 * `chunk_parallel` 1 the sequences' chunks ran in segments of
 * `segment_chunks` chunks (a transition launch, a scan and a segment launch
 * per window): the states reach each segment by another order of f32
 * operations, so the bits differ from the serial path's, within the same
 * accuracy, and are the same from run to run.
 *
 * The plan's tuning fields (fkda_plan_desc.vsplit, chunk_parallel,
 * window_slots, segment_chunks; 0 is automatic) override the automatic
 * choice. For a field left at 0, fkda_plan_create reads an environment
 * variable once (unset or empty: automatic); later changes of the
 * environment do not affect existing plans, and no other call reads it.
 * fkda_plan_workspace_size sizes the workspace for the plan's tuning and
 * fkda_fwd checks the launch it computes against workspace_bytes
 * (FKDA_ERROR_WORKSPACE_TOO_SMALL naming workspace_bytes). A value not
 * listed is rejected by fkda_plan_create with FKDA_ERROR_INVALID_ARGUMENT
 * naming the field or the variable:
 *   FKDA_VSPLIT           vsplit: 1, 2, 4 or 8 (raised to the smallest split
 *                         whose shared memory the device allows)
 *   FKDA_WINDOW_SLOTS     window_slots: a positive integer (the workspace size
 *                         follows it)
 *   FKDA_CHUNK_PARALLEL   chunk_parallel: "auto", "off" or "on"
 *   FKDA_SEGMENT_CHUNKS   segment_chunks: a positive integer */
typedef struct fkda_launch_report {
  size_t struct_size;       /* sizeof(fkda_launch_report), set by the caller */
  int64_t vsplit;           /* 1, 2, 4 or 8 */
  int64_t windows;          /* launch pairs, >= 1 */
  int64_t slots_per_window;
  /* Appended in 0.4: */
  int64_t chunk_parallel;   /* 1 when the chunk-parallel path ran, else 0 */
  int64_t segment_chunks;   /* its chunks per segment (0 when it did not run) */
} fkda_launch_report;

#define FKDA_LAUNCH_REPORT_INIT { sizeof(fkda_launch_report), 0, 0, 0, 0, 0 }

/* How the plan's last successful GPU fkda_fwd with at least one sequence
 * was launched (known once fkda_fwd returns, before the kernels finish).
 * Every field but struct_size is 0 before such a call and on CPU plans.
 * With calls on one plan from several threads, it describes one of them. */
FKDA_API fkda_status fkda_plan_get_launch_report(fkda_plan_t plan,
                                                 fkda_launch_report* report);

/* ------------------------------------------------------------------------ */
/* Build (appended in 0.2)                                                  */
/* ------------------------------------------------------------------------ */

/* What the embedded kernels need from the machine. Versions are encoded as
 * cuDriverGetVersion encodes them (12.9 is 12090). */
typedef struct fkda_build_info {
  size_t struct_size;         /* sizeof(fkda_build_info), set by the caller */
  int32_t cuda_version;       /* CUDA toolkit the kernels were compiled with */
  int32_t min_driver_version; /* oldest driver that loads them: the toolkit's
                                 CUDA major.0; PTX (compute_*) images JIT only
                                 on drivers as new as cuda_version */
  char architectures[64];     /* images in the fatbin: "sm_80 sm_90a compute_90" */
} fkda_build_info;

#define FKDA_BUILD_INFO_INIT { sizeof(fkda_build_info), 0, 0, { 0 } }

/* Fills `info`; touches no driver. */
FKDA_API fkda_status fkda_get_build_info(fkda_build_info* info);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHKDA_H */
