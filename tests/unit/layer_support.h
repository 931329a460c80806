/* SPDX-License-Identifier: MIT */
// The layer step's tensors for the tests (flashkda.h, "The layer step
// around the recurrence"): convolution weights, biases and conv states, the
// output gate and its norm weight, in the dtypes and strides a test picks,
// every byte of their buffers random (gaps included) so that a stray write
// or read shows; and the same step as the fp64 reference reads it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"

namespace layer {

using namespace fkda_ref;

// A bf16 or f32 host tensor with any strides over a buffer of `span`
// elements, each drawn from U(low, high): f32 ones keep every bit (not
// bf16 values), so that a copy through bf16 would show.
class StridedTensor {
 public:
  StridedTensor() = default;
  StridedTensor(fkda_dtype dtype, std::vector<int64_t> shape, std::vector<int64_t> strides, int64_t span,
                std::mt19937_64& rng, float low, float high)
      : dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)) {
    std::uniform_real_distribution<float> uniform(low, high);
    if (dtype_ == FKDA_DTYPE_BF16) {
      bf16_.resize(size_t(span));
      for (uint16_t& x : bf16_) x = to_bf16(uniform(rng));
    } else {
      f32_.resize(size_t(span));
      for (float& x : f32_) x = uniform(rng);
    }
  }

  bool present() const { return !shape_.empty(); }
  fkda_dtype dtype() const { return dtype_; }

  fkda_tensor tensor() {
    if (!present()) return FKDA_TENSOR_NONE;
    fkda_tensor t = fkda_ref::tensor(data(), dtype_, shape_);
    for (size_t i = 0; i < strides_.size(); ++i) t.strides[i] = strides_[i];
    return t;
  }

  float at(const std::vector<int64_t>& index) const {
    int64_t offset = 0;
    for (size_t i = 0; i < index.size(); ++i) offset += index[i] * strides_[i];
    return dtype_ == FKDA_DTYPE_BF16 ? from_bf16(bf16_[size_t(offset)]) : f32_[size_t(offset)];
  }

  void* data() { return dtype_ == FKDA_DTYPE_BF16 ? static_cast<void*>(bf16_.data()) : f32_.data(); }
  const unsigned char* raw() const {
    return dtype_ == FKDA_DTYPE_BF16 ? reinterpret_cast<const unsigned char*>(bf16_.data())
                                     : reinterpret_cast<const unsigned char*>(f32_.data());
  }
  size_t bytes() const { return bf16_.size() * 2 + f32_.size() * 4; }
  int64_t stride(size_t axis) const { return strides_[axis]; }
  int64_t extent(size_t axis) const { return shape_[axis]; }

 private:
  fkda_dtype dtype_ = FKDA_DTYPE_F32;
  std::vector<int64_t> shape_, strides_;
  std::vector<uint16_t> bf16_;
  std::vector<float> f32_;
};

// Which parts of the layer step a call takes, and in which form.
struct LayerConfig {
  int width = 0;        // W of the convolution; 0: no convolution
  int state_width = 0;  // Wc of the conv states; 0: none
  fkda_dtype weight_dtype = FKDA_DTYPE_BF16;
  fkda_dtype state_dtype = FKDA_DTYPE_F32;
  bool bias = false;
  bool out_gate = false;
  fkda_dtype norm_dtype = FKDA_DTYPE_BF16;
  // Weights and conv states channel-last ([W, H*K] and [rows, Wc, H*K] in
  // memory), the gate's rows and the norm weight strided.
  bool strided = false;

  std::string name() const {
    auto dtype = [](fkda_dtype d) { return d == FKDA_DTYPE_BF16 ? "bf16" : "f32"; };
    std::ostringstream s;
    if (width > 0) {
      s << "conv W " << width << " " << dtype(weight_dtype) << (bias ? " with bias" : " without bias");
      if (state_width > 0) s << ", conv states Wc " << state_width << " " << dtype(state_dtype);
      else s << ", no conv states";
    } else {
      s << "no conv";
    }
    s << (out_gate ? std::string(", output gate, ") + dtype(norm_dtype) + " norm weight" : ", no output gate");
    if (strided) s << ", channel-last and strided";
    return s.str();
  }
};

// The tensors of one call's layer step: H heads of K = V = 128, out_gate
// [B, T, H, V], conv states of `rows` rows.
struct LayerBuffers {
  static constexpr int64_t kD = 128;
  static constexpr int64_t kRowGap = 8;  // elements after each conv state row, never written
  LayerConfig config;
  int64_t H = 0, rows = 0;
  StridedTensor weights[3], biases[3], states[3], gate, norm_weight;
  float eps = 1e-5f;

  LayerBuffers(const LayerConfig& c, int64_t heads, int64_t B, int64_t T, int64_t state_rows, uint64_t seed)
      : config(c), H(heads), rows(state_rows) {
    std::mt19937_64 rng(seed);
    const int64_t channels = H * kD, W = c.width, Wc = c.state_width;
    for (int i = 0; i < 3 && W > 0; ++i) {
      weights[i] = c.strided ? StridedTensor(c.weight_dtype, {channels, W}, {1, channels}, channels * W, rng, -0.8f, 0.8f)
                             : StridedTensor(c.weight_dtype, {channels, W}, {W, 1}, channels * W, rng, -0.8f, 0.8f);
      if (c.bias) biases[i] = StridedTensor(c.weight_dtype, {channels}, {1}, channels, rng, -0.5f, 0.5f);
      if (Wc == 0) continue;
      const int64_t row_stride = channels * Wc + kRowGap;
      states[i] = c.strided ? StridedTensor(c.state_dtype, {rows, channels, Wc}, {row_stride, 1, channels},
                                            rows * row_stride, rng, -2.f, 2.f)
                            : StridedTensor(c.state_dtype, {rows, channels, Wc}, {row_stride, Wc, 1},
                                            rows * row_stride, rng, -2.f, 2.f);
    }
    if (c.out_gate) {
      const int64_t row = c.strided ? 2 * kD : kD;  // strided: every other row of a [B, T, H, 2V] buffer
      gate = StridedTensor(FKDA_DTYPE_BF16, {B, T, H, kD}, {T * H * row, H * row, row, 1}, B * T * H * row, rng, -3.f, 3.f);
      const int64_t step = c.strided ? 3 : 1;
      norm_weight = StridedTensor(c.norm_dtype, {kD}, {step}, kD * step, rng, 0.5f, 1.5f);
    }
  }

  fkda_layer_step tensors() {
    fkda_layer_step l = FKDA_LAYER_STEP_INIT;
    fkda_tensor* conv[] = {&l.conv_weight_q, &l.conv_weight_k, &l.conv_weight_v, &l.conv_bias_q, &l.conv_bias_k,
                           &l.conv_bias_v, &l.conv_state_q, &l.conv_state_k, &l.conv_state_v};
    for (int i = 0; i < 3; ++i) {
      *conv[i] = weights[i].tensor();
      *conv[3 + i] = biases[i].tensor();
      *conv[6 + i] = states[i].tensor();
    }
    l.out_gate = gate.tensor();
    l.out_norm_weight = norm_weight.tensor();
    l.out_norm_eps = eps;
    return l;
  }

  // Row `row` of projection i's conv state as [H*K, Wc] values.
  std::vector<float> state_row(int i, int64_t row) const {
    std::vector<float> values;
    for (int64_t c = 0; c < H * kD; ++c)
      for (int64_t j = 0; j < config.state_width; ++j) values.push_back(states[i].at({row, c, j}));
    return values;
  }

  // The rows of `row_list` (q, k and v one after the other), as a comparison reads them.
  std::vector<float> state_rows(const std::vector<int64_t>& row_list) const {
    std::vector<float> values;
    for (int i = 0; i < 3; ++i)
      for (int64_t row : row_list) {
        const std::vector<float> one = state_row(i, row);
        values.insert(values.end(), one.begin(), one.end());
      }
    return values;
  }

  // The step as the reference reads it, sequence n starting from conv state
  // row start_rows[n] (-1: zeros). Without conv states every sequence starts
  // from zeros.
  LayerStep reference(const std::vector<int64_t>& start_rows) const {
    LayerStep l;
    const int64_t channels = H * kD;
    l.conv_width = config.width;
    l.conv_state_width = config.state_width > 0 ? config.state_width : std::max(config.width - 1, 0);
    for (int i = 0; i < 3 && config.width > 0; ++i) {
      for (int64_t c = 0; c < channels; ++c) {
        for (int64_t j = 0; j < config.width; ++j) l.conv_weight[i].push_back(weights[i].at({c, j}));
        if (config.bias) l.conv_bias[i].push_back(biases[i].at({c}));
      }
      l.conv_state[i].assign(start_rows.size() * size_t(channels * l.conv_state_width), 0.f);
      if (config.state_width == 0) continue;
      for (size_t n = 0; n < start_rows.size(); ++n) {
        if (start_rows[n] < 0) continue;
        const std::vector<float> row = state_row(i, start_rows[n]);
        std::copy(row.begin(), row.end(), l.conv_state[i].begin() + std::ptrdiff_t(n * row.size()));
      }
    }
    if (config.out_gate) {
      const int64_t B = gate.extent(0), T = gate.extent(1);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t e = 0; e < kD; ++e) l.out_gate.push_back(to_bf16(gate.at({b, t, h, e})));
      for (int64_t e = 0; e < kD; ++e) l.out_norm_weight.push_back(norm_weight.at({e}));
      l.out_norm_eps = eps;
    }
    return l;
  }

  // Bytes of the conv states that differ from `before`'s outside the rows
  // in `written` (the gaps after each row always count).
  size_t conv_bytes_changed_outside(const LayerBuffers& before, const std::set<int64_t>& written) const {
    size_t changed = 0;
    for (int i = 0; i < 3; ++i) {
      if (!states[i].present()) continue;
      const size_t element = states[i].dtype() == FKDA_DTYPE_BF16 ? 2 : 4;
      const size_t row_bytes = size_t(states[i].stride(0)) * element;
      const size_t state_bytes = size_t(H * kD * config.state_width) * element;
      for (int64_t row = 0; row < rows; ++row) {
        const size_t first = size_t(row) * row_bytes;
        const size_t from = written.count(row) ? first + state_bytes : first;  // the gap only
        for (size_t b = from; b < first + row_bytes; ++b) changed += before.states[i].raw()[b] != states[i].raw()[b];
      }
    }
    return changed;
  }
};

// The largest |a - b| of a comparison whose values should agree exactly.
inline double max_abs_difference(const std::vector<float>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return 1e300;
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(double(a[i]) - b[i]));
  return worst;
}

}  // namespace layer
