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
// `rows` = 16 x warps of them, starting at z x rows, and keeps them in
// registers for all the sequence's tokens: each state element is read once
// and written once per call ([N] indices) or once per token (table). Within a
// warp, each group of 8 lanes owns four adjacent rows and splits the 128 K
// columns into 16 a lane, taken as four runs of 4 ("quads") placed so that
// every global access of a group is one contiguous 128-byte segment of a row:
// dot products over K are 16 fused multiply-adds and three shuffles.
//
// Before the steps, the block's warps prepare every token's normalised key
// and query, decay and beta (one warp per token, each lane 4 channels) into
// shared memory, with the block's rows of v; the state loads are issued
// first, so they are in flight during that work.
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
// Rows per group of 8 lanes: four, so that a lane keeps 16 independent
// 16-byte state accesses in flight (8 for a bf16 pool) and the per-block
// preparation of the tokens serves twice the rows it served with two.
constexpr int kDecodeRowsPerGroup = FKDA_DECODE_ROWS_PER_WARP / 4;
using StateRows = float[kDecodeRowsPerGroup][kDecodeColumnsPerLane];

// First K column of quad m (0..3) of lane l (0..7) of a group. An f32 row
// is read as four 16-byte pieces, quad m at piece 8 m + l; a bf16 row as two,
// piece j = m / 2 holding quads 2 j and 2 j + 1.
template <bool kBf16>
__device__ __forceinline__ int quad_column(int m, int l) {
  return kBf16 ? ((m >> 1) * 8 + l) * 8 + (m & 1) * 4 : (m * 8 + l) * 4;
}

// A group's kDecodeRowsPerGroup rows e, e + 1, ... of one V x K (or K x V)
// matrix: s[r][4 m + i] is row e + r, column quad_column(m, l) + i. Every
// load is issued before any value is used (all unrolled, no dependence
// between them), so a lane has all of its rows' bytes in flight at once.
// Streaming cache hints: each element is used once per call.
template <bool kBf16, bool kKV>
__device__ __forceinline__ void load_state_rows(const void* matrix, int e, int l, StateRows& s) {
  if (!kKV) {
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerGroup; ++r) {
      if (kBf16) {
        const uint16_t* row = static_cast<const uint16_t*>(matrix) + (e + r) * FKDA_HEAD_DIM;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint4 w = __ldcs(reinterpret_cast<const uint4*>(row + quad_column<true>(2 * j, l)));
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
          const float4 f = __ldcs(reinterpret_cast<const float4*>(row + quad_column<false>(m, l)));
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

// The inverse of load_state_rows, rounding to bf16 (nearest even) for a bf16 pool.
template <bool kBf16, bool kKV>
__device__ __forceinline__ void store_state_rows(void* matrix, int e, int l, const StateRows& s) {
  if (!kKV) {
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerGroup; ++r) {
      if (kBf16) {
        uint16_t* row = static_cast<uint16_t*>(matrix) + (e + r) * FKDA_HEAD_DIM;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint4 w;
          w.x = pack_bf16x2(s[r][8 * j], s[r][8 * j + 1]);
          w.y = pack_bf16x2(s[r][8 * j + 2], s[r][8 * j + 3]);
          w.z = pack_bf16x2(s[r][8 * j + 4], s[r][8 * j + 5]);
          w.w = pack_bf16x2(s[r][8 * j + 6], s[r][8 * j + 7]);
          __stcs(reinterpret_cast<uint4*>(row + quad_column<true>(2 * j, l)), w);
        }
      } else {
        float* row = static_cast<float*>(matrix) + (e + r) * FKDA_HEAD_DIM;
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          __stcs(reinterpret_cast<float4*>(row + quad_column<false>(m, l)),
                 make_float4(s[r][4 * m], s[r][4 * m + 1], s[r][4 * m + 2], s[r][4 * m + 3]));
        }
      }
    }
  } else {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int at = (quad_column<kBf16>(m, l) + i) * FKDA_HEAD_DIM + e;
        if (kBf16) {
          __stcs(reinterpret_cast<uint2*>(static_cast<uint16_t*>(matrix) + at),
                 make_uint2(pack_bf16x2(s[0][4 * m + i], s[1][4 * m + i]),
                            pack_bf16x2(s[2][4 * m + i], s[3][4 * m + i])));
        } else {
          __stcs(reinterpret_cast<float4*>(static_cast<float*>(matrix) + at),
                 make_float4(s[0][4 * m + i], s[1][4 * m + i], s[2][4 * m + i], s[3][4 * m + i]));
        }
      }
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

// Four consecutive bf16 values (8 bytes) of an activation row.
__device__ __forceinline__ float4 load_bf16x4(const uint16_t* at) {
  const uint2 w = __ldg(reinterpret_cast<const uint2*>(at));
  return make_float4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
}

// The layer step's convolution in decode: the convolved values of token t
// (of `tokens`, from `begin`) for four channels c0..c0+3 of projection
// `proj`, from the call's raw inputs and the pool slot's conv state.
__device__ __forceinline__ float4 convolve_four(const FkdaDecodeParams& p, int proj, const FkdaActivation& raw,
                                                int64_t batch_row, int64_t begin, int t, int head, int i0,
                                                int64_t slot) {
  const FkdaConv& conv = p.layer.conv[proj];
  const int width = p.layer.conv_width;
  float x[4][FKDA_CONV_MAX_WIDTH] = {};
#pragma unroll
  for (int j = 0; j < FKDA_CONV_MAX_WIDTH; ++j) {
    if (j >= width) continue;
    const int at = t - (width - 1) + j;
    if (at >= 0) {
      const float4 f = load_bf16x4(static_cast<const uint16_t*>(raw.data) + batch_row * raw.stride_b +
                                   (begin + at) * raw.stride_t + int64_t(head) * raw.stride_h + i0);
      x[0][j] = f.x;
      x[1][j] = f.y;
      x[2][j] = f.z;
      x[3][j] = f.w;
    } else if (conv.state != nullptr) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[i][j] = conv_state_at(p.layer, conv, slot, int64_t(head) * FKDA_HEAD_DIM + i0 + i,
                                p.layer.conv_state_width + at);
      }
    }
  }
  const int64_t c = int64_t(head) * FKDA_HEAD_DIM + i0;
  return make_float4(convolve(p.layer, conv, c, x[0]), convolve(p.layer, conv, c + 1, x[1]),
                     convolve(p.layer, conv, c + 2, x[2]), convolve(p.layer, conv, c + 3, x[3]));
}

// After the steps (every old conv state value was read before the block's
// first barrier): each of the head's 3 x 128 channels keeps its last Wc raw
// inputs, a thread per channel.
__device__ __forceinline__ void store_decode_conv_states(const FkdaDecodeParams& p, int64_t batch_row, int64_t begin,
                                                         int tokens, int head, int64_t slot) {
  const int state_width = p.layer.conv_state_width;
  for (int index = threadIdx.x; index < 3 * FKDA_HEAD_DIM; index += blockDim.x) {
    const int proj = index / FKDA_HEAD_DIM, i = index % FKDA_HEAD_DIM;
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

template <bool kBf16, bool kKV, bool kLayer>
__device__ __forceinline__ void decode_steps(const FkdaDecodeParams& p) {
  extern __shared__ __align__(16) unsigned char decode_smem[];
  const int warps = p.warps;
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

  uint16_t* out = static_cast<uint16_t*>(p.call.out.data) + batch_row * p.call.out.stride_b + int64_t(head) * p.call.out.stride_h +
                  begin * p.call.out.stride_t + block_row;
  if (start_slot < 0) {
    for (int64_t i = tid; i < length * rows; i += blockDim.x) out[(i / rows) * p.call.out.stride_t + i % rows] = 0;
    return;
  }
  const int tokens = int(length);

  const int64_t element_bytes = kBf16 ? 2 : 4;
  const int64_t head_offset = int64_t(head) * (FKDA_HEAD_DIM * FKDA_HEAD_DIM);
  auto matrix_of = [&](int64_t slot) {
    return static_cast<unsigned char*>(p.pool) + (slot * p.pool_slot_stride + head_offset) * element_bytes;
  };
  StateRows s;
  load_state_rows<kBf16, kKV>(matrix_of(start_slot), e, l, s);

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
    auto token_offset = [&](const FkdaActivation& a, int t) {
      return batch_row * a.stride_b + int64_t(head) * a.stride_h + (begin + t) * a.stride_t;
    };
    auto token_row = [&](const FkdaActivation& a, int t) {
      return static_cast<const uint16_t*>(a.data) + token_offset(a, t);
    };
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
    const bool convolved = kLayer && p.layer.conv_width > 0;
    if (v_token < tokens && !convolved) {
      v_piece = __ldg(reinterpret_cast<const uint4*>(token_row(p.call.v, v_token) + block_row + v_row));
    }
    const float rate = gate_rate(p.call.A_log, head, true);
    float dt[4] = {0.f, 0.f, 0.f, 0.f};
    if (p.call.dt_bias != nullptr) {
      const float* dt_bias = p.call.dt_bias + int64_t(head) * FKDA_HEAD_DIM + 4 * lane;
      for (int i = 0; i < 4; ++i) dt[i] = __ldg(dt_bias + i);
    }
    if (convolved) {
      // The convolution of q and k over the whole block (four channels a
      // thread) into the query and key rows, which the warps below read,
      // normalise and overwrite lane by lane.
      for (int item = tid; item < tokens * 2 * 32; item += blockDim.x) {
        const int t = item / 64, proj = (item / 32) % 2, quad = item % 32;
        float* to = (proj == 0 ? query : key) + t * FKDA_HEAD_DIM + 4 * quad;
        *reinterpret_cast<float4*>(to) = convolve_four(p, proj, proj == 0 ? p.call.q : p.call.k, batch_row, begin,
                                                       t, head, 4 * quad, start_slot);
      }
      __syncthreads();
    }
    for (int t = warp; t < tokens; t += warps) {
      const float4 q = convolved ? reinterpret_cast<const float4*>(query + t * FKDA_HEAD_DIM)[lane]
                                 : load_bf16x4(token_row(p.call.q, t) + 4 * lane);
      const float4 k = convolved ? reinterpret_cast<const float4*>(key + t * FKDA_HEAD_DIM)[lane]
                                 : load_bf16x4(token_row(p.call.k, t) + 4 * lane);
      const float4 g = p.call.gate.g_is_f32
                           ? __ldg(reinterpret_cast<const float4*>(static_cast<const float*>(p.call.g.data) +
                                                                   token_offset(p.call.g, t)) + lane)
                           : load_bf16x4(token_row(p.call.g, t) + 4 * lane);
      const float rq = 1.0f / sqrtf(warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w) + 1e-6f);
      const float rk = 1.0f / sqrtf(warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w) + 1e-6f);
      const float qs = rq * p.call.scale;
      reinterpret_cast<float4*>(key + t * FKDA_HEAD_DIM)[lane] = make_float4(k.x * rk, k.y * rk, k.z * rk, k.w * rk);
      reinterpret_cast<float4*>(query + t * FKDA_HEAD_DIM)[lane] =
          make_float4(q.x * qs, q.y * qs, q.z * qs, q.w * qs);
      const float gv[4] = {g.x, g.y, g.z, g.w};
      float d[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) d[i] = decay_accurate(p.call.gate, p.call.gate_scale, gv[i], rate, dt[i]);
      reinterpret_cast<float4*>(decay + t * FKDA_HEAD_DIM)[lane] = make_float4(d[0], d[1], d[2], d[3]);
      if (lane == 0) {
        beta[t] = step_size(p.call.gate, load_beta(p.call.gate, p.call.beta.data, token_offset(p.call.beta, t)), true);
      }
    }
    if (v_token < tokens) {
      float4* to = reinterpret_cast<float4*>(value + v_token * rows + v_row);
      if (convolved) {
        to[0] = convolve_four(p, 2, p.call.v, batch_row, begin, v_token, head, block_row + v_row, start_slot);
        to[1] = convolve_four(p, 2, p.call.v, batch_row, begin, v_token, head, block_row + v_row + 4, start_slot);
      } else {
        to[0] = make_float4(bf16_lo(v_piece.x), bf16_hi(v_piece.x), bf16_lo(v_piece.y), bf16_hi(v_piece.y));
        to[1] = make_float4(bf16_lo(v_piece.z), bf16_hi(v_piece.z), bf16_lo(v_piece.w), bf16_hi(v_piece.w));
      }
    }
  }
  __syncthreads();

  // ---- the steps ----
  for (int t = 0; t < tokens; ++t) {
    float kk[kDecodeColumnsPerLane], dd[kDecodeColumnsPerLane];
    load_lane_columns<kBf16>(key + t * FKDA_HEAD_DIM, l, kk);
    load_lane_columns<kBf16>(decay + t * FKDA_HEAD_DIM, l, dd);
    const float b = beta[t];
    float u[kDecodeRowsPerGroup];
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerGroup; ++r) {
      float x = 0.f;
#pragma unroll
      for (int c = 0; c < kDecodeColumnsPerLane; ++c) {
        s[r][c] *= dd[c];
        x = fmaf(s[r][c], kk[c], x);
      }
      u[r] = b * (value[t * rows + local_row + r] - group_sum(x));
    }
    float qq[kDecodeColumnsPerLane];
    load_lane_columns<kBf16>(query + t * FKDA_HEAD_DIM, l, qq);
    float o[kDecodeRowsPerGroup];
#pragma unroll
    for (int r = 0; r < kDecodeRowsPerGroup; ++r) {
      float y = 0.f;
#pragma unroll
      for (int c = 0; c < kDecodeColumnsPerLane; ++c) {
        s[r][c] = fmaf(u[r], kk[c], s[r][c]);
        y = fmaf(s[r][c], qq[c], y);
      }
      o[r] = group_sum(y);
    }
    // The group's four outputs in one 8-byte store: local_row and block_row
    // are multiples of 4 and the output's data and strides are 16-byte
    // aligned (validate.cpp, check_gpu_alignment).
    static_assert(kDecodeRowsPerGroup == 4, "one 8-byte store of four outputs");
    if (kLayer && p.layer.out_gate.data != nullptr) {
      // Gated below, once the block has all 128 values of every token.
      if (l == 0) {
        *reinterpret_cast<float4*>(gated + t * FKDA_HEAD_DIM + local_row) = make_float4(o[0], o[1], o[2], o[3]);
      }
    } else if (l == 0) {
      *reinterpret_cast<uint2*>(out + t * p.call.out.stride_t + local_row) =
          make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
    }
    if (p.indices_are_table && write_slots[t] >= 0) {
      store_state_rows<kBf16, kKV>(matrix_of(write_slots[t]), e, l, s);
    }
  }
  if (!p.indices_are_table) store_state_rows<kBf16, kKV>(matrix_of(start_slot), e, l, s);
  if (!kLayer) return;
  if (p.layer.conv_width > 0 && p.layer.conv[0].state != nullptr) {
    store_decode_conv_states(p, batch_row, begin, tokens, head, start_slot);
  }
  if (p.layer.out_gate.data != nullptr) {
    __syncthreads();
    const FkdaActivation& g_out = p.layer.out_gate;
    for (int t = warp; t < tokens; t += warps) {
      float o[4];
      const float4 f = *reinterpret_cast<const float4*>(gated + t * FKDA_HEAD_DIM + 4 * lane);
      o[0] = f.x;
      o[1] = f.y;
      o[2] = f.z;
      o[3] = f.w;
      const float4 gv = load_bf16x4(static_cast<const uint16_t*>(g_out.data) + batch_row * g_out.stride_b +
                                    (begin + t) * g_out.stride_t + int64_t(head) * g_out.stride_h + 4 * lane);
      const float g[4] = {gv.x, gv.y, gv.z, gv.w};
      gate_four(p.layer, warp_sum(o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3]), 4 * lane, g, o);
      *reinterpret_cast<uint2*>(out + t * p.call.out.stride_t + 4 * lane) =
          make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
    }
  }
}

}  // namespace fkda_dev

// One kernel per pool dtype and layout, and one more of each with the layer
// step (a block per head, FKDA_DECODE_LAYER_WARPS warps).
#define FKDA_DEFINE_DECODE(name, bf16, kv)                                                     \
  extern "C" __global__ void __launch_bounds__(32 * FKDA_DECODE_MAX_WARPS) name(const FkdaDecodeParams p) { \
    fkda_dev::decode_steps<bf16, kv, false>(p);                                                  \
  }                                                                                             \
  extern "C" __global__ void __launch_bounds__(32 * FKDA_DECODE_LAYER_WARPS, 2) name##_layer(const FkdaDecodeParams p) { \
    fkda_dev::decode_steps<bf16, kv, true>(p);                                                   \
  }
FKDA_DEFINE_DECODE(fkda_decode_f32_vk, false, false)
FKDA_DEFINE_DECODE(fkda_decode_f32_kv, false, true)
FKDA_DEFINE_DECODE(fkda_decode_bf16_vk, true, false)
FKDA_DEFINE_DECODE(fkda_decode_bf16_kv, true, true)
#undef FKDA_DEFINE_DECODE
