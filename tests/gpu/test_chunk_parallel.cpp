// SPDX-License-Identifier: MIT
// Chunk-parallel prefill (FKDA_CHUNK_PARALLEL, FKDA_SEGMENT_CHUNKS): sequences
// cut into segments whose transitions are scanned, then run from their
// incoming states. Segment boundaries inside and at the ends of chunks and
// sequences, varlen batches that mix short and long sequences, states of
// every dtype and layout, windows, the automatic choice, and the slow-decay
// inputs that make a wrong incoming state show. Every case goes through
// check_case: fp64 targets, the CPU backend, every output written, nothing
// outside the views touched, the launch report.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "prefill_harness.h"

using namespace fkda_test;

TEST_CASE("chunk-parallel: segment boundaries inside and at the ends of chunks and sequences", "[gpu][segments]") {
  // Lengths of 0 to 1000 tokens: sequences of one segment, sequences that end
  // exactly at a segment boundary (48 = 3 chunks), one token past it, and
  // partial last chunks.
  const std::vector<int64_t> lengths = {0, 1, 15, 16, 17, 48, 49, 0, 300, 129, 64, 47, 1000};
  for (fkda_dtype dtype : {FKDA_DTYPE_F32, FKDA_DTYPE_BF16}) {
    for (fkda_state_layout layout : {FKDA_STATE_LAYOUT_VK, FKDA_STATE_LAYOUT_KV}) {
      const Case base = slowly_decaying(with_state(varlen("varlen", lengths, 2, 301 + dtype + 7 * layout), dtype,
                                                   layout, true, true));
      for (int64_t chunks : {1, 3, 7}) check_case(in_segments(base, chunks));
    }
  }
}

TEST_CASE("chunk-parallel: every presence of initial and final state", "[gpu][segments]") {
  for (int presence = 0; presence < 4; ++presence) {
    Case c = with_state(batched("presence", 2, 333, 2, 401 + presence), FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK,
                        presence & 1, presence & 2);
    c.name += " initial=" + std::to_string(presence & 1) + " final=" + std::to_string((presence >> 1) & 1);
    check_case(in_segments(slowly_decaying(c), 4));
  }
}

TEST_CASE("chunk-parallel: long sequences, slow decays, against the serial path", "[gpu][segments]") {
  // One sequence of 4096 tokens in segments of 1 to 256 chunks, and the
  // automatic choice, each within the targets; the serial run beside them.
  Case c = slowly_decaying(with_state(batched("long", 1, 4096, 2, 501), FKDA_DTYPE_F32, FKDA_STATE_LAYOUT_VK,
                                      true, true));
  Case serial = c;
  serial.chunk_parallel = FKDA_CHUNK_PARALLEL_OFF;
  serial.name += " serial";
  check_case(serial);
  for (int64_t chunks : {1, 16, 61, 256}) check_case(in_segments(c, chunks));
  Case automatic = c;
  automatic.chunk_parallel = FKDA_CHUNK_PARALLEL_AUTO;
  automatic.segment_chunks = 0;
  automatic.name += " automatic";
  const Checked checked = check_case(automatic);
  CHECK(checked.launch.chunk_parallel == 1);  // one sequence of 256 chunks and 2 heads: worth cutting
}

TEST_CASE("chunk-parallel: windows cut through segments", "[gpu][segments][window]") {
  const std::vector<int64_t> lengths = {700, 0, 33, 1200, 16};
  for (int64_t window_slots : {7, 50}) {
    Case c = slowly_decaying(
        with_state(varlen("windows of " + std::to_string(window_slots), lengths, 3, 601), FKDA_DTYPE_F32,
                   FKDA_STATE_LAYOUT_KV, true, true));
    c.window_slots = window_slots;
    const Checked checked = check_case(in_segments(c, 3));
    CHECK(checked.launch.windows > 1);
  }
}

TEST_CASE("chunk-parallel: small cases for compute-sanitizer", "[gpu][segments][sanitize]") {
  // Every kernel of the path: one-segment, exact-boundary and partial-chunk
  // sequences, a zero-length one, windows cutting segments, KV states in place
  // of VK, a pool-free call without states.
  Case c = slowly_decaying(with_state(varlen("sanitize", {0, 17, 48, 49, 130}, 2, 801), FKDA_DTYPE_BF16,
                                      FKDA_STATE_LAYOUT_KV, true, true));
  check_case(in_segments(c, 1));
  c.window_slots = 4;
  check_case(in_segments(c, 3));
  check_case(in_segments(varlen("sanitize, no states", {33, 70}, 2, 802), 2));
}

TEST_CASE("chunk-parallel: a captured CUDA graph replays the direct run", "[gpu][segments]") {
  // The three passes and the scan enqueue nothing the host waits for: the
  // call captures into a graph whose replays give the direct run's bits.
  const Case c = in_segments(slowly_decaying(with_state(varlen("graph", {700, 3, 250}, 2, 901), FKDA_DTYPE_F32,
                                                        FKDA_STATE_LAYOUT_VK, true, true)),
                             4);
  CHECK(check_graph_replays(c).chunk_parallel == 1);
}

TEST_CASE("chunk-parallel: the automatic choice", "[gpu][segments]") {
  // Segments for few (sequence, head) pairs of long sequences; the serial
  // chain for many pairs or short sequences, where segments measured slower.
  struct Expectation {
    std::vector<int64_t> lengths;
    int64_t heads;
    int64_t chunk_parallel;
  };
  for (const Expectation& e : {Expectation{{4096}, 2, 1}, Expectation{{2048}, 12, 0}, Expectation{{4096}, 24, 0},
                               Expectation{{4096, 4096}, 8, 1}}) {
    Case c = varlen("automatic", e.lengths, e.heads, 1001);
    c.chunk_parallel = FKDA_CHUNK_PARALLEL_AUTO;
    c.segment_chunks = 0;
    c.name += " H=" + std::to_string(e.heads) + " N=" + std::to_string(e.lengths.size());
    const Outputs outputs = run_gpu(problem_of(c), c);
    CAPTURE(c.name);
    CHECK(outputs.launch.chunk_parallel == e.chunk_parallel);
  }
}
