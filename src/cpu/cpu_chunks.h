// SPDX-License-Identifier: MIT
// The chunked recurrence of cpu_backend.cpp, offered to the parts of the CPU
// backend that run pieces of sequences from states of their own: segment
// transitions and the chunk-parallel forward pass (cpu_transitions.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "prefill_problem.h"
#include "tuning.h"

namespace fkda::cpu {

// What a run over tokens does besides advancing the state:
//   kOutput     reads q, writes out and the checkpoints due in the range
//   kStateOnly  only the state (no q, no out): E of a transition, from zeros
//   kIdentity   v read as 0 (no q, no out): run on the identity it gives M
enum class ChunkMode { kOutput, kStateOnly, kIdentity };

// One (sequence, head) pair: tokens [begin, end) of batch row `row`.
struct Pair {
  int64_t seq = 0;
  int32_t head = 0;
  int64_t row = 0;
  int64_t begin = 0, end = 0;
};

struct ChunkScratch;  // cpu_backend.cpp

// One worker's scratch over `floats_needed` floats of the caller's workspace.
class ChunkRunner {
 public:
  static size_t floats_needed(int head_dim_k, int head_dim_v);
  ChunkRunner(int head_dim_k, int head_dim_v, float* memory);
  ChunkRunner(ChunkRunner&&) noexcept;
  ~ChunkRunner();

  // The f32 state the runs advance, [V][K] V-first whatever the plan's layout.
  float* state();
  // Advances state() over tokens [begin, end) of the pair. begin - pair.begin
  // is a multiple of 16, so that the chunks are the sequence's own; the
  // checkpoints of kOutput count tokens from pair.begin.
  void advance(const PrefillProblem& p, const Pair& pair, int64_t begin, int64_t end, ChunkMode mode);

 private:
  std::unique_ptr<ChunkScratch> scratch_;
};

// The pair's starting state (initial_state, a pool slot, or zeros as
// has_initial_state and the plan say) read into the f32 `state`; false for
// a padding pair (null slot), whose output rows it zeroes instead.
bool read_initial_state(const PrefillProblem& p, const Pair& pair, float* state);
// The f32 `state` rounded into the pair's final place (final_state or pool
// slot; nothing when it has none).
void write_final_state(const PrefillProblem& p, const Pair& pair, const float* state);

// Workers for `tasks` tasks worth `chunks` 16-token chunks: one per core at most.
int64_t worker_count(int64_t tasks, int64_t chunks);
// Runs tasks 0 .. count-1 on `workers` threads (the caller's included):
// run(worker, task). Nothing in `run` may throw.
void run_parallel(size_t count, int64_t workers, const std::function<void(int64_t, size_t)>& run);

// The chunk-parallel forward pass (cpu_transitions.cpp), and whether a call
// takes it: on CPU plans only when the plan forces it on (AUTO keeps the
// serial path, the kernels' bit-for-bit partner).
bool use_chunk_parallel(const Tuning& tuning);
int64_t segment_tokens(const Tuning& tuning);
size_t chunk_parallel_workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int32_t head_dim_k,
                                     int32_t head_dim_v, const Tuning& tuning);
void fwd_chunk_parallel(const PrefillProblem& problem, const Tuning& tuning, void* workspace, size_t workspace_bytes);

}  // namespace fkda::cpu
