// SPDX-License-Identifier: MIT
// States through the GPU prefill: every presence of initial and final state,
// empty sequences, a sequence continued from its own final state, and the
// checks that show the comparison against the fp64 recurrence can see a
// state that is lost or damaged (at the start, at a chunk hand-off between
// calls, at a window boundary inside a call). Slow-decay inputs make the
// state carry most of the output; on the default fast decays a lost initial
// state changes the final state by less than 1e-10.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "prefill_harness.h"

using namespace fkda_test;

namespace {

// Tokens [begin, end) of a single-row problem, starting from `initial` (f32,
// V-first; empty: zeros).
Problem tokens_from(const Problem& p, int64_t begin, int64_t end, std::vector<float> initial) {
  Problem part = fkda_ref::token_range(p, 0, begin, end);
  part.initial_state = std::move(initial);
  return part;
}

template <typename T>
std::vector<T> tail(const std::vector<T>& all, size_t from) {
  return std::vector<T>(all.begin() + std::ptrdiff_t(from), all.end());
}

void print_margin(const char* what, double out_error, double state_error, const fkda_ref::AccuracyTargets& targets) {
  std::printf("GPU mutation %-36s out %.3e (%6.1fx target)  final state %.3e (%6.1fx target)\n", what, out_error,
              out_error / targets.out, state_error, state_error / targets.state);
  std::fflush(stdout);
}

}  // namespace

TEST_CASE("prefill: every presence of initial and final state", "[gpu][state][vsplit][window]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    for (int presence = 0; presence < 4; ++presence) {
      const bool initial = presence & 1, final = presence & 2;
      Case c = with_state(batched("presence", 2, 45, 2, 31 + presence), dtype,
                          presence == 3 ? FKDA_STATE_LAYOUT_KV : FKDA_STATE_LAYOUT_VK, initial, final);
      c.name = std::string("presence ") + (dtype == FKDA_DTYPE_F32 ? "f32" : "bf16") + " initial=" +
               std::to_string(initial) + " final=" + std::to_string(final);
      check_case(c);
      check_case(slowly_decaying(c));
    }
  }
}

TEST_CASE("prefill: zero-length sequences copy their initial state bit for bit", "[gpu][state][window]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    const Case c = slowly_decaying(
        with_state(varlen("empties", {0, 20, 0, 0}, 2, 71), dtype, FKDA_STATE_LAYOUT_KV, true, true));
    const Problem p = problem_of(c);
    const Arenas arenas(p, c);
    DeviceCase device(p, c, arenas);
    device.run(nullptr);
    const Result result = device.fetch();
    const size_t matrix = state_bytes(128 * 128, dtype);
    for (int64_t n : {0, 2, 3}) {
      for (int64_t h = 0; h < p.H; ++h) {
        const size_t at = size_t(n * p.H + h) * matrix;
        CHECK(std::memcmp(result.final.data() + at, arenas.initial.data() + at, matrix) == 0);
      }
    }
    // Without an initial state they end at exactly zero.
    Case zero = c;
    zero.shape.with_initial_state = false;
    const Problem pz = problem_of(zero);
    const std::vector<float> state = run_gpu(pz, zero).state;
    for (int64_t n : {0, 2, 3})
      for (size_t i = size_t(n * pz.H) * 128 * 128; i < size_t((n + 1) * pz.H) * 128 * 128; ++i)
        REQUIRE(state[i] == 0.0f);
  }
}

TEST_CASE("prefill: a sequence split at a chunk boundary equals the whole", "[gpu][state][window]") {
  // With f32 state and a split at a multiple of 16 the chunks are the same,
  // so the state handed from the first half to the second is exact.
  for (bool slow : {false, true}) {
    Case whole = batched("whole", 1, 96, 2, 81);
    if (slow) whole = slowly_decaying(whole);
    INFO(whole.name);
    const Problem p = problem_of(whole);
    const Outputs all = run_gpu(p, whole);
    const Outputs first = run_gpu(tokens_from(p, 0, 48, p.initial_state), whole);
    const Outputs second = run_gpu(tokens_from(p, 48, 96, first.state), whole);

    std::vector<float> halves = first.out;
    halves.insert(halves.end(), second.out.begin(), second.out.end());
    CHECK(halves == all.out);
    CHECK(second.state == all.state);
    const fkda_ref::Reference ref = fkda_ref::reference_recurrence(p);
    CHECK(fkda_ref::rel_l2(halves, ref.out) <= targets_of(whole).out);
    CHECK(fkda_ref::rel_l2(second.state, ref.final_state) <= targets_of(whole).state);
  }
}

TEST_CASE("prefill: a lost or damaged state fails the accuracy check by a wide margin", "[gpu][state][mutation]") {
  // The same comparison the state tests make must fail, by kWideMargin
  // times its target or more, when the GPU starts from a state other than
  // the reference's; the margins are printed.
  const Case c = slowly_decaying(with_state(batched("mutation", 1, 160, 2, 2718), FKDA_DTYPE_F32,
                                            FKDA_STATE_LAYOUT_VK, true, true));
  const Problem p = problem_of(c);
  const fkda_ref::Reference ref = fkda_ref::reference_recurrence(p);
  const fkda_ref::AccuracyTargets targets = targets_of(c);

  SECTION("the initial state zeroed for the GPU, not for the reference") {
    const Outputs faithful = run_gpu(p, c);
    CHECK(fkda_ref::rel_l2(faithful.out, ref.out) <= targets.out);
    CHECK(fkda_ref::rel_l2(faithful.state, ref.final_state) <= targets.state);
    Problem zeroed = p;
    zeroed.initial_state.clear();
    const Outputs r = run_gpu(zeroed, c);
    const double out_error = fkda_ref::rel_l2(r.out, ref.out);
    const double state_error = fkda_ref::rel_l2(r.state, ref.final_state);
    print_margin("zeroed initial state", out_error, state_error, targets);
    CHECK(out_error >= kWideMargin * targets.out);
    CHECK(state_error >= kWideMargin * targets.state);
  }

  SECTION("the state handed across a chunk boundary between calls perturbed or dropped") {
    constexpr int64_t kSplit = 64;
    const Outputs first = run_gpu(tokens_from(p, 0, kSplit, p.initial_state), c);
    const std::vector<double> ref_tail = tail(ref.out, size_t(kSplit * p.H * p.V));
    struct HandOff {
      const char* name;
      float factor;
    };
    for (const HandOff& hand_off : {HandOff{"hand-off as is", 1.0f}, HandOff{"hand-off scaled by 1.05", 1.05f},
                                    HandOff{"hand-off dropped", 0.0f}}) {
      INFO(hand_off.name);
      std::vector<float> handed = first.state;
      for (float& x : handed) x *= hand_off.factor;
      const Outputs r = run_gpu(tokens_from(p, kSplit, p.T, handed), c);
      const double out_error = fkda_ref::rel_l2(r.out, ref_tail);
      const double state_error = fkda_ref::rel_l2(r.state, ref.final_state);
      print_margin(hand_off.name, out_error, state_error, targets);
      if (hand_off.factor == 1.0f) {
        CHECK(out_error <= targets.out);
        CHECK(state_error <= targets.state);
      } else {
        CHECK(out_error >= kWideMargin * targets.out);
        CHECK(state_error >= kWideMargin * targets.state);
      }
    }
  }

  SECTION("a window boundary whose hand-off is lost") {
    // Windows of one slot put a window boundary after every chunk; the run
    // must follow the reference, and be far from what a run that lost the
    // state at one of them (here after token 64) would give: the reference
    // of the same tokens cut into two sequences there, the second from zeros.
    Case one_slot = c;
    one_slot.window_slots = 1;
    const Outputs r = run_gpu(p, one_slot);
    CHECK(r.launch.slots_per_window == 1);
    CHECK(r.launch.windows >= p.T / 16);
    CHECK(fkda_ref::rel_l2(r.out, ref.out) <= targets.out);
    CHECK(fkda_ref::rel_l2(r.state, ref.final_state) <= targets.state);

    Problem lost = p;
    lost.cu_seqlens = {0, 64, p.T};
    lost.initial_state.resize(size_t(2 * p.H * p.V * p.K), 0.0f);
    const fkda_ref::Reference lost_ref = fkda_ref::reference_recurrence(lost);
    const std::vector<double> lost_state = tail(lost_ref.final_state, size_t(p.H * p.V * p.K));
    const double out_error = fkda_ref::rel_l2(r.out, lost_ref.out);
    const double state_error = fkda_ref::rel_l2(r.state, lost_state);
    print_margin("window hand-off lost after token 64", out_error, state_error, targets);
    CHECK(out_error >= kWideMargin * targets.out);
    CHECK(state_error >= kWideMargin * targets.state);
  }
}
