// SPDX-License-Identifier: MIT
// The GPU prefill against the fp64 recurrence (docs/BENCHMARKS.md targets) and
// the CPU backend (docs/NUMERICS.md agreement) on random inputs: the
// benchmark cases, sequence lengths around the chunk size, memory
// arrangements, gate floors, correlated keys and saturated gates
// (prefill_harness.h runs and checks each case).
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "prefill_harness.h"

using namespace fkda_test;

namespace {

const char* dtype_name(fkda_dtype dtype) { return dtype == FKDA_DTYPE_F32 ? "f32" : "bf16"; }

}  // namespace

TEST_CASE("prefill: docs/BENCHMARKS.md accuracy cases", "[gpu][window]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    const std::string suffix = std::string(" ") + dtype_name(dtype);
    const Case dense = with_state(batched("T=1024 H=4" + suffix, 1, 1024, 4, 11), dtype, FKDA_STATE_LAYOUT_VK,
                                  true, true);
    const Case packed = with_state(varlen("varlen [300,77,700] H=4" + suffix, {300, 77, 700}, 4, 12), dtype,
                                   FKDA_STATE_LAYOUT_VK, true, true);
    for (const Case& c : {dense, packed, slowly_decaying(dense), slowly_decaying(packed)}) check_case(c);
  }
}

TEST_CASE("prefill: varlen with empty, short, chunk-edge and long sequences", "[gpu][vsplit][window]") {
  const std::vector<int64_t> lengths = {0, 1, 15, 16, 17, 0, 33, 200, 5, 0};
  for (fkda_dtype offsets : {FKDA_DTYPE_I64, FKDA_DTYPE_I32}) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
        Case c = with_state(varlen("edges", lengths, 3, 21 + dtype + 10 * layout), dtype, layout, true, true);
        c.offsets_dtype = offsets;
        c.name = std::string("edges ") + (offsets == FKDA_DTYPE_I64 ? "i64 " : "i32 ") + dtype_name(dtype) +
                 (layout == FKDA_STATE_LAYOUT_VK ? " VK" : " KV");
        check_case(c);
        if (offsets == FKDA_DTYPE_I32) check_case(slowly_decaying(c));
      }
    }
  }
}

TEST_CASE("prefill: strided activations and offsets", "[gpu][vsplit][window]") {
  Case padded = varlen("padded rows, i32 offsets", {40, 0, 17, 64}, 3, 41);
  padded.arrangement = Arrangement::kPadded;
  padded.offsets_dtype = FKDA_DTYPE_I32;
  padded.offsets_stride = 3;
  check_case(padded);

  Case head_major = with_state(batched("head-major [B,H,T,D]", 2, 70, 3, 42), FKDA_DTYPE_BF16,
                               FKDA_STATE_LAYOUT_KV, true, true);
  head_major.arrangement = Arrangement::kHeadMajor;
  check_case(head_major);

  Case padded_batched = batched("padded batched", 3, 19, 2, 43);
  padded_batched.arrangement = Arrangement::kPadded;
  check_case(padded_batched);
}

TEST_CASE("prefill: gate floors other than -5", "[gpu]") {
  for (float lower_bound : {-0.5f, 0.0f, -3.25f}) {
    Case c = batched("lower_bound " + std::to_string(lower_bound), 2, 80, 2, 61);
    c.shape.lower_bound = lower_bound;
    check_case(c);
  }
}

TEST_CASE("prefill: correlated keys, so that the chunk inverse has large powers", "[gpu]") {
  // Keys sharing a direction (cosine about 0.5) and betas shifted towards 1
  // make L's entries large, so L^2, L^4 and L^8 cancel in (I + L)^-1 (the
  // more so under a weak gate): the tensor-core products of the inverse must
  // keep the CPU backend's f32-level agreement there.
  for (float lower_bound : {-5.0f, -0.5f}) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      Case c = with_state(varlen("correlated keys", {16, 100, 333}, 2, 131), dtype, FKDA_STATE_LAYOUT_VK, true,
                          true);
      c.name = "correlated keys lb " + std::to_string(lower_bound) + " " + dtype_name(dtype);
      c.shape.lower_bound = lower_bound;
      c.key_shift = 1.0f;
      c.beta_shift = 1.0f;
      check_case(c);
    }
  }
}

TEST_CASE("prefill: saturated gates scale the keys of a chunk by up to 2^115", "[gpu]") {
  // Every chunk saturated, and saturated chunks alternating with slowly
  // decaying ones, so that the state crosses from one kind to the other.
  for (Saturation saturation : {Saturation::kEveryChunk, Saturation::kEveryOtherChunk}) {
    for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
      Case c = slowly_decaying(with_state(varlen("", {16, 40, 0, 75}, 2, 1150), dtype, FKDA_STATE_LAYOUT_VK,
                                          true, true));
      c.saturation = saturation;
      c.slow = false;  // the saturated chunks forget the state: the general targets apply
      c.name = std::string(saturation == Saturation::kEveryChunk ? "saturated every chunk " : "saturated every other ") +
               dtype_name(dtype);
      check_case(c);
    }
  }
}
