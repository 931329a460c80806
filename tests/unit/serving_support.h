/* SPDX-License-Identifier: MIT */
// What the serving tests share: CPU plans with a null-slot rule, state pools
// with poisoned gaps between slots, and exact checks that a call wrote only
// what it should.
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "flashkda.h"
#include "kda_reference.h"
#include "resource_owners.h"
#include "status_checks.h"

namespace serving {

using namespace fkda_ref;

constexpr int64_t kD = 128;  // K = V
constexpr int64_t kHeadState = kD * kD;
// bf16 quiet NaN with a payload no computation produces: poisoned outputs.
constexpr uint16_t kPoisonBf16 = 0x7FC1;

struct PlanOptions {
  fkda_dtype state_dtype = FKDA_DTYPE_F32;
  fkda_state_layout layout = FKDA_STATE_LAYOUT_VK;
  fkda_null_slot_rule null_rule = FKDA_NULL_SLOT_NEGATIVE;
  int32_t debug_checks = 0;
  int32_t gate_mode = FKDA_GATE_BOUNDED;  // at lower_bound -5
  int32_t beta_mode = FKDA_BETA_LOGITS;
  int32_t layer_step = 0;  // 1: fkda_fwd may take the layer step's convolution
  int32_t chunk_parallel = FKDA_CHUNK_PARALLEL_AUTO;
  int64_t segment_chunks = 0;
};

class CpuPlan {
 public:
  CpuPlan(int64_t H, const PlanOptions& o = {}) : plan_(desc(H, o)) {}
  fkda_plan_t get() const { return plan_.get(); }

  fkda_status fwd(const fkda_fwd_args& args) const {
    size_t bytes = 0;
    REQUIRE(fkda_plan_workspace_size(get(), args.q.shape[0] * args.q.shape[1],
                                     args.cu_seqlens.rank ? args.cu_seqlens.shape[0] - 1 : args.q.shape[0],
                                     &bytes) == FKDA_SUCCESS);
    std::vector<unsigned char> workspace(bytes + 16);
    return fkda_fwd(get(), &args, workspace.data(), bytes, nullptr);
  }
  fkda_status decode(const fkda_decode_args& args) const { return fkda_decode(get(), &args, nullptr, 0, nullptr); }

 private:
  static fkda_plan_desc desc(int64_t H, const PlanOptions& o) {
    fkda_plan_desc d = FKDA_PLAN_DESC_INIT;
    d.num_heads = int32_t(H);
    d.backend = FKDA_BACKEND_CPU;
    d.state_dtype = o.state_dtype;
    d.state_layout = o.layout;
    d.null_slot_rule = o.null_rule;
    d.debug_checks = o.debug_checks;
    d.gate_mode = o.gate_mode;
    d.beta_mode = o.beta_mode;
    d.layer_step = o.layer_step;
    d.chunk_parallel = o.chunk_parallel;
    d.segment_chunks = o.segment_chunks;
    return d;
  }
  fkda_ref::Plan plan_;
};

// A pool of `slots` states [H, V, K] (or KV) with a gap of kGap elements after
// each slot. Every element, gaps included, starts as a random value (bf16
// representable, so a bf16 pool holds exactly what the reference reads).
struct Pool {
  static constexpr int64_t kGap = 64;
  int64_t slots, H;
  fkda_dtype dtype;
  fkda_state_layout layout;
  int64_t slot_stride;
  std::vector<float> f32;
  std::vector<uint16_t> bf16;

  Pool(int64_t slot_count, int64_t heads, fkda_dtype state_dtype, uint64_t seed,
       fkda_state_layout state_layout = FKDA_STATE_LAYOUT_VK)
      : slots(slot_count), H(heads), dtype(state_dtype), layout(state_layout), slot_stride(heads * kHeadState + kGap) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal(0.f, 1.f);
    const size_t count = size_t(slots * slot_stride);
    if (dtype == FKDA_DTYPE_BF16) {
      bf16.resize(count);
      for (uint16_t& x : bf16) x = to_bf16(normal(rng));
    } else {
      f32.resize(count);
      for (float& x : f32) x = from_bf16(to_bf16(normal(rng)));
    }
  }

  void* data() { return dtype == FKDA_DTYPE_BF16 ? static_cast<void*>(bf16.data()) : f32.data(); }
  size_t bytes() const { return dtype == FKDA_DTYPE_BF16 ? bf16.size() * 2 : f32.size() * 4; }
  const unsigned char* raw() const {
    return dtype == FKDA_DTYPE_BF16 ? reinterpret_cast<const unsigned char*>(bf16.data())
                                    : reinterpret_cast<const unsigned char*>(f32.data());
  }

  fkda_tensor tensor() {
    fkda_tensor t = fkda_ref::tensor(data(), dtype, {slots, H, kD, kD});
    t.strides[0] = slot_stride;
    return t;
  }

  size_t at(int64_t slot, int64_t h, int64_t e, int64_t k) const {
    const int64_t inner = layout == FKDA_STATE_LAYOUT_KV ? k * kD + e : e * kD + k;
    return size_t(slot * slot_stride + h * kHeadState + inner);
  }

  // The slot's [H, V, K] state, V-first, as f32.
  std::vector<float> state(int64_t slot) const {
    std::vector<float> values(size_t(H * kHeadState));
    for (int64_t h = 0; h < H; ++h)
      for (int64_t e = 0; e < kD; ++e)
        for (int64_t k = 0; k < kD; ++k) {
          const size_t i = at(slot, h, e, k);
          values[size_t((h * kD + e) * kD + k)] = dtype == FKDA_DTYPE_BF16 ? from_bf16(bf16[i]) : f32[i];
        }
    return values;
  }

  // States of these slots one after the other ([N, H, V, K]); zeros for null slots.
  std::vector<float> states(const std::vector<int64_t>& slot_list, fkda_null_slot_rule rule) const {
    std::vector<float> all;
    for (int64_t slot : slot_list) {
      const bool null = rule == FKDA_NULL_SLOT_NONPOSITIVE ? slot <= 0 : slot < 0;
      const std::vector<float> one = null ? std::vector<float>(size_t(H * kHeadState), 0.f) : state(slot);
      all.insert(all.end(), one.begin(), one.end());
    }
    return all;
  }
};

// States in a dtype, contiguous [N, H, V, K], from f32 values.
struct States {
  fkda_dtype dtype;
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  States(fkda_dtype d, const std::vector<float>& values) : dtype(d) {
    if (d == FKDA_DTYPE_BF16)
      for (float x : values) bf16.push_back(to_bf16(x));
    else
      f32 = values;
  }
  void* data() { return dtype == FKDA_DTYPE_BF16 ? static_cast<void*>(bf16.data()) : f32.data(); }
  std::vector<float> values() const { return dtype == FKDA_DTYPE_BF16 ? bf16_to_float(bf16) : f32; }
};

// Bytes that differ between `before` and `after` outside the slots in
// `written` (the gaps between slots always count). A call must leave them all alone.
inline size_t bytes_changed_outside(const Pool& before, const Pool& after, const std::set<int64_t>& written) {
  const size_t element = before.dtype == FKDA_DTYPE_BF16 ? 2 : 4;
  const size_t slot_bytes = size_t(before.slot_stride) * element;
  const size_t state_bytes = size_t(before.H * kHeadState) * element;
  size_t changed = 0;
  for (int64_t slot = 0; slot < before.slots; ++slot) {
    const size_t first = size_t(slot) * slot_bytes;
    const size_t from = written.count(slot) ? first + state_bytes : first;  // the gap only
    for (size_t b = from; b < first + slot_bytes; ++b) changed += before.raw()[b] != after.raw()[b];
  }
  return changed;
}

// Rows [B*T*H, V] of a bf16 output; tokens listed in `rows` must be exactly
// zero in every head, every other row written (no poison left).
struct OutputRows {
  size_t poisoned = 0;
  size_t nonzero_padding = 0;
};
inline OutputRows inspect_rows(const std::vector<uint16_t>& out, int64_t H, const std::set<int64_t>& zero_tokens) {
  OutputRows result;
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t token = int64_t(i) / (H * kD);
    if (zero_tokens.count(token)) {
      result.nonzero_padding += out[i] != 0;
    } else {
      result.poisoned += out[i] == kPoisonBf16;
    }
  }
  return result;
}

// Values of these tokens' rows (all heads), in order: the part of an output
// a comparison should look at.
template <typename T>
std::vector<T> token_rows(const std::vector<T>& out, int64_t H, const std::vector<int64_t>& tokens) {
  std::vector<T> rows;
  const size_t row = size_t(H * kD);
  for (int64_t t : tokens) rows.insert(rows.end(), out.begin() + std::ptrdiff_t(t * row), out.begin() + std::ptrdiff_t((t + 1) * row));
  return rows;
}

inline std::vector<double> widen(const std::vector<float>& values) { return {values.begin(), values.end()}; }

// How far a deliberately wrong variant lands from the check's tolerance:
// printed, and required to be wide, so that the check is known to bite.
inline void require_mutation_caught(const char* what, double mutated_error, double tolerance) {
  const double margin = mutated_error / tolerance;
  WARN("mutation check, " << what << ": error " << mutated_error << " = " << margin << " x the tolerance "
                          << tolerance);
  CHECK(margin > 10.0);
}

}  // namespace serving
