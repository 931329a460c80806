// SPDX-License-Identifier: MIT
// The set compute-sanitizer runs (gpu_check.sh: memcheck, racecheck,
// synccheck), small enough to finish in minutes under a sanitizer yet
// reaching every kernel variant and path: the recurrence kernel of each V
// split (1, 2, 4, 8), a sequence of more chunks than the copy ring has
// stages (so the ring wraps and its stages are reused), several windows with
// states carried between them, i32 and strided offsets, empty sequences,
// bf16 and f32 states in both layouts, absent states and a state updated in
// place. Each case is also checked for accuracy like any other.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "prefill_harness.h"

using namespace fkda_test;

TEST_CASE("sanitize: every recurrence kernel, ring wrap-around, windows, offsets and states", "[gpu][sanitize]") {
  // 100 tokens: 7 chunks, more than the 4 stages of the copy ring.
  const std::vector<int64_t> lengths = {0, 1, 17, 100};
  for (int64_t vsplit : {1, 2, 4, 8}) {
    for (int64_t window_slots : {0, 3}) {
      const bool f32 = vsplit % 2 == 0;
      Case c = with_state(varlen("", lengths, 2, 300 + uint64_t(vsplit) + uint64_t(window_slots)),
                          f32 ? FKDA_DTYPE_F32 : FKDA_DTYPE_BF16, window_slots ? FKDA_STATE_LAYOUT_KV
                                                                               : FKDA_STATE_LAYOUT_VK,
                          true, true);
      c.vsplit = vsplit;
      c.window_slots = window_slots;
      c.offsets_dtype = window_slots ? FKDA_DTYPE_I32 : FKDA_DTYPE_I64;
      c.offsets_stride = vsplit <= 2 ? 2 : 1;
      c.name = "sanitize vsplit=" + std::to_string(vsplit) + " window_slots=" + std::to_string(window_slots);
      const Checked checked = check_case(slowly_decaying(c));
      if (window_slots) CHECK(checked.launch.windows > 1);
    }
  }
}

TEST_CASE("sanitize: absent states and padded activations", "[gpu][sanitize]") {
  for (int presence = 0; presence < 3; ++presence) {
    const bool initial = presence == 1, final = presence == 2;
    Case c = with_state(batched("", 2, 70, 2, 310 + uint64_t(presence)), FKDA_DTYPE_BF16, FKDA_STATE_LAYOUT_KV,
                        initial, final);
    c.arrangement = presence == 0 ? Arrangement::kPadded : Arrangement::kHeadMajor;
    c.window_slots = 2;
    c.name = "sanitize initial=" + std::to_string(initial) + " final=" + std::to_string(final);
    check_case(c);
  }
}
