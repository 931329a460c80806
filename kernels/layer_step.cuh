// SPDX-License-Identifier: MIT
// The layer step around the recurrence (flashkda.h, "The layer step"): the
// causal depthwise convolution of q, k and v with SiLU, and the output gate
// RMSNorm(o) * w * sigmoid(g_out). The decode kernel calls the device
// functions below inside its own steps; fkda_fwd's preparation kernel
// convolves q and k as it loads them (prefill_prepare.cuh), and fkda_fwd
// runs the three kernels at the end of this file around the recurrence:
//   fkda_layer_convolve   the convolved v, rounded to bf16, into the staging
//                         area the recurrence then reads as its v
//   fkda_layer_conv_store each sequence's last Wc raw inputs into its conv
//                         state row (and pool checkpoints), after every read
//                         of the old states (a later launch)
//   fkda_layer_gate       the output gate, over the recurrence's bf16 output
// One thread per channel: the weights are per channel, and consecutive
// channels are consecutive in memory, so every warp access is one segment.
#pragma once

#include "device_common.cuh"
#include "layer_conv.cuh"
#include "layer_params.h"

namespace fkda_dev {

// Channels per thread of fkda_fwd's convolution.
constexpr int kConvChannels = 8;

__device__ __forceinline__ void store_real(void* data, bool is_f32, int64_t at, float x) {
  if (is_f32) {
    static_cast<float*>(data)[at] = x;
  } else {
    static_cast<uint16_t*>(data)[at] = to_bf16(x);
  }
}

__device__ __forceinline__ void store_conv_state(const FkdaLayerStep& layer, const FkdaConv& conv, int64_t row,
                                                 int64_t c, int col, float x) {
  store_real(conv.state, layer.conv_state_is_f32 != 0,
             row * conv.state_stride_row + c * conv.state_stride_c + col * conv.state_stride_w, x);
}

// The convolution's output for channel c from its W inputs, oldest first:
// silu(bias + sum_j weight[c][j] x[j]), accumulated in that order.
__device__ __forceinline__ float convolve(const FkdaLayerStep& layer, const FkdaConv& conv, int64_t c,
                                          const float (&x)[FKDA_CONV_MAX_WIDTH]) {
  const bool f32 = layer.conv_is_f32 != 0;
  float acc = conv.bias != nullptr ? load_real(conv.bias, f32, c * conv.bias_stride) : 0.f;
#pragma unroll
  for (int j = 0; j < FKDA_CONV_MAX_WIDTH; ++j) {
    if (j < layer.conv_width) acc = fmaf(load_real(conv.weight, f32, c * conv.weight_stride_c + j * conv.weight_stride_w), x[j], acc);
  }
  return silu(acc);
}

// 1 / RMS of a head's values from the sum of the squares of all 128.
__device__ __forceinline__ float inverse_rms(const FkdaLayerStep& layer, float sum_squares) {
  return 1.0f / sqrtf(sum_squares / float(FKDA_HEAD_DIM) + layer.norm_eps);
}

// RMSNorm * w * sigmoid(g) of value v (o) of a head.
__device__ __forceinline__ float gate_one(const FkdaLayerStep& layer, float inverse_rms, int v, float g, float o) {
  const float w = load_real(layer.norm_weight, layer.norm_weight_is_f32 != 0, int64_t(v) * layer.norm_weight_stride);
  return o * inverse_rms * w * sigmoid_accurate(g);
}

// The same for four of a head's values, given the sum of the squares of all 128.
__device__ __forceinline__ void gate_four(const FkdaLayerStep& layer, float sum_squares, int first_v,
                                          const float (&g)[4], float (&o)[4]) {
  const float r = inverse_rms(layer, sum_squares);
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = gate_one(layer, r, first_v + i, g[i], o[i]);
}

// ---- fkda_fwd's kernels ----

__device__ __forceinline__ const FkdaActivation& raw_projection(const FkdaLayerParams& p, int proj) {
  return proj == 0 ? p.call.q : (proj == 1 ? p.call.k : p.call.v);
}

__device__ __forceinline__ float raw_input(const FkdaActivation& raw, int64_t row, int64_t token, int head, int i) {
  return bf16_bits(__ldg(static_cast<const uint16_t*>(raw.data) + row * raw.stride_b + token * raw.stride_t +
                         int64_t(head) * raw.stride_h + i));
}

// The sequence holding packed token t with cu_seqlens: the last n whose
// offset is at most t (offsets are untrusted: any answer stays in range).
__device__ __forceinline__ int64_t sequence_at(const FkdaLayerParams& p, int64_t t) {
  int64_t lo = 0, hi = p.call.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (load_offset_of(p.call, mid) <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Eight consecutive channels of one raw token row (16 bytes: the
// activations' rows are 16-byte aligned, validate.cpp check_gpu_alignment).
__device__ __forceinline__ uint4 load_raw8_bits(const FkdaActivation& raw, int64_t row, int64_t token, int head, int i) {
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(raw.data) + row * raw.stride_b +
                                              token * raw.stride_t + int64_t(head) * raw.stride_h + i));
}

__device__ __forceinline__ void unpack_bf16x8(const uint4& w, float (&x)[kConvChannels]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    x[2 * e] = bf16_lo(words[e]);
    x[2 * e + 1] = bf16_hi(words[e]);
  }
}

__device__ __forceinline__ void load_raw8(const FkdaActivation& raw, int64_t row, int64_t token, int head, int i,
                                          float (&x)[kConvChannels]) {
  unpack_bf16x8(load_raw8_bits(raw, row, token, head, i), x);
}

// Block (token tile, group of 128 x 8 channels of v); a thread takes
// eight consecutive channels along the tile's tokens, its weights in
// registers and the last W - 1 inputs of its sequence in a sliding window,
// so that each raw input is read once. Loads of kAhead tokens are issued
// together: the thread's chain of tokens is otherwise one memory latency
// per token.
template <int kWidth>
__device__ __forceinline__ void convolve_tile(const FkdaLayerParams& p, int64_t c0) {
  constexpr int kV = 2;
  const int64_t channels = int64_t(p.call.num_heads) * FKDA_HEAD_DIM;
  const int head = int(c0 / FKDA_HEAD_DIM), i0 = int(c0 % FKDA_HEAD_DIM);
  const FkdaActivation& raw = raw_projection(p, kV);
  const FkdaConv& conv = p.layer.conv[kV];
  const int state_width = p.layer.conv_state_width;

  float weight_back[kConvChannels][FKDA_CONV_MAX_WIDTH], bias[kConvChannels];
#pragma unroll
  for (int e = 0; e < kConvChannels; ++e) {
    bias[e] = conv_bias(p.layer, conv, c0 + e);
    load_weights_back(p.layer, conv, c0 + e, kWidth, weight_back[e]);
  }

  const int64_t total = p.batch * p.call.seq_len;
  const int64_t first = int64_t(blockIdx.x) * FKDA_CONV_TILE_TOKENS;
  const int64_t last = first + FKDA_CONV_TILE_TOKENS < total ? first + FKDA_CONV_TILE_TOKENS : total;
  const bool packed = p.call.cu_seqlens != nullptr;
  int64_t n = packed ? sequence_at(p, first) : first / p.call.seq_len;
  int64_t begin = packed ? load_offset_of(p.call, n) : n * p.call.seq_len;
  int64_t end = packed ? load_offset_of(p.call, n + 1) : begin + p.call.seq_len;
  ConvRow row = conv_row_of(p, p.reads_state != 0, n);
  // history[k]: the input k + 1 tokens before the current one (from the
  // sequence's conv state before its first token, or 0 when it reads none).
  float history[kWidth - 1][kConvChannels];
  auto fill_history = [&](int64_t t) {
    const int64_t position = t - begin;
#pragma unroll
    for (int k = 0; k < kWidth - 1; ++k) {
      const int64_t at = position - 1 - k;
      if (at >= 0) {  // in the sequence, so in its batch row
        load_raw8(raw, packed ? 0 : n, packed ? t - 1 - k : at, head, i0, history[k]);
      } else {
#pragma unroll
        for (int e = 0; e < kConvChannels; ++e) {
          history[k][e] = position >= 0 && row.reads && at >= -state_width
                              ? conv_state_at(p.layer, conv, row.row, c0 + e, int(state_width + at))
                              : 0.f;
        }
      }
    }
  };
  fill_history(first);

  // Tokens loaded ahead, held packed (4 registers a token): 6 of them keep
  // 96 bytes a thread in flight at the three blocks per SM these registers
  // allow (8 spill, CUDA 13.0).
  constexpr int kAhead = 6;
  uint16_t* staged = static_cast<uint16_t*>(p.staged_v) + c0;
  // The batch row and index in it of the next token to load, stepped
  // along (no division per token).
  int64_t next_row = packed ? 0 : n, next_index = packed ? first : first - n * p.call.seq_len;
  for (int64_t t0 = first; t0 < last; t0 += kAhead) {
    uint4 ahead[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      if (t0 + u < last) {
        ahead[u] = load_raw8_bits(raw, next_row, next_index, head, i0);
        if (++next_index == p.call.seq_len && !packed) {
          next_index = 0;
          ++next_row;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t t = t0 + u;
      if (t >= last) break;
      if (t >= end && n + 1 < p.call.num_seqs) {  // the next sequence starts (zero-length ones are skipped)
        do {
          ++n;
          begin = packed ? load_offset_of(p.call, n) : n * p.call.seq_len;
          end = packed ? load_offset_of(p.call, n + 1) : begin + p.call.seq_len;
        } while (t >= end && n + 1 < p.call.num_seqs);
        row = conv_row_of(p, p.reads_state != 0, n);
        fill_history(t);
      }
      const float keep = t >= begin ? 1.f : 0.f;  // 0 only for tokens no sequence holds
      float input[kConvChannels];
      unpack_bf16x8(ahead[u], input);
      uint32_t packed_out[kConvChannels / 2];
#pragma unroll
      for (int e = 0; e < kConvChannels; e += 2) {
        float y[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float x_back[FKDA_CONV_MAX_WIDTH] = {keep * input[e + h], 0.f, 0.f, 0.f};
#pragma unroll
          for (int b = 1; b < kWidth; ++b) x_back[b] = keep * history[b - 1][e + h];
          y[h] = convolve_rounded(kWidth, bias[e + h], weight_back[e + h], x_back);
        }
        packed_out[e / 2] = pack_bf16x2(y[0], y[1]);
      }
      *reinterpret_cast<uint4*>(staged + t * channels) =
          make_uint4(packed_out[0], packed_out[1], packed_out[2], packed_out[3]);
#pragma unroll
      for (int k = kWidth - 2; k > 0; --k)
#pragma unroll
        for (int e = 0; e < kConvChannels; ++e) history[k][e] = history[k - 1][e];
#pragma unroll
      for (int e = 0; e < kConvChannels; ++e) history[0][e] = input[e];
    }
  }
}

__device__ __forceinline__ void convolve_v(const FkdaLayerParams& p) {
  const int64_t c0 = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * kConvChannels;
  if (c0 >= int64_t(p.call.num_heads) * FKDA_HEAD_DIM) return;
  switch (p.layer.conv_width) {
    case 2: convolve_tile<2>(p, c0); break;
    case 3: convolve_tile<3>(p, c0); break;
    default: convolve_tile<4>(p, c0); break;
  }
}

// Block (sequence, head, projection), a thread per channel: the sequence's
// last Wc raw inputs (older ones from its old state) into its row, and the
// same at each pool checkpoint. Every old value is read before any write.
__device__ __forceinline__ void store_conv_states(const FkdaLayerParams& p) {
  const int64_t n = blockIdx.x;
  const int head = blockIdx.y, proj = blockIdx.z, i = threadIdx.x;
  const FkdaConv& conv = p.layer.conv[proj];
  const int64_t c = int64_t(head) * FKDA_HEAD_DIM + i;
  const int state_width = p.layer.conv_state_width;
  const bool packed = p.call.cu_seqlens != nullptr;
  const int64_t begin = packed ? load_offset_of(p.call, n) : 0;
  int64_t end = packed ? load_offset_of(p.call, n + 1) : p.call.seq_len;
  if (end < begin) end = begin;
  const int64_t length = end - begin, batch_row = packed ? 0 : n;
  const ConvRow row = conv_row_of(p, p.reads_state != 0, n);
  if (row.row < 0 || length == 0) return;

  float old[FKDA_CONV_MAX_WIDTH] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int col = 0; col < FKDA_CONV_MAX_WIDTH; ++col) {
    if (col < state_width && row.reads) old[col] = conv_state_at(p.layer, conv, row.row, c, col);
  }
  // Input `at` of the sequence (negative: from the old state), at >= -Wc.
  auto input = [&](int64_t at) {
    if (at >= 0) return raw_input(raw_projection(p, proj), batch_row, begin + at, head, i);
    float value = 0.f;
#pragma unroll
    for (int col = 0; col < FKDA_CONV_MAX_WIDTH; ++col) value = col == state_width + at ? old[col] : value;
    return value;
  };
  if (p.checkpoint_offsets.data != nullptr) {
    for (int64_t k = 0; k < p.checkpoint_offsets.cols; ++k) {
      const int64_t offset = load_index(p.checkpoint_offsets, n, k);
      if (offset < FKDA_CHUNK || offset > length || offset % FKDA_CHUNK != 0) continue;
      const int64_t slot =
          usable_slot(load_index(p.checkpoint_slots, n, k), p.call.first_real_slot, p.pool_slots);
      if (slot < 0) continue;
      for (int col = 0; col < state_width; ++col) {
        store_conv_state(p.layer, conv, slot, c, col, input(offset - state_width + col));
      }
    }
  }
  for (int col = 0; col < state_width; ++col) {
    store_conv_state(p.layer, conv, row.row, c, col, input(length - state_width + col));
  }
}

// A warp per FKDA_GATE_ROWS_PER_WARP consecutive (token, head) rows of out,
// four values a lane; every row's loads are issued before the first is used.
__device__ __forceinline__ void gate_output_rows(const FkdaLayerParams& p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t heads = p.call.num_heads, rows = p.batch * p.call.seq_len * heads;
  const int64_t first = (int64_t(blockIdx.x) * FKDA_GATE_WARPS + warp) * FKDA_GATE_ROWS_PER_WARP;
  const FkdaActivation& gate = p.layer.out_gate;
  uint16_t* out_rows[FKDA_GATE_ROWS_PER_WARP];
  uint2 o_bits[FKDA_GATE_ROWS_PER_WARP], g_bits[FKDA_GATE_ROWS_PER_WARP];
  int64_t token = first / heads, head = first % heads;
  int64_t b = token / p.call.seq_len, t = token % p.call.seq_len;
#pragma unroll
  for (int r = 0; r < FKDA_GATE_ROWS_PER_WARP; ++r) {
    out_rows[r] = nullptr;
    if (first + r < rows) {
      out_rows[r] = static_cast<uint16_t*>(p.call.out.data) + b * p.call.out.stride_b + t * p.call.out.stride_t +
                    head * p.call.out.stride_h + 4 * lane;
      o_bits[r] = *reinterpret_cast<const uint2*>(out_rows[r]);
      g_bits[r] = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(gate.data) + b * gate.stride_b +
                                                       t * gate.stride_t + head * gate.stride_h + 4 * lane));
    }
    if (++head == heads) {  // the next row: the next head, or the next token's first
      head = 0;
      if (++t == p.call.seq_len) {
        t = 0;
        ++b;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < FKDA_GATE_ROWS_PER_WARP; ++r) {
    if (out_rows[r] == nullptr) continue;
    float o[4] = {bf16_lo(o_bits[r].x), bf16_hi(o_bits[r].x), bf16_lo(o_bits[r].y), bf16_hi(o_bits[r].y)};
    const float g[4] = {bf16_lo(g_bits[r].x), bf16_hi(g_bits[r].x), bf16_lo(g_bits[r].y), bf16_hi(g_bits[r].y)};
    float squares = o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3];
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, d);
    gate_four(p.layer, squares, 4 * lane, g, o);
    *reinterpret_cast<uint2*>(out_rows[r]) = make_uint2(pack_bf16x2(o[0], o[1]), pack_bf16x2(o[2], o[3]));
  }
}

}  // namespace fkda_dev

extern "C" __global__ void __launch_bounds__(FKDA_CONV_THREADS) fkda_layer_convolve(const FkdaLayerParams p) {
  fkda_dev::convolve_v(p);
}
extern "C" __global__ void __launch_bounds__(FKDA_HEAD_DIM) fkda_layer_conv_store(const FkdaLayerParams p) {
  fkda_dev::store_conv_states(p);
}
extern "C" __global__ void __launch_bounds__(32 * FKDA_GATE_WARPS) fkda_layer_gate(const FkdaLayerParams p) {
  fkda_dev::gate_output_rows(p);
}
