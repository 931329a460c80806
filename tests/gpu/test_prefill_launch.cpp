// SPDX-License-Identifier: MIT
// How a GPU prefill is cut into launches must change no bit of its result:
// every V split (FKDA_VSPLIT), windows of any size (FKDA_WINDOW_SLOTS, and
// the automatic windows of a large call), a replayed CUDA graph. What ran is
// read back from fkda_plan_get_launch_report, never predicted. Also: device
// offsets that are out of range stay inside the tensors.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "prefill_harness.h"

using namespace fkda_test;

TEST_CASE("prefill: every V split gives the same bits", "[gpu][launch]") {
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    Case c = slowly_decaying(with_state(varlen("", {0, 1, 17, 100, 250}, 3, 171 + dtype), dtype,
                                        dtype == FKDA_DTYPE_F32 ? FKDA_STATE_LAYOUT_VK : FKDA_STATE_LAYOUT_KV, true,
                                        true));
    std::vector<Result> results;
    for (int64_t vsplit : {1, 2, 4, 8}) {
      c.vsplit = vsplit;
      c.name = std::string("vsplit=") + std::to_string(vsplit) + (dtype == FKDA_DTYPE_F32 ? " f32" : " bf16");
      results.push_back(check_case(c).result);
    }
    for (size_t i = 1; i < results.size(); ++i) {
      CAPTURE(i);
      CHECK(results[i] == results[0]);
    }
  }
}

TEST_CASE("prefill: the automatic V split is one of the four", "[gpu][launch]") {
  // Few (sequence, head) pairs get more blocks each; whatever the choice,
  // it is reported and the result is checked like any other.
  for (int64_t heads : {1, 64}) {
    Case c = varlen("automatic vsplit H=" + std::to_string(heads), {33, 7}, heads, 181);
    c.vsplit = 0;
    const fkda_launch_report launch = check_case(c).launch;
    CHECK((launch.vsplit == 1 || launch.vsplit == 2 || launch.vsplit == 4 || launch.vsplit == 8));
  }
}

TEST_CASE("prefill: windows of any size give the same bits", "[gpu][launch]") {
  // Windows of 1, 3 and 7 slots put boundaries inside, at the ends of and
  // between sequences, so that states cross many of them.
  const std::vector<int64_t> lengths = {0, 1, 15, 16, 17, 0, 300, 5, 0, 129, 64, 0, 47};
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    Case c = slowly_decaying(with_state(varlen("", lengths, 2, 141 + dtype), dtype, FKDA_STATE_LAYOUT_VK, true, true));
    c.window_slots = 0;
    c.name = std::string("one window ") + (dtype == FKDA_DTYPE_F32 ? "f32" : "bf16");
    const Checked one = check_case(c);
    CHECK(one.launch.windows == 1);
    for (int64_t slots : {1, 3, 7}) {
      c.window_slots = slots;
      c.name = "windows of " + std::to_string(slots) + (dtype == FKDA_DTYPE_F32 ? " f32" : " bf16");
      const Checked windowed = check_case(c);
      CHECK(windowed.launch.slots_per_window == slots);
      CHECK(windowed.launch.windows > 1);
      CHECK(windowed.result == one.result);
    }
  }
}

TEST_CASE("prefill: sequences across many windows", "[gpu][window]") {
  // Run as they are by the tests step and under FKDA_WINDOW_SLOTS by
  // gpu_check.sh's window step.
  const std::vector<int64_t> lengths = {0, 1, 15, 16, 17, 0, 300, 5, 0, 129, 64, 0, 47};
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
      Case c = with_state(varlen("windows", lengths, 2, 141 + dtype + 10 * layout), dtype, layout, true, true);
      c.name = std::string("windows ") + (dtype == FKDA_DTYPE_F32 ? "f32 " : "bf16 ") +
               (layout == FKDA_STATE_LAYOUT_VK ? "VK" : "KV");
      check_case(c);
      check_case(slowly_decaying(c));
    }
  }
  for (int presence = 0; presence < 4; ++presence) {
    const bool initial = presence & 1, final = presence & 2;
    Case c = with_state(batched("windows batched", 3, 100, 2, 151 + presence), FKDA_DTYPE_BF16,
                        FKDA_STATE_LAYOUT_VK, initial, final);
    c.name = std::string("windows batched initial=") + std::to_string(initial) + " final=" + std::to_string(final);
    check_case(slowly_decaying(c));
  }
}

TEST_CASE("prefill: the automatic windows of a large call give the bits of one window per sequence",
          "[gpu][launch]") {
  // 40,000 tokens of 8 heads take several windows by default and each of
  // their sequences alone takes one (both read back from the launch
  // report); the middle sequence crosses a boundary. The automatic V split
  // may differ between the calls: V splits change no bit (tested above).
  // Slow decays, so that the state carries.
  const Tuning automatic(0, 0);
  const std::vector<int64_t> lengths = {10000, 25000, 5000};
  Problem p;
  p.H = 8;
  p.cu_seqlens = {0};
  for (int64_t len : lengths) p.cu_seqlens.push_back(p.cu_seqlens.back() + len);
  p.T = p.cu_seqlens.back();
  const size_t token_elems = size_t(p.H * 128);
  p.q = fkda_ref::quick_normals(size_t(p.T) * token_elems, 1);
  p.k = fkda_ref::quick_normals(size_t(p.T) * token_elems, 2);
  p.v = fkda_ref::quick_normals(size_t(p.T) * token_elems, 3);
  p.g = fkda_ref::quick_normals(size_t(p.T) * token_elems, 4);
  for (uint16_t& x : p.g) x = fkda_ref::to_bf16(fkda_ref::from_bf16(x) - 6.0f);
  p.beta = fkda_ref::quick_normals(size_t(p.T * p.H), 5);
  for (int64_t i = 0; i < p.H; ++i) p.A_log.push_back(float(i + 1) / float(p.H + 1));
  for (int64_t i = 0; i < p.H * 128; ++i) p.dt_bias.push_back(float((i * 2654435761u) % 1000) / 1000.0f);
  const std::vector<uint16_t> state_normals = fkda_ref::quick_normals(size_t(p.state_elems()), 6);
  for (uint16_t x : state_normals) p.initial_state.push_back(fkda_ref::from_bf16(x));
  const size_t matrices = size_t(p.H) * 128 * 128;  // state elements of one sequence

  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    CAPTURE(dtype);
    Case c = with_state(Case{}, dtype, FKDA_STATE_LAYOUT_VK, true, true);
    // Serial both times: one sequence of 8 heads alone would be cut into
    // segments, whose bits differ from the chain's (test_chunk_parallel.cpp).
    c.chunk_parallel = FKDA_CHUNK_PARALLEL_OFF;
    const Outputs whole = run_gpu(p, c);
    CHECK(whole.launch.windows >= 2);
    size_t nan_count = 0;
    for (float x : whole.out) nan_count += x != x;
    CHECK(nan_count == 0);

    for (size_t n = 0; n < lengths.size(); ++n) {
      CAPTURE(n);
      const int64_t begin = p.cu_seqlens[n], len = lengths[n];
      Problem alone = p;
      alone.cu_seqlens.clear();
      alone.T = len;
      auto slice = [&](const std::vector<uint16_t>& x, size_t per_token) {
        return std::vector<uint16_t>(x.begin() + std::ptrdiff_t(size_t(begin) * per_token),
                                     x.begin() + std::ptrdiff_t(size_t(begin + len) * per_token));
      };
      alone.q = slice(p.q, token_elems);
      alone.k = slice(p.k, token_elems);
      alone.v = slice(p.v, token_elems);
      alone.g = slice(p.g, token_elems);
      alone.beta = slice(p.beta, size_t(p.H));
      alone.initial_state.assign(p.initial_state.begin() + std::ptrdiff_t(n * matrices),
                                 p.initial_state.begin() + std::ptrdiff_t((n + 1) * matrices));
      const Outputs part = run_gpu(alone, c);
      CHECK(part.launch.windows == 1);
      CHECK(std::memcmp(part.out.data(), whole.out.data() + size_t(begin) * token_elems,
                        part.out.size() * sizeof(float)) == 0);
      CHECK(std::memcmp(part.state.data(), whole.state.data() + n * matrices, matrices * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("prefill: docs/BENCHMARKS.md's P1 workspace stays within its 340 MB target", "[gpu][launch]") {
  const Tuning automatic(0, 0);
  Plan plan(plan_desc(96, -5.0f, FKDA_DTYPE_BF16, FKDA_STATE_LAYOUT_VK));
  size_t bytes = 0;
  FKDA_REQUIRE(fkda_plan_workspace_size(plan.get(), 8192, 1, &bytes));
  CHECK(bytes <= size_t(340) * 1000 * 1000);
}

TEST_CASE("prefill: a captured CUDA graph replays the direct run", "[gpu][window]") {
  const Case c = slowly_decaying(
      with_state(varlen("graph", {100, 3, 64, 29}, 4, 91), FKDA_DTYPE_BF16, FKDA_STATE_LAYOUT_VK, true, true));
  (void)check_graph_replays(c);
}

TEST_CASE("prefill: overlapped serial windows replay from a captured CUDA graph", "[gpu][window]") {
  // Windows of 3 slots: each window's preparation is captured as a
  // programmatic dependent of the recurrence before it, and the replays
  // must keep the order the direct run keeps (its next recurrence after
  // both), so they give the direct run's bits.
  Case c = slowly_decaying(
      with_state(varlen("graph, windows", {100, 3, 64, 29}, 4, 93), FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK, true, true));
  c.window_slots = 3;
  const fkda_launch_report report = check_graph_replays(c);
  CHECK(report.chunk_parallel == 0);
  CHECK(report.windows > 3);
}

TEST_CASE("prefill: device offsets out of range or unsorted are clamped", "[gpu][sanitize]") {
  // The host never reads cu_seqlens on a GPU plan; the kernels must stay
  // inside every tensor whatever the offsets say.
  Case c = varlen("bad offsets", {30, 20, 14}, 2, 101);
  c.arrangement = Arrangement::kPadded;
  const Problem p = problem_of(c);
  const Arenas arenas(p, c);
  DeviceCase device(p, c, arenas);
  const std::vector<std::vector<int64_t>> offsets = {
      {0, 50, 20, 64},        // unsorted
      {-7, 10, 1000, 64},     // below 0 and past T
      {64, 0, 64, 3},         // reversed
      {0, 64, 64, 1LL << 40}  // far out
  };
  for (const auto& bad : offsets) {
    std::vector<unsigned char> bytes(bad.size() * 8);
    std::memcpy(bytes.data(), bad.data(), bytes.size());
    device.offsets.upload(bytes.data());
    device.run(nullptr);
    CHECK(arenas.act.touched_gaps(device.fetch().out) == 0);
  }
}
