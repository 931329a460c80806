// SPDX-License-Identifier: MIT
// The layer step around the recurrence (flashkda.h, "The layer step"): the
// causal depthwise convolution of q, k and v with SiLU, and the output gate
// RMSNorm(o) * w * sigmoid(g_out). The decode kernel calls the device
// functions below inside its own steps; fkda_fwd's preparation kernel
// convolves q and k as it loads them (prefill_prepare.cuh), and fkda_fwd
// runs the four kernels at the end of this file around the recurrence:
//   fkda_layer_pack_conv_weights
//                         q's and k's weights and biases, f32, into the
//                         table the preparation kernel reads
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

// Channels per thread of fkda_fwd's convolution of v.
constexpr int kConvChannels = FKDA_CONV_CHANNELS_PER_THREAD;

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

// The output gate, in every kernel that applies it: the gated value is
// rounded to bf16 and feeds no state, so the gate takes the hardware's
// reciprocal square root, exponential and reciprocal (each within 2 ulp of
// f32, far below a bf16 step), as fkda_fwd's gate kernel always has; in the
// decode kernels the IEEE forms were about 80 instructions a value on a
// one-sequence call's critical path.
//
// 1 / RMS of a head's values from the sum of the squares of all 128.
__device__ __forceinline__ float inverse_rms(const FkdaLayerStep& layer, float sum_squares) {
  return rsqrtf(sum_squares * (1.0f / float(FKDA_HEAD_DIM)) + layer.norm_eps);
}

// The norm weight w of value v of a head.
__device__ __forceinline__ float norm_weight(const FkdaLayerStep& layer, int v) {
  return load_real(layer.norm_weight, layer.norm_weight_is_f32 != 0, int64_t(v) * layer.norm_weight_stride);
}

// RMSNorm * w * sigmoid(g) of a head's value o, whose norm weight is w.
__device__ __forceinline__ float gate_one(float inverse_rms, float w, float g, float o) {
  return o * inverse_rms * w * sigmoid_fast(g);
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

// Four consecutive channels of one raw token row (8 bytes: the
// activations' rows are 16-byte aligned, validate.cpp check_gpu_alignment).
__device__ __forceinline__ uint2 load_raw4_bits(const FkdaActivation& raw, int64_t row, int64_t token, int head, int i) {
  return __ldg(reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(raw.data) + row * raw.stride_b +
                                              token * raw.stride_t + int64_t(head) * raw.stride_h + i));
}

__device__ __forceinline__ void unpack_bf16x4(const uint2& w, float (&x)[kConvChannels]) {
  x[0] = bf16_lo(w.x);
  x[1] = bf16_hi(w.x);
  x[2] = bf16_lo(w.y);
  x[3] = bf16_hi(w.y);
}

// Block (token tile, group of 128 x 4 channels of v); a thread takes four
// consecutive channels along the tile's tokens, its weights in registers
// and the last W - 1 inputs of its sequence in a sliding window, so that
// each raw input is read once. The tile is cut where sequences begin and
// end, and along each piece the loads of the next kAhead tokens are issued
// before the current ones are convolved, so that a batch is always in
// flight. Four channels a thread, not eight, keep the registers low enough
// for six blocks a multiprocessor, whose warps cover each other's arithmetic.
template <int kWidth>
__device__ __forceinline__ void convolve_tile(const FkdaLayerParams& p, int64_t c0) {
  constexpr int kV = 2;
  constexpr int kAhead = 8;  // tokens a batch, held packed (2 registers a token)
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
  uint16_t* staged = static_cast<uint16_t*>(p.staged_v) + c0;

  for (int64_t t = first; t < last;) {
    while (t >= end && n + 1 < p.call.num_seqs) {  // the sequence holding t (zero-length ones are skipped)
      ++n;
      begin = packed ? load_offset_of(p.call, n) : n * p.call.seq_len;
      end = packed ? load_offset_of(p.call, n + 1) : begin + p.call.seq_len;
    }
    // The piece [t, stop): tokens before the sequence's first, which no
    // sequence holds (convolved as zeros), or the sequence's own; tokens
    // past the last sequence's end continue it (nothing reads them).
    const bool held = t >= begin;
    int64_t stop = held ? end : begin;
    if (stop <= t || stop > last) stop = last;
    const float keep = held ? 1.f : 0.f;
    const int64_t position = t - begin;
    const ConvRow row = conv_row_of(p, p.reads_state != 0, n);

    // history[k]: the input k + 1 tokens before the current one (from the
    // sequence's conv state before its first token, or 0 when it reads none).
    float history[kWidth - 1][kConvChannels];
#pragma unroll
    for (int k = 0; k < kWidth - 1; ++k) {
      const int64_t at = position - 1 - k;
      if (at >= 0) {  // in the sequence, so in its batch row
        unpack_bf16x4(load_raw4_bits(raw, packed ? 0 : n, packed ? t - 1 - k : at, head, i0), history[k]);
      } else {
#pragma unroll
        for (int e = 0; e < kConvChannels; ++e) {
          history[k][e] = position >= 0 && row.reads && at >= -state_width
                              ? conv_state_at(p.layer, conv, row.row, c0 + e, int(state_width + at))
                              : 0.f;
        }
      }
    }

    // Inside one sequence (or none) the tokens are consecutive rows of one
    // batch row, so the loads step a pointer.
    const uint16_t* next = static_cast<const uint16_t*>(raw.data) + (packed ? 0 : n) * raw.stride_b +
                           (packed ? t : position) * raw.stride_t + int64_t(head) * raw.stride_h + i0;
    auto load_batch = [&](uint2 (&batch)[kAhead], int64_t t0) {
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (t0 + u < stop) batch[u] = __ldg(reinterpret_cast<const uint2*>(next));
        next += raw.stride_t;
      }
    };
    uint2 current[kAhead] = {}, upcoming[kAhead] = {};
    load_batch(current, t);
    for (int64_t t0 = t; t0 < stop; t0 += kAhead) {
      load_batch(upcoming, t0 + kAhead);
#pragma unroll
      for (int u = 0; u < kAhead; ++u) {
        if (t0 + u >= stop) break;
        float input[kConvChannels];
        unpack_bf16x4(current[u], input);
        float y[kConvChannels];
#pragma unroll
        for (int e = 0; e < kConvChannels; ++e) {
          input[e] *= keep;
          float x_back[FKDA_CONV_MAX_WIDTH] = {input[e], 0.f, 0.f, 0.f};
#pragma unroll
          for (int b = 1; b < kWidth; ++b) x_back[b] = history[b - 1][e];
          y[e] = convolve_rounded(kWidth, bias[e], weight_back[e], x_back);
        }
        *reinterpret_cast<uint2*>(staged + (t0 + u) * channels) =
            make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));
#pragma unroll
        for (int k = kWidth - 2; k > 0; --k)
#pragma unroll
          for (int e = 0; e < kConvChannels; ++e) history[k][e] = history[k - 1][e];
#pragma unroll
        for (int e = 0; e < kConvChannels; ++e) history[0][e] = input[e];
      }
#pragma unroll
      for (int u = 0; u < kAhead; ++u) current[u] = upcoming[u];
    }
    t = stop;
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

// Block (group of FKDA_CONV_THREADS channels, projection q or k), a thread
// per channel: its weights by distance and its bias into the table the
// preparation kernels read (FKDA_CONV_TABLE_*).
__device__ __forceinline__ void pack_conv_weights(const FkdaLayerParams& p) {
  const int proj = blockIdx.y;
  const int64_t channels = int64_t(p.call.num_heads) * FKDA_HEAD_DIM;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const FkdaConv& conv = p.layer.conv[proj];
  float weight_back[FKDA_CONV_MAX_WIDTH];
  load_weights_back(p.layer, conv, c, p.layer.conv_width, weight_back);
  reinterpret_cast<float4*>(p.conv_table)[proj * channels + c] =
      make_float4(weight_back[0], weight_back[1], weight_back[2], weight_back[3]);
  p.conv_table[FKDA_CONV_TABLE_BIAS(channels) + proj * channels + c] = conv_bias(p.layer, conv, c);
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

// A warp per FKDA_GATE_ROWS_PER_WARP consecutive (token, head) rows of out:
// each half-warp takes every other row, eight values a lane (16-byte loads
// and stores), and every row's loads are issued before the first is used.
// The output is bf16, so the gate takes the hardware's exponential,
// reciprocal and reciprocal square root (each within 2 ulp of f32, far
// below a bf16 step): with the accurate ones and 64-bit row arithmetic per
// value the kernel was bound by its instructions, at half the bandwidth.
__device__ __forceinline__ void gate_output_rows(const FkdaLayerParams& p) {
  constexpr int kValues = 8;                                  // a lane's values of a row
  constexpr int kLanesPerRow = FKDA_HEAD_DIM / kValues;       // 16: a half-warp
  constexpr int kRowsPerPass = 32 / kLanesPerRow;             // 2
  constexpr int kPasses = FKDA_GATE_ROWS_PER_WARP / kRowsPerPass;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int half = lane / kLanesPerRow, v0 = kValues * (lane % kLanesPerRow);
  const int64_t heads = p.call.num_heads, rows = p.batch * p.call.seq_len * heads;
  const int64_t first = (int64_t(blockIdx.x) * FKDA_GATE_WARPS + warp) * FKDA_GATE_ROWS_PER_WARP + half;
  const FkdaActivation& gate = p.layer.out_gate;
  const FkdaOutput& out = p.call.out;

  uint16_t* out_rows[kPasses];
  const uint16_t* gate_rows[kPasses];
  int64_t token = first / heads, head = first % heads;
  int64_t b = token / p.call.seq_len, t = token % p.call.seq_len;
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    const bool live = first + kRowsPerPass * pass < rows;
    out_rows[pass] = live ? static_cast<uint16_t*>(out.data) + b * out.stride_b + t * out.stride_t +
                                head * out.stride_h + v0
                          : nullptr;
    gate_rows[pass] = static_cast<const uint16_t*>(gate.data) + b * gate.stride_b + t * gate.stride_t +
                      head * gate.stride_h + v0;
    head += kRowsPerPass;  // the half-warp's next row (heads may be fewer than kRowsPerPass)
    while (head >= heads) {
      head -= heads;
      if (++t == p.call.seq_len) {
        t = 0;
        ++b;
      }
    }
  }
  uint4 o_bits[kPasses] = {}, g_bits[kPasses] = {};  // zeros for rows past the end
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    if (out_rows[pass] == nullptr) continue;
    o_bits[pass] = *reinterpret_cast<const uint4*>(out_rows[pass]);
    g_bits[pass] = __ldg(reinterpret_cast<const uint4*>(gate_rows[pass]));
  }
  float weight[kValues];
#pragma unroll
  for (int e = 0; e < kValues; ++e) {
    weight[e] = load_real(p.layer.norm_weight, p.layer.norm_weight_is_f32 != 0,
                          int64_t(v0 + e) * p.layer.norm_weight_stride);
  }
#pragma unroll
  for (int pass = 0; pass < kPasses; ++pass) {
    // Every lane of the warp takes part in the shuffles; a row past the
    // end is computed on zeros and not stored.
    const uint32_t o_words[4] = {o_bits[pass].x, o_bits[pass].y, o_bits[pass].z, o_bits[pass].w};
    const uint32_t g_words[4] = {g_bits[pass].x, g_bits[pass].y, g_bits[pass].z, g_bits[pass].w};
    float o[kValues], squares = 0.f;
#pragma unroll
    for (int e = 0; e < kValues; ++e) {
      o[e] = e % 2 ? bf16_hi(o_words[e / 2]) : bf16_lo(o_words[e / 2]);
      squares = fmaf(o[e], o[e], squares);
    }
#pragma unroll
    for (int d = kLanesPerRow / 2; d >= 1; d >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, d);
    const float row_inverse_rms = inverse_rms(p.layer, squares);
    uint32_t packed[kValues / 2];
#pragma unroll
    for (int e = 0; e < kValues; e += 2) {
      float y[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float g = h ? bf16_hi(g_words[e / 2]) : bf16_lo(g_words[e / 2]);
        y[h] = gate_one(row_inverse_rms, weight[e + h], g, o[e + h]);
      }
      packed[e / 2] = pack_bf16x2(y[0], y[1]);
    }
    if (out_rows[pass] != nullptr) *reinterpret_cast<uint4*>(out_rows[pass]) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  }
}

}  // namespace fkda_dev

extern "C" __global__ void __launch_bounds__(FKDA_CONV_THREADS, 6) fkda_layer_convolve(const FkdaLayerParams p) {
  fkda_dev::convolve_v(p);
}
extern "C" __global__ void __launch_bounds__(FKDA_CONV_THREADS) fkda_layer_pack_conv_weights(const FkdaLayerParams p) {
  fkda_dev::pack_conv_weights(p);
}
extern "C" __global__ void __launch_bounds__(FKDA_HEAD_DIM) fkda_layer_conv_store(const FkdaLayerParams p) {
  fkda_dev::store_conv_states(p);
}
extern "C" __global__ void __launch_bounds__(32 * FKDA_GATE_WARPS) fkda_layer_gate(const FkdaLayerParams p) {
  fkda_dev::gate_output_rows(p);
}
