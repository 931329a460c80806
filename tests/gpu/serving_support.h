/* SPDX-License-Identifier: MIT */
// What the serving tests share (decode and prefill by pool slot): state pools
// on the host and the device, scattered slot choices, the fp64 reference of
// one sequence from a given state, integer tensors for indices and offsets,
// and error reports that name the case.
#pragma once

#include "gpu_support.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace fkda_ref {

constexpr int64_t kMatrixElements = 128 * 128;
// Elements between the end of one slot's [H, V, K] block and the next slot:
// a free slot stride, and bytes that must stay untouched.
constexpr int64_t kSlotGap = 64;

inline size_t dtype_bytes(fkda_dtype dtype) { return dtype == FKDA_DTYPE_BF16 ? 2 : 4; }

// Element i of bf16 or f32 state bytes, as f32 (bf16 rounded to nearest even on the way in).
inline void store_state_element(std::vector<unsigned char>& bytes, fkda_dtype dtype, size_t i, float value) {
  if (dtype == FKDA_DTYPE_BF16) {
    const uint16_t bits = to_bf16(value);
    std::memcpy(bytes.data() + i * 2, &bits, 2);
  } else {
    std::memcpy(bytes.data() + i * 4, &value, 4);
  }
}
inline float load_state_element(const std::vector<unsigned char>& bytes, fkda_dtype dtype, size_t i) {
  if (dtype == FKDA_DTYPE_BF16) {
    uint16_t bits;
    std::memcpy(&bits, bytes.data() + i * 2, 2);
    return from_bf16(bits);
  }
  float value;
  std::memcpy(&value, bytes.data() + i * 4, 4);
  return value;
}

// f32 values as a dtype would hold them (bf16: rounded to nearest even).
inline std::vector<float> rounded_to(const std::vector<float>& values, fkda_dtype dtype) {
  if (dtype != FKDA_DTYPE_BF16) return values;
  std::vector<float> r(values.size());
  for (size_t i = 0; i < values.size(); ++i) r[i] = from_bf16(to_bf16(values[i]));
  return r;
}

// A state pool [slots, H, V, K] (or [slots, H, K, V]) with a slot stride of
// H V K + kSlotGap elements, on the host. Every byte starts random (finite
// values N(0, 1) in the pool's dtype, the gaps included), so a write where
// none belongs and a slot read as zeros both show.
struct HostPool {
  int64_t slots = 0, H = 0;
  fkda_dtype dtype = FKDA_DTYPE_F32;
  fkda_state_layout layout = FKDA_STATE_LAYOUT_VK;
  std::vector<unsigned char> bytes;

  HostPool(int64_t slot_count, int64_t heads, fkda_dtype state_dtype, fkda_state_layout state_layout, uint64_t seed)
      : slots(slot_count), H(heads), dtype(state_dtype), layout(state_layout),
        bytes(size_t(slot_count * slot_stride()) * dtype_bytes(state_dtype)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const size_t count = bytes.size() / dtype_bytes(dtype);
    for (size_t i = 0; i < count; ++i) store_element(i, normal(rng));
  }

  int64_t slot_stride() const { return H * kMatrixElements + kSlotGap; }

  // Element (slot, h, e, k) of the V-first view, wherever the layout puts it.
  size_t element_index(int64_t slot, int64_t h, int64_t e, int64_t k) const {
    const int64_t inner = layout == FKDA_STATE_LAYOUT_VK ? e * 128 + k : k * 128 + e;
    return size_t(slot * slot_stride() + h * kMatrixElements + inner);
  }
  void store_element(size_t i, float value) { store_state_element(bytes, dtype, i, value); }
  float load_element(size_t i) const { return load_state_element(bytes, dtype, i); }

  // A slot's H matrices as f32 [H, V, K] (V-first), exactly as stored.
  std::vector<float> get(int64_t slot) const {
    std::vector<float> vk(size_t(H * kMatrixElements));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < 128; ++e)
        for (int64_t k = 0; k < 128; ++k)
          vk[size_t((h * 128 + e) * 128 + k)] = load_element(element_index(slot, h, e, k));
    return vk;
  }
  // [H, V, K] f32 values into a slot, rounded to the pool's dtype.
  void put(int64_t slot, const float* vk) {
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < 128; ++e)
        for (int64_t k = 0; k < 128; ++k) store_element(element_index(slot, h, e, k), vk[(h * 128 + e) * 128 + k]);
  }

  // The bytes of a slot's [H, V, K] block (the gap after it excluded).
  size_t slot_first_byte(int64_t slot) const { return size_t(slot * slot_stride()) * dtype_bytes(dtype); }
  size_t slot_bytes() const { return size_t(H * kMatrixElements) * dtype_bytes(dtype); }

  fkda_tensor view(void* data) const {
    fkda_tensor t = tensor(data, dtype, {slots, H, 128, 128});
    t.strides[0] = slot_stride();
    return t;
  }
};

// Bytes of `after` that differ from `before` outside the listed slots'
// blocks (gaps included): writes where none belongs.
inline size_t touched_outside(const HostPool& pool, const std::vector<unsigned char>& before,
                              const std::vector<unsigned char>& after, const std::vector<int64_t>& written_slots) {
  std::vector<char> allowed(before.size(), 0);
  for (int64_t slot : written_slots) {
    if (slot < 0 || slot >= pool.slots) continue;
    std::fill_n(allowed.begin() + std::ptrdiff_t(pool.slot_first_byte(slot)), pool.slot_bytes(), 1);
  }
  size_t touched = 0;
  for (size_t i = 0; i < before.size(); ++i) touched += !allowed[i] && before[i] != after[i];
  return touched;
}

// `count` distinct slots in [first, slots), scattered over the pool.
inline std::vector<int64_t> scattered_slots(int64_t count, int64_t first, int64_t slots, uint64_t seed) {
  std::vector<int64_t> all(size_t(slots - first));
  std::iota(all.begin(), all.end(), first);
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(size_t(count));
  return all;
}

// i64, i32 or bool values as the bytes of a device tensor.
inline std::vector<unsigned char> integer_bytes(const std::vector<int64_t>& values, fkda_dtype dtype) {
  const size_t width = dtype == FKDA_DTYPE_I64 ? 8 : dtype == FKDA_DTYPE_I32 ? 4 : 1;
  std::vector<unsigned char> bytes(values.size() * width);
  for (size_t i = 0; i < values.size(); ++i) {
    if (width == 8) {
      std::memcpy(bytes.data() + i * 8, &values[i], 8);
    } else if (width == 4) {
      const int32_t narrow = int32_t(values[i]);
      std::memcpy(bytes.data() + i * 4, &narrow, 4);
    } else {
      bytes[i] = values[i] != 0 ? 1 : 0;
    }
  }
  return bytes;
}

// The smallest real slot under a null-slot rule, and a null index of it,
// varied by sequence (-1, -2, -3, and 0 where it is null).
inline int64_t first_real_slot(fkda_null_slot_rule rule) { return rule == FKDA_NULL_SLOT_NONPOSITIVE ? 1 : 0; }
inline int64_t null_index(fkda_null_slot_rule rule, int64_t n) {
  if (rule == FKDA_NULL_SLOT_NONPOSITIVE && n % 2 == 0) return 0;
  return -1 - n % 3;
}

// Tokens [begin, begin + length) of sequence n of p.
struct SequenceTokens {
  int64_t row, begin, length;
};
inline SequenceTokens tokens_of(const Problem& p, int64_t n) {
  if (p.cu_seqlens.empty()) return {n, 0, p.T};
  return {0, p.cu_seqlens[size_t(n)], p.cu_seqlens[size_t(n) + 1] - p.cu_seqlens[size_t(n)]};
}

// The fp64 recurrence over the first `count` tokens of the sequence at `s`
// in p's activations, starting from `initial` ([H, V, K] f32, V-first),
// under p's gate and beta modes.
inline Reference sequence_reference(const Problem& p, const SequenceTokens& s, int64_t count,
                                    const std::vector<float>& initial) {
  Problem one;
  one.B = 1;
  one.T = count;
  one.H = p.H;
  one.scale = p.scale;
  one.lower_bound = p.lower_bound;
  one.gate_mode = p.gate_mode;
  one.beta_mode = p.beta_mode;
  one.A_log = p.A_log;
  one.dt_bias = p.dt_bias;
  one.initial_state = initial;
  const size_t row = size_t(p.H * 128), beta_row = size_t(p.H);
  auto slice = [&](const std::vector<uint16_t>& all, size_t width) {
    const size_t first = size_t(s.row * p.T + s.begin) * width;
    return std::vector<uint16_t>(all.begin() + std::ptrdiff_t(first),
                                 all.begin() + std::ptrdiff_t(first + size_t(count) * width));
  };
  one.q = slice(p.q, row);
  one.k = slice(p.k, row);
  one.v = slice(p.v, row);
  one.g = slice(p.g, row);
  one.beta = slice(p.beta, beta_row);
  auto slice_f32 = [&](const std::vector<float>& all, size_t width) {
    if (all.empty()) return all;
    const size_t first = size_t(s.row * p.T + s.begin) * width;
    return std::vector<float>(all.begin() + std::ptrdiff_t(first),
                              all.begin() + std::ptrdiff_t(first + size_t(count) * width));
  };
  one.g_f32 = slice_f32(p.g_f32, row);
  one.beta_f32 = slice_f32(p.beta_f32, beta_row);
  return reference_recurrence(one);
}

// The plan for p's gate and beta modes (and floor, for the bounded gate).
inline fkda_plan_desc serving_desc(const Problem& p, fkda_dtype state_dtype, fkda_state_layout layout,
                                   fkda_backend backend = FKDA_BACKEND_GPU,
                                   fkda_null_slot_rule rule = FKDA_NULL_SLOT_NEGATIVE) {
  fkda_plan_desc desc = plan_desc(p.H, p.lower_bound, state_dtype, layout, backend, rule);
  apply_gate(p, &desc);
  return desc;
}

inline std::vector<double> widen(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// A slow-decay problem whose states come from a pool (none of its own):
// B rows of T tokens, or packed sequences of the given lengths, under the
// gate mode given.
inline Problem pool_problem(int64_t B, int64_t T, int64_t H, const std::vector<int64_t>& lengths, uint64_t seed,
                            int32_t gate_mode = FKDA_GATE_BOUNDED) {
  ProblemShape shape;
  shape.H = H;
  if (lengths.empty()) {
    shape.B = B;
    shape.T = T;
  } else {
    shape.lengths = lengths;
  }
  shape = slow_decay(shape);
  shape.gate_mode = gate_mode;
  if (gate_mode == FKDA_GATE_LOG_DECAY) {
    // g is the log-decay itself: slow_decay's logits would forget at once.
    shape.gate_mean = -0.05f;
    shape.gate_std = 0.05f;
  }
  shape.with_initial_state = false;
  return random_problem(shape, seed);
}

// A case of packed sequences of these lengths, for any case type with a
// name, lengths, H and seed.
template <typename Case>
Case packed_case(std::string name, std::vector<int64_t> lengths, int64_t H, uint64_t seed) {
  Case c;
  c.name = std::move(name);
  c.lengths = std::move(lengths);
  c.H = H;
  c.seed = seed;
  return c;
}

// A relative L2 error and its tolerance, for the report and the check.
struct Accuracy {
  const char* what;
  double error;
  double tolerance;
  bool ok() const { return error <= tolerance; }
};

inline void report(const std::string& name, const std::vector<Accuracy>& figures) {
  std::printf("%-44s", name.c_str());
  for (const Accuracy& a : figures) std::printf("  %s %.3e (<= %.1e)%s", a.what, a.error, a.tolerance, a.ok() ? "" : " FAIL");
  std::printf("\n");
  std::fflush(stdout);
}

// A mutation check: the check of `what` applied to a deliberately wrong
// result must fail by a wide margin, else the check could not see the fault.
inline void require_detected(const std::string& name, const char* what, double error, double tolerance,
                             double margin = 10.0) {
  std::printf("%-44s  mutation (%s): error %.3e = %.0fx the tolerance %.1e\n", name.c_str(), what, error,
              error / tolerance, tolerance);
  std::fflush(stdout);
  CHECK(error > margin * tolerance);
}

}  // namespace fkda_ref
