// SPDX-License-Identifier: MIT
// What fkda_fwd's two forms of the output gate share: fkda_layer_gate
// (layer_step.cuh), which gates the recurrence's bf16 output in a launch of
// its own, and the recurrence kernels' gated forms (prefill_recurrence.cuh),
// which gate each chunk's output before writing it. One definition of the
// arithmetic, so that the two cannot round differently:
//   out = o * inverse_rms * w * sigmoid(g_out),
//   inverse_rms = 1 / sqrt(sum of the squares of the head's 128 o / 128 + eps)
// with o the recurrence's output rounded to bf16 (what the unfused sequence
// reads back). The result is bf16, so the gate takes the hardware's
// exponential, reciprocal and reciprocal square root (each within 2 ulp of
// f32, far below a bf16 step).
#pragma once

#include "device_common.cuh"
#include "layer_conv.cuh"

namespace fkda_dev {

// A lane's share of a (token, head) row: eight consecutive values, one
// 16-byte load or store.
constexpr int kGateLaneValues = 8;

// w[first + e] for the lane's eight values, widened to f32.
__device__ __forceinline__ void load_norm_weights(const FkdaLayerStep& layer, int first,
                                                  float (&weight)[kGateLaneValues]) {
#pragma unroll
  for (int e = 0; e < kGateLaneValues; ++e) {
    weight[e] = load_real(layer.norm_weight, layer.norm_weight_is_f32 != 0, int64_t(first + e) * layer.norm_weight_stride);
  }
}

// The sum of the squares of the lane's eight bf16 values.
__device__ __forceinline__ float sum_squares8(const uint4& o_bits) {
  const uint32_t words[4] = {o_bits.x, o_bits.y, o_bits.z, o_bits.w};
  float squares = 0.f;
#pragma unroll
  for (int e = 0; e < kGateLaneValues; ++e) {
    const float o = e % 2 ? bf16_hi(words[e / 2]) : bf16_lo(words[e / 2]);
    squares = fmaf(o, o, squares);
  }
  return squares;
}

__device__ __forceinline__ float gate_inverse_rms(const FkdaLayerStep& layer, float sum_squares) {
  return rsqrtf(sum_squares * (1.0f / float(FKDA_HEAD_DIM)) + layer.norm_eps);
}

// The lane's eight gated values, bf16, from its o and g_out (bf16 bits).
__device__ __forceinline__ uint4 gate8(const uint4& o_bits, const uint4& g_bits, float inverse_rms,
                                       const float (&weight)[kGateLaneValues]) {
  const uint32_t o_words[4] = {o_bits.x, o_bits.y, o_bits.z, o_bits.w};
  const uint32_t g_words[4] = {g_bits.x, g_bits.y, g_bits.z, g_bits.w};
  uint32_t packed[kGateLaneValues / 2];
#pragma unroll
  for (int e = 0; e < kGateLaneValues; e += 2) {
    float y[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float o = h ? bf16_hi(o_words[e / 2]) : bf16_lo(o_words[e / 2]);
      const float g = h ? bf16_hi(g_words[e / 2]) : bf16_lo(g_words[e / 2]);
      y[h] = o * inverse_rms * weight[e + h] * sigmoid_fast(g);
    }
    packed[e / 2] = pack_bf16x2(y[0], y[1]);
  }
  return make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

}  // namespace fkda_dev
