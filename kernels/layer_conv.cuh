// SPDX-License-Identifier: MIT
// What fkda_fwd's two convolutions of the layer step share: the
// preparation kernel (prefill_prepare.cuh) convolves q and k as it loads
// them, fkda_layer_convolve (layer_step.cuh) stages v. One definition of
// the arithmetic and of a sequence's conv state row, so that the two
// cannot round or choose rows differently.
#pragma once

#include "device_common.cuh"

namespace fkda_dev {

// Element `at` of a bf16 or f32 tensor as its bits (bf16 in the low half),
// and the float they make: the decode kernels keep a load's bits until a
// later phase widens them (decode_recurrence.cuh).
__device__ __forceinline__ uint32_t load_real_bits(const void* data, bool is_f32, int64_t at) {
  return is_f32 ? __ldg(static_cast<const uint32_t*>(data) + at) : uint32_t(__ldg(static_cast<const uint16_t*>(data) + at));
}
__device__ __forceinline__ float real_of_bits(uint32_t bits, bool is_f32) {
  return __uint_as_float(is_f32 ? bits : bits << 16);
}
// The same load widened at once. Chosen as floats rather than composed of
// the two above, whose choice between bits then shifted them: the compiler
// laid out fkda_fwd's gate and convolution kernels differently with that.
__device__ __forceinline__ float load_real(const void* data, bool is_f32, int64_t at) {
  return is_f32 ? __uint_as_float(__ldg(static_cast<const uint32_t*>(data) + at))
                : bf16_bits(__ldg(static_cast<const uint16_t*>(data) + at));
}

// Column `col` of channel c of a conv state row. Plain loads: the store
// kernel writes these rows in a later launch of the same call.
__device__ __forceinline__ float conv_state_at(const FkdaLayerStep& layer, const FkdaConv& conv, int64_t row,
                                               int64_t c, int col) {
  const int64_t at = row * conv.state_stride_row + c * conv.state_stride_c + col * conv.state_stride_w;
  return layer.conv_state_is_f32 ? static_cast<const float*>(conv.state)[at]
                                 : bf16_bits(static_cast<const uint16_t*>(conv.state)[at]);
}

// The conv state row of sequence n, or -1 (padding: nothing touched), and
// whether the sequence reads it. The rows are those of the recurrent
// states, read where the call reads recurrent states (reads_state: an
// initial state or a pool) unless has_initial_state[n] is 0. Params:
// FkdaLayerParams or FkdaPrefillParams, which name these fields alike.
struct ConvRow {
  int64_t row;
  bool reads;
};
template <typename Params>
__device__ __forceinline__ ConvRow conv_row_of(const Params& p, bool reads_state, int64_t n) {
  ConvRow r{n, reads_state};
  if (p.state_indices.data != nullptr) {
    r.row = usable_slot(load_index(p.state_indices, n, 0), p.call.first_real_slot, p.pool_slots);
    if (r.row < 0) return ConvRow{-1, false};
  }
  if (p.has_initial_state.data != nullptr && load_index(p.has_initial_state, n, 0) == 0) r.reads = false;
  if (p.layer.conv[0].state == nullptr) r.reads = false;
  return r;
}

// Channel c's bias (0 without biases) and its weights by distance:
// weight_back[b] multiplies the input b tokens back, weight[c][W - 1 - b]
// (0 for b >= width).
__device__ __forceinline__ float conv_bias(const FkdaLayerStep& layer, const FkdaConv& conv, int64_t c) {
  return conv.bias != nullptr ? load_real(conv.bias, layer.conv_is_f32 != 0, c * conv.bias_stride) : 0.f;
}
__device__ __forceinline__ void load_weights_back(const FkdaLayerStep& layer, const FkdaConv& conv, int64_t c,
                                                  int width, float (&weight_back)[FKDA_CONV_MAX_WIDTH]) {
#pragma unroll
  for (int b = 0; b < FKDA_CONV_MAX_WIDTH; ++b) {
    const int64_t at = c * conv.weight_stride_c + (width - 1 - b) * conv.weight_stride_w;
    weight_back[b] = b < width ? load_real(conv.weight, layer.conv_is_f32 != 0, at) : 0.f;
  }
}

// A channel's weights by distance and its bias as the bits their loads
// return, for the decode kernels, which issue every load of a step before
// widening any (conv_weights): a widening next to its load, inside the
// branch that chose the load, made each load wait for the one before. The
// weights' offsets step from one to the next (one 64-bit add) instead of
// being multiplied out of the strides: on a one-sequence call's chain the
// convolution's loads were mostly address arithmetic.
struct ConvWeightBits {
  uint32_t back[FKDA_CONV_MAX_WIDTH];  // weight[W - 1 - b], 0 for b >= W
  uint32_t bias;                       // 0 without biases
};
__device__ __forceinline__ ConvWeightBits load_conv_weight_bits(const FkdaLayerStep& layer, const FkdaConv& conv,
                                                                int64_t c) {
  const bool f32 = layer.conv_is_f32 != 0;
  const int bytes_log2 = f32 ? 2 : 1;
  const int width = layer.conv_width;
  ConvWeightBits bits;
  bits.bias = conv.bias != nullptr ? load_real_bits(conv.bias, f32, c * conv.bias_stride) : 0u;
  int64_t at = (c * conv.weight_stride_c + (width - 1) * conv.weight_stride_w) << bytes_log2;  // bytes
  const int64_t step = conv.weight_stride_w << bytes_log2;
#pragma unroll
  for (int b = 0; b < FKDA_CONV_MAX_WIDTH; ++b) {
    bits.back[b] = b < width ? load_real_bits(static_cast<const unsigned char*>(conv.weight) + at, f32, 0) : 0u;
    at -= step;
  }
  return bits;
}
struct ConvWeights {
  float back[FKDA_CONV_MAX_WIDTH];
  float bias;
};
__device__ __forceinline__ ConvWeights conv_weights(const FkdaLayerStep& layer, const ConvWeightBits& bits) {
  const bool f32 = layer.conv_is_f32 != 0;
  ConvWeights w;
  w.bias = real_of_bits(bits.bias, f32);
#pragma unroll
  for (int b = 0; b < FKDA_CONV_MAX_WIDTH; ++b) w.back[b] = real_of_bits(bits.back[b], f32);
  return w;
}

// Accurate exp: the decode's convolution feeds the f32 state directly.
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// The convolution of one channel, silu(bias + sum_j weight[j] x[j]) with
// the inputs oldest first, from x_back[b], the input b tokens back (0: the
// token's own), and weight_back[b] = weight[W - 1 - b]; entries b >= width
// are not read. kRounded: the output is rounded to bf16 (fkda_fwd's), so
// SiLU takes the hardware's exponential and reciprocal (each within 2 ulp of
// f32, far below a bf16 step; the IEEE reciprocal was a fifth of the
// preparation kernel's instructions); else (the decode's, which feeds the
// f32 state directly) the accurate ones.
template <bool kRounded>
__device__ __forceinline__ float convolve_back(int width, float bias, const float (&weight_back)[FKDA_CONV_MAX_WIDTH],
                                               const float (&x_back)[FKDA_CONV_MAX_WIDTH]) {
  float acc = bias;
#pragma unroll
  for (int b = FKDA_CONV_MAX_WIDTH - 1; b >= 0; --b) {
    if (b < width) acc = fmaf(weight_back[b], x_back[b], acc);
  }
  if (kRounded) return acc * sigmoid_fast(acc);
  return silu(acc);
}
__device__ __forceinline__ float convolve_rounded(int width, float bias,
                                                  const float (&weight_back)[FKDA_CONV_MAX_WIDTH],
                                                  const float (&x_back)[FKDA_CONV_MAX_WIDTH]) {
  return convolve_back<true>(width, bias, weight_back, x_back);
}

}  // namespace fkda_dev
