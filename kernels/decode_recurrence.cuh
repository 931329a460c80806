// SPDX-License-Identifier: MIT
// The decode kernel: the token-by-token recurrence for 1 to 16 tokens per
// sequence, on states kept in a pool and updated in place.
//
// Per (sequence n, head h), with S the pool's V x K matrix in f32:
//   for each token t:
//     k^ = k / sqrt(|k|^2 + 1e-6),  q^ likewise (IEEE sqrt and division)
//     decay[c] = exp(a[c]), a the plan's gate (bounded: gate_scale * sigmoid(
//       exp(A_log[h]) * (g[c] + dt_bias[h][c])) in base 2; or softplus, log-decay)
//     b = sigmoid(beta), or beta as a probability
//     for each V row e:  s_e *= decay;  u = b (v[e] - s_e . k^);  s_e += u k^
//                        out[e] = bf16(s_e . (scale q^))
//     table: S rounded to the pool dtype -> slot of column t (unless null)
//   [N] indices: S rounded to the pool dtype -> the slot it came from
//
// The rows of S evolve independently, so block (n * vsplit + z, h) takes
// `rows` = 16 x warps of them, starting at z x rows. Within a warp, each
// group of 8 lanes owns four adjacent rows and splits the 128 K columns into
// 16 a lane, taken as four runs of 4 ("quads") placed so that every global
// access of a group is one contiguous 128-byte segment of a row: dot products
// over K are 16 fused multiply-adds and three shuffles. Each state element is
// read once and written once per call ([N] indices) or once per token
// (table).
//
// The state is staged (below): the block's copies of its rows into shared
// memory are issued first, and while they are in flight the block's warps
// prepare every token's normalised key and query, decay and beta (one warp
// per token, each lane 4 channels) into shared memory, with the block's rows
// of v. Then each row takes every token in registers and is stored.
//
// Every exp, division and square root is the accurate one, not the hardware
// approximation of the prefill's gate: an f32 pool is compared with the fp64
// recurrence at 1e-6 after several chained calls, and the error of a decay
// factor enters the state in full (docs/NUMERICS.md, decode).
//
// Untrusted device values: offsets are clamped into [0, T]; a sequence longer
// than max_tokens, a count of accepted tokens outside [1, W], or a starting
// slot that is null or outside the pool makes the sequence padding (its
// output rows zero, no state touched); a null or out-of-range write slot of a
// table is skipped. A zero-length sequence touches nothing.
#pragma once

#include "decode_params.h"
#include "device_common.cuh"
#include "layer_step.cuh"

namespace fkda_dev {

constexpr int kDecodeColumnsPerLane = 16;
// Rows per group of 8 lanes: four, so that the per-block preparation of the
// tokens serves 16 rows a warp.
constexpr int kDecodeRowsPerGroup = FKDA_DECODE_ROWS_PER_WARP / 4;

// First K column of quad m (0..3) of lane l (0..7) of a group. An f32 row
// is read as four 16-byte pieces, quad m at piece 8 m + l; a bf16 row as two,
// piece j = m / 2 holding quads 2 j and 2 j + 1.
template <bool kBf16>
__device__ __forceinline__ int quad_column(int m, int l) {
  return kBf16 ? ((m >> 1) * 8 + l) * 8 + (m & 1) * 4 : (m * 8 + l) * 4;
}

// A 16-byte piece of state: from the pool with streaming cache hints (each
// element is used once per call), or from a copy in shared memory (the
// streamed kernel's stages).
template <bool kShared, typename Piece>
__device__ __forceinline__ Piece load_state_piece(const Piece* at) {
  if constexpr (kShared) {
    return *at;
  } else {
    return __ldcs(at);
  }
}
template <bool kShared, typename Piece>
__device__ __forceinline__ void store_state_piece(Piece* at, Piece piece) {
  if constexpr (kShared) {
    *at = piece;
  } else {
    __stcs(at, piece);
  }
}

// The plain kernels' loads: a group's kDecodeRowsPerGroup rows e, e + 1,
// ... of one V x K (or K x V) matrix, into registers: s[r][4 m + i] is row
// e + r, column quad_column(m, l) + i. Every load is issued before any value
// is used (all unrolled, no dependence between them), so a lane has all of
// its rows' bytes in flight at once. kShared: a V x K matrix in shared memory.
template <bool kBf16, bool kKV, bool kShared = false>
__device__ __forceinline__ void load_state_rows(const void* matrix, int e, int l,
                                                float (&s)[kDecodeRowsPerGroup][kDecodeColumnsPerLane]) {
  static_assert(!(kKV && kShared), "K x V matrices are read from the pool");
  if (!kKV) {
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerGroup; ++r) {
      if (kBf16) {
        const uint16_t* row = static_cast<const uint16_t*>(matrix) + (e + r) * FKDA_HEAD_DIM;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint4 w = load_state_piece<kShared>(reinterpret_cast<const uint4*>(row + quad_column<true>(2 * j, l)));
          const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            s[r][8 * j + 2 * i] = bf16_lo(words[i]);
            s[r][8 * j + 2 * i + 1] = bf16_hi(words[i]);
          }
        }
      } else {
        const float* row = static_cast<const float*>(matrix) + (e + r) * FKDA_HEAD_DIM;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const float4 f = load_state_piece<kShared>(reinterpret_cast<const float4*>(row + quad_column<false>(m, l)));
          s[r][4 * m] = f.x;
          s[r][4 * m + 1] = f.y;
          s[r][4 * m + 2] = f.z;
          s[r][4 * m + 3] = f.w;
        }
      }
    }
  } else {
    // K x V: the group's four rows are adjacent in each column's line, so one
    // access per column takes all four (16 bytes f32, 8 bytes bf16; e is a
    // multiple of 4 and the pool is 16-byte aligned, so both are aligned).
    static_assert(kDecodeRowsPerGroup == 4, "the K x V accesses take four rows");
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int at = (quad_column<kBf16>(m, l) + i) * FKDA_HEAD_DIM + e;
        if (kBf16) {
          const uint2 w = __ldcs(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(matrix) + at));
          s[0][4 * m + i] = bf16_lo(w.x);
          s[1][4 * m + i] = bf16_hi(w.x);
          s[2][4 * m + i] = bf16_lo(w.y);
          s[3][4 * m + i] = bf16_hi(w.y);
        } else {
          const float4 f = __ldcs(reinterpret_cast<const float4*>(static_cast<const float*>(matrix) + at));
          s[0][4 * m + i] = f.x;
          s[1][4 * m + i] = f.y;
          s[2][4 * m + i] = f.z;
          s[3][4 * m + i] = f.w;
        }
      }
    }
  }
}

// ---- Staging of the state (the layer kernels) ----
// A thread's state bytes reach shared memory through asynchronous copies
// (cp.async), issued as soon as the slot is known: in flight they hold no
// register, and a thread then works on one of its rows at a time, so a
// multiprocessor holds more blocks than it would with all four rows in
// registers, each with all of its state bytes in flight. Piece j of a thread
// lies at (j x kDecodeLayerThreads + thread) x piece bytes, so a warp's accesses to one
// piece are contiguous and free of bank conflicts.
template <bool kBf16, bool kKV>
struct StatePieces {
  static constexpr int kCount = kBf16 && !kKV ? 8 : 16;
  static constexpr int kBytes = kBf16 && kKV ? 8 : 16;
  static_assert(kCount * kBytes == (kBf16 ? 128 : 256),
                "a thread's pieces fill its share of fkda_decode_staged_state_bytes");
};

// The layer kernels stage their state where they run in clusters (sm_90 and
// later): there a block has 4 warps, and its 32 KB of staged f32 state fit
// beside the 16-token arrays in every such device's shared memory. sm_80's
// form, a block of 8 warps per head, would need 64 KB more than the 99 KB
// that sm_86 and sm_89 devices allow a block, so it keeps its rows in
// registers, four at once, like the plain kernels.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
constexpr bool kDecodeLayerStaged = false;
#else
constexpr bool kDecodeLayerStaged = true;
#endif
// The layer kernels' blocks as gpu_decode.cpp launches them: clusters of a
// head's FKDA_DECODE_LAYER_HEAD_BLOCKS blocks of FKDA_DECODE_MAX_WARPS warps
// where they stage their state, else one block of FKDA_DECODE_LAYER_WARPS
// warps a head. Constants, so that a block's rows, its cluster and the
// convolution's items cost no arithmetic on a one-sequence call's chain.
constexpr int kDecodeLayerWarps = kDecodeLayerStaged ? FKDA_DECODE_MAX_WARPS : FKDA_DECODE_LAYER_WARPS;
constexpr int kDecodeLayerThreads = 32 * kDecodeLayerWarps;
constexpr int kDecodeLayerRows = kDecodeLayerWarps * FKDA_DECODE_ROWS_PER_WARP;
constexpr int kDecodeLayerBlocks = FKDA_HEAD_DIM / kDecodeLayerRows;
static_assert(kDecodeLayerBlocks <= FKDA_DECODE_LAYER_HEAD_BLOCKS, "a token's sums have a place for every block");

// The pool element (of one V x K or K x V matrix) where piece j of the
// group's rows e .. e + 3 starts. V x K: f32 row e + j / 4, quad j % 4
// (s[j / 4][4 (j % 4) ..]); bf16 row e + j / 2, quads 2 (j % 2) and the next
// (s[j / 2][8 (j % 2) ..]). K x V: column quad_column(j / 4, l) + j % 4 of
// the four rows, which are adjacent (s[0 .. 3][j]); e is a multiple of 4 and
// the pool 16-byte aligned, so every piece is aligned.
template <bool kBf16, bool kKV>
__device__ __forceinline__ int state_piece_element(int j, int e, int l) {
  if (kKV) return (quad_column<kBf16>(j / 4, l) + j % 4) * FKDA_HEAD_DIM + e;
  if (kBf16) return (e + j / 2) * FKDA_HEAD_DIM + quad_column<true>(2 * (j % 2), l);
  return (e + j / 4) * FKDA_HEAD_DIM + quad_column<false>(j % 4, l);
}

__device__ __forceinline__ unsigned char* staged_piece(unsigned char* staged, int j, int bytes) {
  return staged + (j * kDecodeLayerThreads + int(threadIdx.x)) * bytes;
}

// Issues the copies of the thread's pieces of one matrix (bypassing L1:
// each element is used once per call).
template <bool kBf16, bool kKV>
__device__ __forceinline__ void stage_state(const void* matrix, int e, int l, unsigned char* staged) {
  using Pieces = StatePieces<kBf16, kKV>;
  const unsigned char* pool = static_cast<const unsigned char*>(matrix);
#pragma unroll
  for (int j = 0; j < Pieces::kCount; ++j) {
    const unsigned char* from = pool + state_piece_element<kBf16, kKV>(j, e, l) * (kBf16 ? 2 : 4);
    const uint32_t to = static_cast<uint32_t>(__cvta_generic_to_shared(staged_piece(staged, j, Pieces::kBytes)));
    if (Pieces::kBytes == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(from) : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(to), "l"(from) : "memory");
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// The thread's own copies have landed (each thread reads only its pieces).
__device__ __forceinline__ void wait_staged_state() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Row e + r of the group's rows, in the order of quad_column: s[4 m + i] is
// column quad_column(m, l) + i.
template <bool kBf16, bool kKV>
__device__ __forceinline__ void read_staged_row(unsigned char* staged, int r, float (&s)[kDecodeColumnsPerLane]) {
  using Pieces = StatePieces<kBf16, kKV>;
  if (kKV) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const unsigned char* piece = staged_piece(staged, j, Pieces::kBytes);
      s[j] = kBf16 ? bf16_bits(*reinterpret_cast<const uint16_t*>(piece + 2 * r))
                   : *reinterpret_cast<const float*>(piece + 4 * r);
    }
  } else if (kBf16) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 w = *reinterpret_cast<const uint4*>(staged_piece(staged, 2 * r + h, 16));
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        s[8 * h + 2 * i] = bf16_lo(words[i]);
        s[8 * h + 2 * i + 1] = bf16_hi(words[i]);
      }
    }
  } else {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float4 f = *reinterpret_cast<const float4*>(staged_piece(staged, 4 * r + m, 16));
      s[4 * m] = f.x;
      s[4 * m + 1] = f.y;
      s[4 * m + 2] = f.z;
      s[4 * m + 3] = f.w;
    }
  }
}

// Row `row` of a matrix from the lane's 16 values, rounded to bf16 (nearest
// even) for a bf16 pool. V x K: 16-byte stores, a group's 8 lanes writing
// 128 contiguous bytes each. K x V: the row is one element of each column's
// line, so scalar stores; a kernel that takes fewer rows at once takes them
// only for a table's per-token states (its call's final state goes through
// the staged pieces, write_staged_row_kv).
template <bool kBf16, bool kKV, bool kShared = false>
__device__ __forceinline__ void store_state_row(void* matrix, int row, int l, const float (&s)[kDecodeColumnsPerLane]) {
  static_assert(!(kKV && kShared), "K x V matrices are written to the pool");
  if (kKV) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int at = state_piece_element<kBf16, true>(j, row, l);  // element `row` of column j's line
      if (kBf16) {
        __stcs(static_cast<unsigned short*>(matrix) + at, to_bf16(s[j]));
      } else {
        __stcs(static_cast<float*>(matrix) + at, s[j]);
      }
    }
  } else if (kBf16) {
    uint16_t* line = static_cast<uint16_t*>(matrix) + row * FKDA_HEAD_DIM;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint4 w;
      w.x = pack_bf16x2(s[8 * h], s[8 * h + 1]);
      w.y = pack_bf16x2(s[8 * h + 2], s[8 * h + 3]);
      w.z = pack_bf16x2(s[8 * h + 4], s[8 * h + 5]);
      w.w = pack_bf16x2(s[8 * h + 6], s[8 * h + 7]);
      store_state_piece<kShared>(reinterpret_cast<uint4*>(line + quad_column<true>(2 * h, l)), w);
    }
  } else {
    float* line = static_cast<float*>(matrix) + row * FKDA_HEAD_DIM;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      store_state_piece<kShared>(reinterpret_cast<float4*>(line + quad_column<false>(m, l)),
                                 make_float4(s[4 * m], s[4 * m + 1], s[4 * m + 2], s[4 * m + 3]));
    }
  }
}

// kRows of the group's rows from r0 on (s[h] is row e + r0 + h). K x V
// with all four rows: each column's four adjacent elements in one 16- or
// 8-byte store.
template <bool kBf16, bool kKV, int kRows>
__device__ __forceinline__ void store_state_rows(void* matrix, int e, int r0, int l,
                                                 const float (&s)[kRows][kDecodeColumnsPerLane]) {
  if constexpr (kKV && kRows == 4) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int at = state_piece_element<kBf16, true>(j, e, l);
      if (kBf16) {
        __stcs(reinterpret_cast<uint2*>(static_cast<uint16_t*>(matrix) + at),
               make_uint2(pack_bf16x2(s[0][j], s[1][j]), pack_bf16x2(s[2][j], s[3][j])));
      } else {
        __stcs(reinterpret_cast<float4*>(static_cast<float*>(matrix) + at), make_float4(s[0][j], s[1][j], s[2][j], s[3][j]));
      }
    }
  } else {
#pragma unroll
    for (int h = 0; h < kRows; ++h) store_state_row<kBf16, kKV>(matrix, e + r0 + h, l, s[h]);
  }
}

// K x V, the call's final state: row r back into the staged pieces (which
// read_staged_row has consumed), then every piece to the pool in one
// 16- or 8-byte store, as it came.
template <bool kBf16>
__device__ __forceinline__ void write_staged_row_kv(unsigned char* staged, int r, const float (&s)[kDecodeColumnsPerLane]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    unsigned char* piece = staged_piece(staged, j, StatePieces<kBf16, true>::kBytes);
    if (kBf16) {
      *reinterpret_cast<uint16_t*>(piece + 2 * r) = to_bf16(s[j]);
    } else {
      *reinterpret_cast<float*>(piece + 4 * r) = s[j];
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ void store_staged_kv(void* matrix, int e, int l, unsigned char* staged) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int at = state_piece_element<kBf16, true>(j, e, l);
    const unsigned char* piece = staged_piece(staged, j, StatePieces<kBf16, true>::kBytes);
    if (kBf16) {
      __stcs(reinterpret_cast<uint2*>(static_cast<uint16_t*>(matrix) + at), *reinterpret_cast<const uint2*>(piece));
    } else {
      __stcs(reinterpret_cast<float4*>(static_cast<float*>(matrix) + at), *reinterpret_cast<const float4*>(piece));
    }
  }
}

// The lane's 16 values of a prepared 128-wide row in shared memory, in the
// order of its state registers.
template <bool kBf16>
__device__ __forceinline__ void load_lane_columns(const float* row, int l, float (&x)[kDecodeColumnsPerLane]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const float4 f = *reinterpret_cast<const float4*>(row + quad_column<kBf16>(m, l));
    x[4 * m] = f.x;
    x[4 * m + 1] = f.y;
    x[4 * m + 2] = f.z;
    x[4 * m + 3] = f.w;
  }
}

// A dot product's partial sums: one, two, or four added pairwise.
template <int n>
__device__ __forceinline__ float sum_of(const float (&x)[n]) {
  static_assert(n == 1 || n == 2 || n == 4, "one, two or four partial sums");
  if constexpr (n == 1) {
    return x[0];
  } else if constexpr (n == 2) {
    return x[0] + x[1];
  } else {
    return (x[0] + x[1]) + (x[2] + x[3]);
  }
}

// The sum over the 8 lanes of a group, in every lane of it.
__device__ __forceinline__ float group_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}

// Four consecutive bf16 values (8 bytes) of an activation row, as loaded
// and widened.
__device__ __forceinline__ uint2 load_bf16x4_bits(const uint16_t* at) { return __ldg(reinterpret_cast<const uint2*>(at)); }
__device__ __forceinline__ float4 bf16x4_of_bits(uint2 w) {
  return make_float4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
}
__device__ __forceinline__ float4 load_bf16x4(const uint16_t* at) { return bf16x4_of_bits(load_bf16x4_bits(at)); }

// The head's A_log as loaded and the lane's four dt_bias values (zeros
// without them), for the decay of channels 4 lane .. 4 lane + 3.
struct DecodeHeadGate {
  float a_log;
  float dt[4];
};
__device__ __forceinline__ DecodeHeadGate load_decode_head_gate(const FkdaRecurrenceCall& call, int head, int lane) {
  DecodeHeadGate gate{load_a_log(call.A_log, head), {0.f, 0.f, 0.f, 0.f}};
  if (call.dt_bias != nullptr) {
    const float* dt_bias = call.dt_bias + int64_t(head) * FKDA_HEAD_DIM + 4 * lane;
    for (int i = 0; i < 4; ++i) gate.dt[i] = __ldg(dt_bias + i);
  }
  return gate;
}

// A token's decay factors at the lane's four channels, into its row of the
// prepared decays.
__device__ __forceinline__ void store_decay_row(const FkdaRecurrenceCall& call, float4 g, float rate,
                                                const DecodeHeadGate& head_gate, float* decay_row, int lane) {
  const float gv[4] = {g.x, g.y, g.z, g.w};
  float d[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] = decay_accurate(call.gate, call.gate_scale, gv[i], rate, head_gate.dt[i]);
  reinterpret_cast<float4*>(decay_row)[lane] = make_float4(d[0], d[1], d[2], d[3]);
}

// The layer step's convolution in the clustered decode kernels. A block
// convolves, for each token, its share of q's and k's channels (which it
// pushes to every block of the head) and the v channels of its own rows: both
// are channels block_row .. block_row + rows - 1 of the head, so item `item`
// is token t's channel block_row + (item mod rows) of projection proj, with
// (t, proj) = divmod(item / rows, 3). rows is a power of two (16 x warps).
struct DecodeConvItem {
  int t, proj, i;
};
__device__ __forceinline__ DecodeConvItem decode_conv_item(int item, int rows_log2, int block_row) {
  const int unit = item >> rows_log2;
  return {unit / 3, unit % 3, block_row + (item & ((1 << rows_log2) - 1))};
}

// One item's inputs, loaded in two halves: what does not depend on the pool
// slot (weights, bias, the call's raw inputs), then the conv state. They
// stay the bits the loads returned until every load of the thread's first
// items is in flight: one sequence's decode is a chain of dependent steps,
// and a widening next to its load, inside the branch that chose the load,
// made each load wait for the one before.
struct DecodeConvChannel {
  ConvWeightBits weights;
  uint32_t x_back[FKDA_CONV_MAX_WIDTH];  // the input b tokens back (0: the item's token)
  uint32_t x_is_f32;                     // bit b: x_back[b] came from an f32 conv state
};
// Each input's offset steps from the one before, as the weights' do
// (load_conv_weight_bits).
__device__ __forceinline__ DecodeConvChannel start_conv_channel(const FkdaDecodeParams& p, const DecodeConvItem& it,
                                                                int64_t batch_row, int64_t begin, int head) {
  const FkdaActivation& raw = it.proj == 0 ? p.call.q : (it.proj == 1 ? p.call.k : p.call.v);
  const int width = p.layer.conv_width;
  DecodeConvChannel ch;
  ch.x_is_f32 = 0;
  int64_t x_at = batch_row * raw.stride_b + int64_t(head) * raw.stride_h + (begin + it.t) * raw.stride_t + it.i;
#pragma unroll
  for (int b = 0; b < FKDA_CONV_MAX_WIDTH; ++b) {
    ch.x_back[b] = b < width && it.t >= b ? uint32_t(__ldg(static_cast<const uint16_t*>(raw.data) + x_at)) : 0u;
    x_at -= raw.stride_t;
  }
  ch.weights = load_conv_weight_bits(p.layer, p.layer.conv[it.proj], int64_t(head) * FKDA_HEAD_DIM + it.i);
  return ch;
}

// The inputs before the sequence's first token, from the slot's conv state
// (zeros without one). Plain loads: a one-token sequence rewrites the row
// in this kernel (keep_and_convolve).
__device__ __forceinline__ void load_conv_window(const FkdaDecodeParams& p, const DecodeConvItem& it, int head,
                                                 int64_t slot, DecodeConvChannel& ch) {
  const FkdaConv& conv = p.layer.conv[it.proj];
  if (conv.state == nullptr) return;
  const bool f32 = p.layer.conv_state_is_f32 != 0;
  const int bytes_log2 = f32 ? 2 : 1;
  // Column Wc + t - b of the channel's row (bytes), from b = 0 on.
  int64_t at = (slot * conv.state_stride_row + (int64_t(head) * FKDA_HEAD_DIM + it.i) * conv.state_stride_c +
                (p.layer.conv_state_width + it.t) * conv.state_stride_w) << bytes_log2;
  const int64_t step = conv.state_stride_w << bytes_log2;
  const unsigned char* state = static_cast<const unsigned char*>(conv.state);
#pragma unroll
  for (int b = 0; b < FKDA_CONV_MAX_WIDTH; ++b) {
    if (b < p.layer.conv_width && it.t < b) {
      ch.x_back[b] = f32 ? *reinterpret_cast<const uint32_t*>(state + at) : uint32_t(*reinterpret_cast<const uint16_t*>(state + at));
      if (f32) ch.x_is_f32 |= 1u << b;
    }
    at -= step;
  }
}

// The convolved value. A sequence of one token: the thread that read the
// channel's old conv state is its only reader (each block owns its
// channels, see store_decode_conv_states), so it writes the new one now,
// the last Wc inputs oldest first, instead of reading them again after the
// steps. Every conv state read of the thread's items comes before this.
__device__ __forceinline__ float keep_and_convolve(const FkdaDecodeParams& p, const DecodeConvItem& it, int tokens,
                                                   int head, int64_t slot, const DecodeConvChannel& ch) {
  const FkdaConv& conv = p.layer.conv[it.proj];
  const ConvWeights w = conv_weights(p.layer, ch.weights);
  float x_back[FKDA_CONV_MAX_WIDTH];
#pragma unroll
  for (int b = 0; b < FKDA_CONV_MAX_WIDTH; ++b) x_back[b] = real_of_bits(ch.x_back[b], (ch.x_is_f32 >> b) & 1u);
  if (tokens == 1 && conv.state != nullptr) {
    const int64_t c = int64_t(head) * FKDA_HEAD_DIM + it.i;
#pragma unroll
    for (int b = 0; b < FKDA_CONV_MAX_WIDTH; ++b) {
      const int col = p.layer.conv_state_width - 1 - b;
      if (col >= 0) store_conv_state(p.layer, conv, slot, c, col, x_back[b]);
    }
  }
  return convolve_back<false>(p.layer.conv_width, w.bias, w.back, x_back);
}

// ---- What the blocks of a head send each other ----
// The blocks that share a head's rows (decode_params.h, "The layer step's
// decode"): a cluster of vsplit blocks on sm_90 and later; the block alone
// (vsplit 1) on sm_80, whose layer kernels take all 128 rows. Each block
// pushes what the others need (the convolved q and k of its channels, each
// token's sum of squares over its rows) into every block's shared memory
// with st.async, whose bytes count down the receiver's mbarrier: a block
// then waits for the bytes it expects and never for the others to reach a
// point, and no block reads another's shared memory, so none has to stay
// for the others. (A release/acquire cluster barrier compiles to a
// GPU-wide memory barrier, which also waited for the block's conv state
// stores.) On sm_80 a push is a local store and the wait a block barrier.
//
// Two barriers a block, each used for one phase: kHeadConvolved, the
// convolved q and k of every token (2 x 128 x tokens floats); kHeadSums,
// the sums of squares (vsplit x tokens floats).
enum HeadExchange { kHeadConvolved = 0, kHeadSums = 1 };

// Before any push: thread 0 arms both barriers with the bytes this block
// will receive, and the cluster's barrier makes them armed for every sender
// (head_exchange_open). Its arrival is relaxed: nothing but the barriers'
// initialisation needs ordering, which the mbarrier fence gives.
__device__ __forceinline__ void head_exchange_arm(uint64_t* barriers, int vsplit, uint32_t convolved_bytes,
                                                  uint32_t sums_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (vsplit > 1) {
    if (threadIdx.x == 0) {
      const uint32_t bytes[2] = {convolved_bytes, sums_bytes};
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(barriers + b));
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(at) : "memory");
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(at), "r"(bytes[b]) : "memory");
      }
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  }
#else
  (void)barriers, (void)vsplit, (void)convolved_bytes, (void)sums_bytes;
#endif
}

// Every block of the head has armed its barriers.
__device__ __forceinline__ void head_exchange_open(int vsplit) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (vsplit > 1) asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
  (void)vsplit;
#endif
}

// A shared array of this block and, on sm_90 and later, its address in
// every block of the head (the cluster's shared window), taken once: the
// pushes of a one-sequence call are on its chain of dependent steps.
struct HeadBlockArray {
  unsigned char* local;
  uint32_t in_block[kDecodeLayerBlocks];
};
__device__ __forceinline__ HeadBlockArray head_block_array(void* local) {
  HeadBlockArray array;
  array.local = static_cast<unsigned char*>(local);
#pragma unroll
  for (int rank = 0; rank < kDecodeLayerBlocks; ++rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mapa.shared::cluster.u32 %0, %1, %2;"
        : "=r"(array.in_block[rank])
        : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(local))), "r"(rank));
#else
    array.in_block[rank] = 0;
#endif
  }
  return array;
}

// x into float `index` of `values` in block `rank`, counted on that
// block's barrier `phase` of `barriers`. On sm_90 the head's blocks are a
// cluster of at least two (gpu_decode.cpp): st.async is not defined in a
// cluster of one.
__device__ __forceinline__ void push_to_head_block(const HeadBlockArray& values, int index, float x,
                                                   const HeadBlockArray& barriers, HeadExchange phase, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];" ::"r"(
                   values.in_block[rank] + 4 * index),
               "r"(__float_as_uint(x)), "r"(barriers.in_block[rank] + 8 * int(phase))
               : "memory");
#else
  (void)barriers, (void)phase, (void)rank;
  reinterpret_cast<float*>(values.local)[index] = x;
#endif
}

// Every byte this block expects on barrier `phase` has landed (on sm_80:
// every thread's local stores).
__device__ __forceinline__ void wait_for_head_blocks(uint64_t* barriers, HeadExchange phase, int vsplit) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (vsplit > 1) {
    const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(barriers + phase));
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n\t.reg .pred landed;\n\t"
          "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 landed, [%1], 0;\n\t"
          "selp.u32 %0, 1, 0, landed;\n\t}"
          : "=r"(done)
          : "r"(at)
          : "memory");
    }
    return;
  }
#else
  (void)barriers, (void)phase, (void)vsplit;
#endif
  __syncthreads();
}

// After the steps: each channel keeps its last Wc raw inputs, a thread per
// channel. Block `rank` of the head's kDecodeLayerBlocks owns (alone reads
// and writes) its share of q's and k's channels and the v channels of its
// own rows, so the block barrier after the preparation (before the steps)
// orders its convolution's reads before these writes.
__device__ __forceinline__ void store_decode_conv_states(const FkdaDecodeParams& p, int64_t batch_row, int64_t begin,
                                                         int tokens, int head, int64_t slot, int block_row) {
  const int state_width = p.layer.conv_state_width;
  constexpr int share = FKDA_HEAD_DIM / kDecodeLayerBlocks, rows = kDecodeLayerRows;
  const int rank = block_row / rows;
  for (int index = threadIdx.x; index < 2 * share + rows; index += kDecodeLayerThreads) {
    const int proj = index < 2 * share ? index / share : 2;
    const int i = proj < 2 ? rank * share + index % share : block_row + index - 2 * share;
    const FkdaConv& conv = p.layer.conv[proj];
    const FkdaActivation& raw = proj == 0 ? p.call.q : (proj == 1 ? p.call.k : p.call.v);
    const int64_t c = int64_t(head) * FKDA_HEAD_DIM + i;
    float kept[FKDA_CONV_MAX_WIDTH];
#pragma unroll
    for (int col = 0; col < FKDA_CONV_MAX_WIDTH; ++col) {
      const int at = tokens - state_width + col;
      if (col >= state_width) continue;
      kept[col] = at >= 0 ? raw_input(raw, batch_row, begin + at, head, i)
                          : conv_state_at(p.layer, conv, slot, c, state_width + at);
    }
#pragma unroll
    for (int col = 0; col < FKDA_CONV_MAX_WIDTH; ++col) {
      if (col < state_width) store_conv_state(p.layer, conv, slot, c, col, kept[col]);
    }
  }
}

// The output gate's input g_out of token t, value col of the head (bf16 bits).
__device__ __forceinline__ uint16_t out_gate_bits(const FkdaDecodeParams& p, int64_t batch_row, int64_t begin, int t,
                                                  int head, int col) {
  const FkdaActivation& g_out = p.layer.out_gate;
  return __ldg(static_cast<const uint16_t*>(g_out.data) + batch_row * g_out.stride_b + (begin + t) * g_out.stride_t +
               int64_t(head) * g_out.stride_h + col);
}

// The norm weight of value v of a head as its bits (widened where used).
__device__ __forceinline__ uint32_t norm_weight_bits(const FkdaLayerStep& layer, int v) {
  return load_real_bits(layer.norm_weight, layer.norm_weight_is_f32 != 0, int64_t(v) * layer.norm_weight_stride);
}

// The layer step's end, after the recurrence's steps: the output gate over
// all 128 values of each token (`gated`, the block's rows at their local
// place; `sums`, [FKDA_DECODE_MAX_TOKENS][FKDA_DECODE_LAYER_HEAD_BLOCKS],
// each token's sums of squares over the rows of each of the head's blocks,
// which they push to each other) and the conv states. `out` points at the
// block's first row; first_gate_bits and first_weight_bits are g_out and
// the norm weight of the thread's first item, loaded at the start.
__device__ __forceinline__ void finish_decode_layer(const FkdaDecodeParams& p, float* gated, float* sums_here,
                                                    uint64_t* barriers_here, uint16_t* out, int64_t batch_row,
                                                    int64_t begin, int tokens, int head, int64_t slot, int block_row,
                                                    uint16_t first_gate_bits, uint32_t first_weight_bits) {
  constexpr int rows = kDecodeLayerRows, vsplit = kDecodeLayerBlocks;
  const int rank = block_row / rows;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool gate = p.layer.out_gate.data != nullptr;
  if (gate) {
    __syncthreads();  // every warp's rows of `gated`
    const HeadBlockArray sums = head_block_array(sums_here), barriers = head_block_array(barriers_here);
    for (int t = warp; t < tokens; t += kDecodeLayerWarps) {
      float x = 0.f;
      for (int r = lane; r < rows; r += 32) x = fmaf(gated[t * FKDA_HEAD_DIM + r], gated[t * FKDA_HEAD_DIM + r], x);
      x = warp_sum(x);
#pragma unroll
      for (int to = 0; to < vsplit; ++to) {
        if (lane == to) push_to_head_block(sums, t * FKDA_DECODE_LAYER_HEAD_BLOCKS + rank, x, barriers, kHeadSums, to);
      }
    }
  }
  // While the sums travel. (A one-token sequence wrote its conv states in keep_and_convolve.)
  if (p.layer.conv_width > 0 && p.layer.conv[0].state != nullptr && tokens > 1) {
    store_decode_conv_states(p, batch_row, begin, tokens, head, slot, block_row);
  }
  if (gate) {
    wait_for_head_blocks(barriers_here, kHeadSums, vsplit);
    for (int item = threadIdx.x; item < tokens * rows; item += kDecodeLayerThreads) {
      const int t = item / rows, local = item % rows;
      const bool first = item == int(threadIdx.x);
      const float g = bf16_bits(first ? first_gate_bits : out_gate_bits(p, batch_row, begin, t, head, block_row + local));
      const float w = first ? real_of_bits(first_weight_bits, p.layer.norm_weight_is_f32 != 0)
                            : norm_weight(p.layer, block_row + local);
      float sum_squares = 0.f;  // in rank order, so every block of the head gets the same sum
#pragma unroll
      for (int r = 0; r < vsplit; ++r) sum_squares += sums_here[t * FKDA_DECODE_LAYER_HEAD_BLOCKS + r];
      const float o = gated[t * FKDA_HEAD_DIM + local];
      out[t * p.call.out.stride_t + local] = to_bf16(gate_one(inverse_rms(p.layer, sum_squares), w, g, o));
    }
  }
}

// One token's step of kRows of a group's rows (s[h]; the lane's 16
// columns), from the token's prepared key, decay and query rows, its beta
// and the rows' values (values[h]): the decay, the delta rule's update and
// the outputs (o[h], in every lane of the group). With fewer rows at once,
// more partial sums shorten each dot product's chain. The streamed kernel's
// step; decode_steps spells the same arithmetic out in its loop, where
// this function, inlined, made the compiler schedule the layer kernels'
// address arithmetic differently (W1 on the H200: 0.504 ms, against 0.469).
// kScaled: the key and query rows are not yet normalised, and key_scale and
// query_scale multiply them as they are loaded (the streamed layer form).
template <bool kBf16, int kRows, bool kScaled = false>
__device__ __forceinline__ void step_token_rows(float (&s)[kRows][kDecodeColumnsPerLane], const float* key_row,
                                                const float* decay_row, const float* query_row, float b,
                                                const float* values, int l, float (&o)[kRows],
                                                float key_scale = 1.f, float query_scale = 1.f) {
  constexpr int kPartials = kDecodeRowsPerGroup / kRows;
  float kk[kDecodeColumnsPerLane], dd[kDecodeColumnsPerLane], qq[kDecodeColumnsPerLane];
  load_lane_columns<kBf16>(key_row, l, kk);
  load_lane_columns<kBf16>(decay_row, l, dd);
  load_lane_columns<kBf16>(query_row, l, qq);
  if (kScaled) {
#pragma unroll
    for (int c = 0; c < kDecodeColumnsPerLane; ++c) {
      kk[c] *= key_scale;
      qq[c] *= query_scale;
    }
  }
#pragma unroll
  for (int h = 0; h < kRows; ++h) {
    float x[kPartials] = {}, y[kPartials] = {};
#pragma unroll
    for (int c = 0; c < kDecodeColumnsPerLane; ++c) {
      s[h][c] *= dd[c];
      x[c % kPartials] = fmaf(s[h][c], kk[c], x[c % kPartials]);
    }
    const float u = b * (values[h] - group_sum(sum_of(x)));
#pragma unroll
    for (int c = 0; c < kDecodeColumnsPerLane; ++c) {
      s[h][c] = fmaf(u, kk[c], s[h][c]);
      y[c % kPartials] = fmaf(s[h][c], qq[c], y[c % kPartials]);
    }
    o[h] = group_sum(sum_of(y));
  }
}

template <bool kBf16, bool kKV, bool kLayer>
__device__ __forceinline__ void decode_steps(const FkdaDecodeParams& p) {
  extern __shared__ __align__(16) unsigned char decode_smem[];
  // sm_80's layer kernels read their block's warps from p.warps, which the
  // host sets to kDecodeLayerWarps for them: as the constant, ptxas spilled
  // 32 bytes of those kernels.
  const int warps = kLayer && kDecodeLayerStaged ? kDecodeLayerWarps : p.warps;
  const int threads = kLayer && kDecodeLayerStaged ? kDecodeLayerThreads : int(blockDim.x);
  const int rows = warps * FKDA_DECODE_ROWS_PER_WARP;  // of this block
  const int vsplit = FKDA_HEAD_DIM / rows;
  const int64_t n = blockIdx.x / vsplit;
  const int block_row = int(blockIdx.x % vsplit) * rows;
  const int head = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, l = lane & 7;
  // The first of the group's rows, within the block.
  const int local_row = warp * FKDA_DECODE_ROWS_PER_WARP + (lane >> 3) * kDecodeRowsPerGroup;
  const int e = block_row + local_row;

  int64_t batch_row = n, begin = 0, end = p.call.seq_len;
  if (p.call.cu_seqlens != nullptr) {
    batch_row = 0;
    begin = load_offset_of(p.call, n);
    end = load_offset_of(p.call, n + 1);
    if (end < begin) end = begin;
  }
  const int64_t length = end - begin;
  if (length == 0) return;

  // The slot the state starts from; -1 makes the sequence padding.
  int64_t start_slot = -1;
  if (length <= p.max_tokens) {
    int64_t column = 0;
    if (p.num_accepted.data != nullptr) {
      const int64_t accepted = load_index(p.num_accepted, n, 0);
      column = accepted >= 1 && accepted <= p.state_indices.cols ? accepted - 1 : -1;
    }
    if (column >= 0) {
      start_slot = usable_slot(load_index(p.state_indices, n, column), p.call.first_real_slot, p.pool_slots);
    }
  }

  auto token_offset = [&](const FkdaActivation& a, int t) {
    return batch_row * a.stride_b + int64_t(head) * a.stride_h + (begin + t) * a.stride_t;
  };
  auto token_row = [&](const FkdaActivation& a, int t) {
    return static_cast<const uint16_t*>(a.data) + token_offset(a, t);
  };
  // g of token t at the lane's four channels as loaded (four f32 words, or
  // two words of bf16 pairs), and as floats.
  auto load_g_bits = [&](int t) {
    if (p.call.gate.g_is_f32) {
      return __ldg(reinterpret_cast<const uint4*>(static_cast<const float*>(p.call.g.data) + token_offset(p.call.g, t)) + lane);
    }
    const uint2 w = load_bf16x4_bits(token_row(p.call.g, t) + 4 * lane);
    return make_uint4(w.x, w.y, 0u, 0u);
  };
  auto g_of_bits = [&](uint4 w) {
    return p.call.gate.g_is_f32 ? make_float4(__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z), __uint_as_float(w.w))
                                : bf16x4_of_bits(make_uint2(w.x, w.y));
  };
  auto load_beta_of = [&](int t) { return load_beta(p.call.gate, p.call.beta.data, token_offset(p.call.beta, t)); };

  // The layer step's loads that need the sequence but not its slot, issued
  // while the slot's index is in flight: one sequence's decode is a chain
  // of dependent loads, and these would otherwise start only once the slot
  // is known. They are the convolution's weights, bias and raw inputs of
  // the thread's first items (decode_conv_item; every item of a one-token
  // sequence, 3 x rows of them over 2 x rows threads; one at a time on
  // sm_80, whose layer kernels hold their state rows in registers and
  // spilled with two), the warp's first token's g and beta, and the output
  // gate's first g_out and norm weight (finish_decode_layer). Each stays the
  // bits its load returned until a later phase widens it: a widening in the
  // branch that issued the load made the thread wait there for the load. A
  // padding sequence issues them for nothing.
  const bool convolved = kLayer && p.layer.conv_width > 0;
  const int rows_log2 = 31 - __clz(rows);
  const int known_tokens = kLayer && length <= p.max_tokens ? int(length) : 0;
  const int items = convolved ? known_tokens * 3 * rows : 0;
  constexpr int kItemsAtOnce = kDecodeLayerStaged ? 2 : 1;
  DecodeConvChannel first[kItemsAtOnce];
  uint4 first_g_bits = make_uint4(0u, 0u, 0u, 0u);
  uint32_t first_beta_bits = 0, first_weight_bits = 0;
  uint16_t first_gate_bits = 0;
  DecodeHeadGate layer_head_gate{};
  if constexpr (kLayer) {
    layer_head_gate = load_decode_head_gate(p.call, head, lane);
#pragma unroll
    for (int j = 0; j < kItemsAtOnce; ++j) {
      const int item = tid + j * threads;
      if (item < items) first[j] = start_conv_channel(p, decode_conv_item(item, rows_log2, block_row), batch_row, begin, head);
    }
    if (warp < known_tokens) {
      first_g_bits = load_g_bits(warp);
      if (lane == 0) first_beta_bits = load_real_bits(p.call.beta.data, p.call.gate.beta_is_f32 != 0, token_offset(p.call.beta, warp));
    }
    if (p.layer.out_gate.data != nullptr && tid < known_tokens * rows) {
      first_gate_bits = out_gate_bits(p, batch_row, begin, tid / rows, head, block_row + tid % rows);
      first_weight_bits = norm_weight_bits(p.layer, block_row + tid % rows);
    }
  }

  uint16_t* out = static_cast<uint16_t*>(p.call.out.data) + batch_row * p.call.out.stride_b + int64_t(head) * p.call.out.stride_h +
                  begin * p.call.out.stride_t + block_row;
  if (start_slot < 0) {
    for (int64_t i = tid; i < length * rows; i += blockDim.x) out[(i / rows) * p.call.out.stride_t + i % rows] = 0;
    return;
  }
  const int tokens = int(length);
  // The layer step's exchanges between the head's blocks: armed now, opened
  // just before the first push.
  uint64_t* head_barriers = reinterpret_cast<uint64_t*>(decode_smem + fkda_decode_layer_barriers_offset(p.max_tokens, warps));
  if constexpr (kLayer) {
    head_exchange_arm(head_barriers, vsplit, convolved ? uint32_t(tokens * 2 * FKDA_HEAD_DIM * 4) : 0u,
                      p.layer.out_gate.data != nullptr ? uint32_t(tokens * vsplit * 4) : 0u);
  }

  const int64_t element_bytes = kBf16 ? 2 : 4;
  const int64_t head_offset = int64_t(head) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM);
  auto matrix_of = [&](int64_t slot) {
    return static_cast<unsigned char*>(p.pool) + (slot * p.pool_slot_stride + head_offset) * element_bytes;
  };
  // The first items' conv state, the convolution's only loads that wait
  // for the slot, go out before the state's rows.
  if constexpr (kLayer) {
#pragma unroll
    for (int j = 0; j < kItemsAtOnce; ++j) {
      const int item = tid + j * threads;
      if (item < items) load_conv_window(p, decode_conv_item(item, rows_log2, block_row), head, start_slot, first[j]);
    }
  }
  // The plain kernels load all four rows into registers; the layer kernels
  // of sm_90 and later stage them (see the steps below).
  constexpr bool kStaged = kLayer && kDecodeLayerStaged;
  constexpr int kRowsAtOnce = kStaged ? 2 : kDecodeRowsPerGroup;
  float s[kRowsAtOnce][kDecodeColumnsPerLane];
  unsigned char* staged = decode_smem + fkda_decode_layer_smem_bytes(p.max_tokens, warps);
  if constexpr (kStaged) {
    stage_state<kBf16, kKV>(matrix_of(start_slot), e, l, staged);
  } else {
    load_state_rows<kBf16, kKV>(matrix_of(start_slot), e, l, s);
  }

  // ---- preparation of every token, into shared memory ----
  int64_t* write_slots = reinterpret_cast<int64_t*>(decode_smem);
  float* key = reinterpret_cast<float*>(decode_smem + fkda_decode_key_offset());
  float* query = reinterpret_cast<float*>(decode_smem + fkda_decode_query_offset(p.max_tokens));
  float* decay = reinterpret_cast<float*>(decode_smem + fkda_decode_decay_offset(p.max_tokens));
  float* value = reinterpret_cast<float*>(decode_smem + fkda_decode_value_offset(p.max_tokens));
  float* beta = reinterpret_cast<float*>(decode_smem + fkda_decode_beta_offset(p.max_tokens, warps));
  float* gated = reinterpret_cast<float*>(decode_smem + fkda_decode_smem_bytes(p.max_tokens, warps));
  if (p.indices_are_table) {
    for (int t = tid; t < tokens; t += blockDim.x) {
      write_slots[t] = usable_slot(load_index(p.state_indices, n, t), p.call.first_real_slot, p.pool_slots);
    }
  }
  {
    // The block's rows of v, as 16-byte pieces of 8 rows: tokens x rows / 8
    // pieces over 32 x warps threads (rows = 16 x warps), so at most one a
    // thread, held packed in 4 registers. Loaded before the work on q, k and
    // g so that the two latencies overlap. A piece is 16-byte aligned:
    // block_row is a multiple of 16 and the activations' data and strides
    // are 16-byte aligned (validate.cpp, check_gpu_alignment).
    static_assert(FKDA_DECODE_MAX_TOKENS * FKDA_DECODE_ROWS_PER_WARP / 8 <= 32, "one piece of v a thread");
    const int pieces_per_token = rows / 8;
    const int v_token = tid / pieces_per_token, v_row = 8 * (tid % pieces_per_token);
    uint4 v_piece = make_uint4(0, 0, 0, 0);
    if (v_token < tokens && !convolved) {
      v_piece = __ldg(reinterpret_cast<const uint4*>(token_row(p.call.v, v_token) + block_row + v_row));
    }
    const DecodeHeadGate head_gate = kLayer ? layer_head_gate : load_decode_head_gate(p.call, head, lane);
    // exp(A_log) is taken in the preparation below, not next to its load,
    // where the thread waited for the load; but at once in sm_80's layer
    // kernels, whose state rows fill their registers through the
    // preparation (taken there, it spilled).
    constexpr bool kRateAtOnce = kLayer && !kDecodeLayerStaged;
    const float rate_now = kRateAtOnce ? rate_of_a_log(p.call.A_log, head_gate.a_log, true) : 0.f;
    auto rate = [&] { return kRateAtOnce ? rate_now : rate_of_a_log(p.call.A_log, head_gate.a_log, true); };
    const float first_beta = real_of_bits(first_beta_bits, p.call.gate.beta_is_f32 != 0);
    // The staged layer kernels prepare the decays and beta of the warp's
    // first token while the conv states and the state's copies are in
    // flight: their inputs were loaded before the slot, and after the
    // convolution the warp would run their ~300 instructions on a
    // one-sequence call's critical path.
    constexpr bool kGateFirst = kLayer && kDecodeLayerStaged;
    if constexpr (kGateFirst) {
      if (warp < tokens) {
        store_decay_row(p.call, g_of_bits(first_g_bits), rate(), head_gate, decay + warp * FKDA_HEAD_DIM, lane);
        if (lane == 0) beta[warp] = step_size(p.call.gate, first_beta, true);
      }
    }
    // The convolution (decode_conv_item): q's and k's channels of the
    // block's rows go to `convolved_qk` in every block of the head, v's to
    // this block's `value`. The first items' inputs are in `first` (loaded
    // above).
    float* convolved_qk = reinterpret_cast<float*>(decode_smem + fkda_decode_layer_conv_offset(p.max_tokens, warps));
    const HeadBlockArray convolved_of_head = head_block_array(convolved_qk), barriers_of_head = head_block_array(head_barriers);
    if constexpr (kLayer) head_exchange_open(vsplit);
    if (convolved) {
      auto keep = [&](const DecodeConvItem& it, float x) {
        if (it.proj == 2) {
          value[it.t * rows + it.i - block_row] = x;
          return;
        }
        const int at = (2 * it.t + it.proj) * FKDA_HEAD_DIM + it.i;
#pragma unroll
        for (int to = 0; to < kDecodeLayerBlocks; ++to) {
          push_to_head_block(convolved_of_head, at, x, barriers_of_head, kHeadConvolved, to);
        }
      };
#pragma unroll
      for (int j = 0; j < kItemsAtOnce; ++j) {
        const int item = tid + j * threads;
        if (item >= items) continue;
        const DecodeConvItem it = decode_conv_item(item, rows_log2, block_row);
        keep(it, keep_and_convolve(p, it, tokens, head, start_slot, first[j]));
      }
      for (int item = tid + kItemsAtOnce * threads; item < items; item += threads) {
        const DecodeConvItem it = decode_conv_item(item, rows_log2, block_row);
        DecodeConvChannel ch = start_conv_channel(p, it, batch_row, begin, head);
        load_conv_window(p, it, head, start_slot, ch);
        keep(it, keep_and_convolve(p, it, tokens, head, start_slot, ch));
      }
      wait_for_head_blocks(head_barriers, kHeadConvolved, vsplit);
    }
    for (int t = warp; t < tokens; t += warps) {
      const float4 q = convolved ? reinterpret_cast<const float4*>(convolved_qk + 2 * t * FKDA_HEAD_DIM)[lane]
                                 : load_bf16x4(token_row(p.call.q, t) + 4 * lane);
      const float4 k = convolved ? reinterpret_cast<const float4*>(convolved_qk + (2 * t + 1) * FKDA_HEAD_DIM)[lane]
                                 : load_bf16x4(token_row(p.call.k, t) + 4 * lane);
      const float4 g = g_of_bits(kLayer && t == warp ? first_g_bits : load_g_bits(t));
      const float token_rate = rate();
      const float rq = 1.0f / sqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f);
      const float rk = 1.0f / sqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
      const float qs = rq * p.call.scale;
      reinterpret_cast<float4*>(key + t * FKDA_HEAD_DIM)[lane] = make_float4(k.x * rk, k.y * rk, k.z * rk, k.w * rk);
      reinterpret_cast<float4*>(query + t * FKDA_HEAD_DIM)[lane] =
          make_float4(q.x * qs, q.y * qs, q.z * qs, q.w * qs);
      if (!(kGateFirst && t == warp)) {
        store_decay_row(p.call, g, token_rate, head_gate, decay + t * FKDA_HEAD_DIM, lane);
        if (lane == 0) beta[t] = step_size(p.call.gate, kLayer && t == warp ? first_beta : load_beta_of(t), true);
      }
    }
    if (v_token < tokens && !convolved) {
      float4* to = reinterpret_cast<float4*>(value + v_token * rows + v_row);
      to[0] = make_float4(bf16_lo(v_piece.x), bf16_hi(v_piece.x), bf16_lo(v_piece.y), bf16_hi(v_piece.y));
      to[1] = make_float4(bf16_lo(v_piece.z), bf16_hi(v_piece.z), bf16_lo(v_piece.w), bf16_hi(v_piece.w));
    }
  }
  __syncthreads();

  // ---- the steps ----
  // Rows evolve independently, so the group's rows may take the tokens in
  // turns. The plain kernels take all four at once: their chains of
  // dependent steps overlap, and their loads went straight to registers
  // (about 140 a thread, three blocks a multiprocessor; capped at 128 for
  // four blocks, the H200 ran D4 6% slower). The staged layer kernels,
  // whose convolution and gate leave them bound by latency rather than by
  // bandwidth, take two rows at a time: at most 96 registers, so five
  // blocks stay resident, two chains to overlap (with one, a single
  // sequence's warp waited on each step), and two partial sums for each
  // dot product.
  if constexpr (kStaged) wait_staged_state();
  const bool gate = kLayer && p.layer.out_gate.data != nullptr;
  constexpr int kPartials = kDecodeRowsPerGroup / kRowsAtOnce;
#pragma unroll 1
  for (int r0 = 0; r0 < kDecodeRowsPerGroup; r0 += kRowsAtOnce) {
    if constexpr (kStaged) {
#pragma unroll
      for (int h = 0; h < kRowsAtOnce; ++h) read_staged_row<kBf16, kKV>(staged, r0 + h, s[h]);
    }
#pragma unroll 1
    for (int t = 0; t < tokens; ++t) {
      float kk[kDecodeColumnsPerLane], dd[kDecodeColumnsPerLane], qq[kDecodeColumnsPerLane];
      load_lane_columns<kBf16>(key + t * FKDA_HEAD_DIM, l, kk);
      load_lane_columns<kBf16>(decay + t * FKDA_HEAD_DIM, l, dd);
      load_lane_columns<kBf16>(query + t * FKDA_HEAD_DIM, l, qq);
      const float b = beta[t];
      float o[kRowsAtOnce];
#pragma unroll
      for (int h = 0; h < kRowsAtOnce; ++h) {
        const int r = r0 + h;
        float x[kPartials] = {}, y[kPartials] = {};
#pragma unroll
        for (int c = 0; c < kDecodeColumnsPerLane; ++c) {
          s[h][c] *= dd[c];
          x[c % kPartials] = fmaf(s[h][c], kk[c], x[c % kPartials]);
        }
        const float u = b * (value[t * rows + local_row + r] - group_sum(sum_of(x)));
#pragma unroll
        for (int c = 0; c < kDecodeColumnsPerLane; ++c) {
          s[h][c] = fmaf(u, kk[c], s[h][c]);
          y[c % kPartials] = fmaf(s[h][c], qq[c], y[c % kPartials]);
        }
        o[h] = group_sum(sum_of(y));
      }
      if (gate) {
        // Gated below, once the block has all 128 values of every token.
        if (l == 0) {
#pragma unroll
          for (int h = 0; h < kRowsAtOnce; ++h) gated[t * FKDA_HEAD_DIM + local_row + r0 + h] = o[h];
        }
      } else if constexpr (kRowsAtOnce == 4) {
        // The group's four outputs in one 8-byte store: local_row and
        // block_row are multiples of 4 and the output's data and strides are
        // 16-byte aligned (validate.cpp, check_gpu_alignment).
        if (l == 0) {
          *reinterpret_cast<uint2*>(out + t * p.call.out.stride_t + local_row) =
              make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
        }
      } else {
#pragma unroll
        for (int h = 0; h < kRowsAtOnce; ++h) {
          if (l == r0 + h) out[t * p.call.out.stride_t + local_row + r0 + h] = to_bf16(o[h]);
        }
      }
      if (p.indices_are_table && write_slots[t] >= 0) {
        store_state_rows<kBf16, kKV, kRowsAtOnce>(matrix_of(write_slots[t]), e, r0, l, s);
      }
    }
    if (!p.indices_are_table) {
      if constexpr (kKV && kRowsAtOnce < 4) {
#pragma unroll
        for (int h = 0; h < kRowsAtOnce; ++h) write_staged_row_kv<kBf16>(staged, r0 + h, s[h]);
      } else {
        store_state_rows<kBf16, kKV, kRowsAtOnce>(matrix_of(start_slot), e, r0, l, s);
      }
    }
  }
  if constexpr (kKV && kRowsAtOnce < 4) {
    if (!p.indices_are_table) {
      // The write-backs above and these loads meet in shared memory through
      // different types: keep the compiler from moving them past each other.
      asm volatile("" ::: "memory");
      store_staged_kv<kBf16>(matrix_of(start_slot), e, l, staged);
    }
  }
  if constexpr (kLayer) {
    finish_decode_layer(p, gated, gated + p.max_tokens * FKDA_HEAD_DIM, head_barriers, out, batch_row, begin, tokens,
                        head, start_slot, block_row, first_gate_bits, first_weight_bits);
  }
}

}  // namespace fkda_dev

// One kernel per pool dtype and layout, and one more of each with the layer
// step: on sm_90 and later the plain kernels' blocks, launched in clusters
// of a head's two blocks of FKDA_DECODE_MAX_WARPS warps; on sm_80 a block
// per head of FKDA_DECODE_LAYER_WARPS warps.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define FKDA_DECODE_LAYER_BOUNDS __launch_bounds__(32 * FKDA_DECODE_LAYER_WARPS, 2)
#else
#define FKDA_DECODE_LAYER_BOUNDS __launch_bounds__(32 * FKDA_DECODE_MAX_WARPS, 5) /* no spills, as measured with CUDA 13.0 */
#endif
#define FKDA_DEFINE_DECODE(name, bf16, kv)                                                     \
  extern "C" __global__ void __launch_bounds__(32 * FKDA_DECODE_MAX_WARPS) name(const FkdaDecodeParams p) { \
    fkda_dev::decode_steps<bf16, kv, false>(p);                                                  \
  }                                                                                             \
  extern "C" __global__ void FKDA_DECODE_LAYER_BOUNDS name##_layer(const FkdaDecodeParams p) {                   \
    fkda_dev::decode_steps<bf16, kv, true>(p);                                                   \
  }
FKDA_DEFINE_DECODE(fkda_decode_f32_vk, false, false)
FKDA_DEFINE_DECODE(fkda_decode_f32_kv, false, true)
FKDA_DEFINE_DECODE(fkda_decode_bf16_vk, true, false)
FKDA_DEFINE_DECODE(fkda_decode_bf16_kv, true, true)
#undef FKDA_DEFINE_DECODE
#undef FKDA_DECODE_LAYER_BOUNDS
