// SPDX-License-Identifier: MIT
// Segment transitions on the CPU, and the chunk-parallel forward pass built
// from them (docs/ARCHITECTURE.md, "Segment transitions"). A segment's
// (M, E) come from the same chunked recurrence as fkda_fwd, with the same
// roundings: E is the run from a zero state, M the run from the identity
// (K rows) with v = 0. The GPU forms them the same way, so the two backends
// stay comparable tightly.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "checked_arith.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_chunks.h"
#include "cpu/cpu_rounding.h"
#include "flashkda.h"

namespace fkda::cpu {
namespace {

constexpr int64_t kChunkTokens = 16;
// On CPU plans a forced-on path without a segment length takes segments of
// 64 chunks: long enough that the transitions cost little next to the runs.
constexpr int64_t kDefaultSegmentChunks = 64;

// Element (row, col) of a head's [rows][cols] f32 matrix as the plan's
// layout stores it: KV plans keep the transpose.
size_t layout_index(int32_t layout, int rows, int cols, int row, int col) {
  return layout == FKDA_STATE_LAYOUT_KV ? size_t(col) * rows + row : size_t(row) * cols + col;
}

void store_f32(int32_t layout, int rows, int cols, const float* matrix, float* to) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) to[layout_index(layout, rows, cols, r, c)] = matrix[size_t(r) * cols + c];
}

void load_f32(int32_t layout, int rows, int cols, const float* from, float* matrix) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) matrix[size_t(r) * cols + c] = from[layout_index(layout, rows, cols, r, c)];
}

void set_identity(int K, float* matrix) {
  std::fill(matrix, matrix + size_t(K) * K, 0.f);
  for (int i = 0; i < K; ++i) matrix[size_t(i) * K + i] = 1.f;
}

// state (V x K) <- state M + E, one row at a time through `row` (K floats),
// so that E may be the destination itself.
void affine_step(int V, int K, const float* state, const float* M, const float* E, float* result, float* row) {
  for (int e = 0; e < V; ++e) {
    const float* s = &state[size_t(e) * K];
    std::copy(&E[size_t(e) * K], &E[size_t(e) * K] + K, row);
    for (int i = 0; i < K; ++i) {
      const float weight = s[i];
      const float* m = &M[size_t(i) * K];
      for (int j = 0; j < K; ++j) row[j] += weight * m[j];
    }
    std::copy(row, row + K, &result[size_t(e) * K]);
  }
}

std::vector<ChunkRunner> runners(int64_t workers, int K, int V, void* workspace) {
  std::vector<ChunkRunner> all;
  all.reserve(size_t(workers));
  const size_t per_worker = ChunkRunner::floats_needed(K, V);
  for (int64_t w = 0; w < workers; ++w) all.emplace_back(K, V, static_cast<float*>(workspace) + size_t(w) * per_worker);
  return all;
}

int64_t chunks_of(int64_t tokens) { return (tokens + kChunkTokens - 1) / kChunkTokens; }

// One segment of one pair in the chunk-parallel pass.
struct SegmentTask {
  size_t pair;    // index into the pairs
  int64_t index;  // segment j of the pair
};

// Where the chunk-parallel pass keeps a pair's segments in the workspace:
// incoming[j] ([V][K]) is the state entering segment j, and before the scan
// incoming[j + 1] holds E_j; m[j] ([K][K]) is M_j, j < segments - 1.
struct PairSegments {
  Pair pair;
  int64_t segments = 0;
  float* incoming = nullptr;
  float* m = nullptr;
  bool padding = false;
};

}  // namespace

// ------------------------------------------------------------ transitions ---

size_t transitions_workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int32_t head_dim_k,
                                  int32_t head_dim_v) {
  // The M and E runs of a pair are separate tasks.
  const int64_t chunk_bound = saturating_mul(saturating_add(total_tokens / kChunkTokens, num_seqs), 2);
  const int64_t workers = worker_count(saturating_mul(saturating_mul(num_seqs, num_heads), 2), chunk_bound);
  return size_t(workers) * ChunkRunner::floats_needed(head_dim_k, head_dim_v) * sizeof(float);
}

void transitions(const TransitionProblem& t, void* workspace, size_t workspace_bytes) {
  const PrefillProblem p = as_prefill(t);
  const int K = t.head_dim_k, V = t.head_dim_v;
  std::vector<Pair> pairs;
  int64_t chunks = 0;
  for (int64_t n = 0; n < t.num_seqs; ++n) {
    const TokenRange range = sequence_tokens(t.cu_seqlens, t.seq_len, n);
    for (int32_t h = 0; h < t.num_heads; ++h) pairs.push_back({n, h, range.row, range.begin, range.end});
    chunks += 2 * chunks_of(range.length()) * t.num_heads;
  }
  if (pairs.empty()) return;
  const size_t per_worker = ChunkRunner::floats_needed(K, V);
  const int64_t affordable = int64_t(workspace_bytes / (per_worker * sizeof(float)));
  const int64_t workers = std::max<int64_t>(1, std::min(worker_count(int64_t(pairs.size()) * 2, chunks), affordable));
  std::vector<ChunkRunner> scratch = runners(workers, K, V, workspace);
  run_parallel(pairs.size() * 2, workers, [&](int64_t worker, size_t task) {
    const Pair& pair = pairs[task / 2];
    ChunkRunner& runner = scratch[size_t(worker)];
    float* state = runner.state();
    const size_t head = size_t(pair.seq) * size_t(t.num_heads) + size_t(pair.head);
    if (task % 2 == 0) {
      std::fill(state, state + size_t(V) * K, 0.f);
      runner.advance(p, pair, pair.begin, pair.end, ChunkMode::kStateOnly);
      store_f32(t.state_layout, V, K, state, t.transition_e + head * size_t(V) * K);
    } else {
      set_identity(K, state);  // K rows of the V-row state: K == V
      runner.advance(p, pair, pair.begin, pair.end, ChunkMode::kIdentity);
      store_f32(t.state_layout, K, K, state, t.transition_m + head * size_t(K) * K);
    }
  });
}

void apply_transitions(const ApplyProblem& a) {
  const int K = a.head_dim_k, V = a.head_dim_v;
  const int64_t pairs = a.num_seqs * a.num_heads;
  if (pairs == 0) return;
  const size_t state_elems = size_t(V) * K, m_elems = size_t(K) * K;
  const int64_t workers = worker_count(pairs, a.num_transitions * pairs * 8);
  // Allocated before any worker starts, so that no worker can throw.
  struct Scratch {
    std::vector<float> state, next, m, e, row;
  };
  std::vector<Scratch> scratch(static_cast<size_t>(workers));
  for (Scratch& s : scratch) {
    s.state.resize(state_elems);
    s.next.resize(state_elems);
    s.m.resize(m_elems);
    s.e.resize(state_elems);
    s.row.resize(size_t(K));
  }
  run_parallel(size_t(pairs), workers, [&](int64_t worker, size_t pair) {
    Scratch& s = scratch[size_t(worker)];
    const size_t state_offset = pair * state_elems;
    if (a.initial_state == nullptr) {
      std::fill(s.state.begin(), s.state.end(), 0.f);
    } else if (a.state_dtype == FKDA_DTYPE_BF16) {
      const uint16_t* from = static_cast<const uint16_t*>(a.initial_state) + state_offset;
      for (int e = 0; e < V; ++e)
        for (int c = 0; c < K; ++c)
          s.state[size_t(e) * K + c] = float_of_bf16(from[layout_index(a.state_layout, V, K, e, c)]);
    } else {
      load_f32(a.state_layout, V, K, static_cast<const float*>(a.initial_state) + state_offset, s.state.data());
    }
    for (int64_t r = 0; r < a.num_transitions; ++r) {
      const size_t head = size_t(r) * size_t(pairs) + pair;
      load_f32(a.state_layout, K, K, a.transition_m + head * m_elems, s.m.data());
      load_f32(a.state_layout, V, K, a.transition_e + head * state_elems, s.e.data());
      affine_step(V, K, s.state.data(), s.m.data(), s.e.data(), s.next.data(), s.row.data());
      std::swap(s.state, s.next);
    }
    if (a.state_dtype == FKDA_DTYPE_BF16) {
      uint16_t* to = static_cast<uint16_t*>(a.final_state) + state_offset;
      for (int e = 0; e < V; ++e)
        for (int c = 0; c < K; ++c)
          to[layout_index(a.state_layout, V, K, e, c)] = bf16_bits_of(s.state[size_t(e) * K + c]);
    } else {
      store_f32(a.state_layout, V, K, s.state.data(), static_cast<float*>(a.final_state) + state_offset);
    }
  });
}

// -------------------------------------------------- chunk-parallel fwd ---

bool use_chunk_parallel(const Tuning& tuning) { return tuning.chunk_parallel == FKDA_CHUNK_PARALLEL_ON; }

int64_t segment_tokens(const Tuning& tuning) {
  return (tuning.segment_chunks > 0 ? tuning.segment_chunks : kDefaultSegmentChunks) * kChunkTokens;
}

namespace {

// Floats of one segment's slots: its incoming state and its M.
size_t segment_floats(int K, int V) { return size_t(V) * K + size_t(K) * K; }

// A sequence of `tokens` tokens has at most tokens / L + 1 segments, so the
// whole call at most total_tokens / L + num_seqs per head.
int64_t segment_bound(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int64_t segment_length) {
  return saturating_mul(saturating_add(total_tokens / segment_length, num_seqs), num_heads);
}

}  // namespace

size_t chunk_parallel_workspace_size(int64_t total_tokens, int64_t num_seqs, int32_t num_heads, int32_t head_dim_k,
                                     int32_t head_dim_v, const Tuning& tuning) {
  const int64_t segments = segment_bound(total_tokens, num_seqs, num_heads, segment_tokens(tuning));
  const int64_t chunk_bound = saturating_mul(saturating_add(total_tokens / kChunkTokens, num_seqs), 2);
  const int64_t workers = worker_count(segments, chunk_bound);
  const int64_t scratch = saturating_mul(workers, int64_t(ChunkRunner::floats_needed(head_dim_k, head_dim_v)));
  const int64_t slots = saturating_mul(segments, int64_t(segment_floats(head_dim_k, head_dim_v)));
  return size_t(saturating_mul(saturating_add(scratch, slots), int64_t(sizeof(float))));
}

// Every pair's starting state is read first, into the slot of its first
// segment, before anything is written: a pool slot or a buffer updated in
// place is then never read after being written. Then three passes: (1)
// every segment's (M, E) but the last of each pair's, in parallel; (2) per
// pair, the scan S_{j+1} = S_j M_j + E_j; (3) every segment's run from its
// incoming state, in parallel, writing out and checkpoints, the last one the
// final state.
void fwd_chunk_parallel(const PrefillProblem& p, const Tuning& tuning, void* workspace, size_t workspace_bytes) {
  if (p.batch * p.seq_len == 0 && p.final_state == nullptr && p.pool.data == nullptr) return;
  const int K = p.head_dim_k, V = p.head_dim_v;
  const int64_t length = segment_tokens(tuning);

  std::vector<PairSegments> pairs;
  int64_t total_segments = 0, total_chunks = 0;
  for (int64_t n = 0; n < p.num_seqs; ++n) {
    const TokenRange range = sequence_tokens(p.cu_seqlens, p.seq_len, n);
    for (int32_t h = 0; h < p.num_heads; ++h) {
      PairSegments ps;
      ps.pair = {n, h, range.row, range.begin, range.end};
      // An empty sequence still carries its state over: one empty segment.
      ps.segments = std::max<int64_t>(1, (range.length() + length - 1) / length);
      total_segments += ps.segments;
      total_chunks += chunks_of(range.length());
      pairs.push_back(ps);
    }
  }
  if (pairs.empty()) return;

  const size_t per_worker = ChunkRunner::floats_needed(K, V);
  const size_t slot_floats = segment_floats(K, V);
  const size_t slots_bytes = size_t(total_segments) * slot_floats * sizeof(float);
  const int64_t affordable = int64_t((workspace_bytes - std::min(workspace_bytes, slots_bytes)) / (per_worker * sizeof(float)));
  const int64_t workers = std::max<int64_t>(1, std::min(worker_count(total_segments, 2 * total_chunks), affordable));
  std::vector<ChunkRunner> scratch = runners(workers, K, V, workspace);
  float* slots = static_cast<float*>(workspace) + size_t(workers) * per_worker;
  for (PairSegments& ps : pairs) {
    ps.incoming = slots;
    ps.m = slots + size_t(ps.segments) * size_t(V) * K;
    slots += size_t(ps.segments) * slot_floats;
  }

  std::vector<SegmentTask> inner, all;
  for (size_t i = 0; i < pairs.size(); ++i) {
    for (int64_t j = 0; j < pairs[i].segments; ++j) {
      if (j + 1 < pairs[i].segments) inner.push_back({i, j});
      all.push_back({i, j});
    }
  }
  auto segment_range = [&](const PairSegments& ps, int64_t j) {
    const int64_t begin = ps.pair.begin + j * length;
    return std::pair<int64_t, int64_t>{begin, std::min(ps.pair.end, begin + length)};
  };

  // Allocated before any worker starts, so that no worker can throw.
  std::vector<std::vector<float>> rows(static_cast<size_t>(workers), std::vector<float>(static_cast<size_t>(K)));
  // The starting states; padding pairs (zero output rows) are skipped from here on.
  run_parallel(pairs.size(), workers, [&](int64_t, size_t i) {
    PairSegments& ps = pairs[i];
    ps.padding = !read_initial_state(p, ps.pair, ps.incoming);
  });

  run_parallel(inner.size(), workers, [&](int64_t worker, size_t t) {
    const PairSegments& ps = pairs[inner[t].pair];
    if (ps.padding) return;
    const int64_t j = inner[t].index;
    const auto [begin, end] = segment_range(ps, j);
    ChunkRunner& runner = scratch[size_t(worker)];
    float* state = runner.state();
    std::fill(state, state + size_t(V) * K, 0.f);
    runner.advance(p, ps.pair, begin, end, ChunkMode::kStateOnly);
    std::copy(state, state + size_t(V) * K, ps.incoming + size_t(j + 1) * V * K);
    set_identity(K, state);
    runner.advance(p, ps.pair, begin, end, ChunkMode::kIdentity);
    std::copy(state, state + size_t(K) * K, ps.m + size_t(j) * K * K);
  });

  run_parallel(pairs.size(), workers, [&](int64_t worker, size_t i) {
    const PairSegments& ps = pairs[i];
    if (ps.padding) return;
    for (int64_t j = 0; j + 1 < ps.segments; ++j) {
      float* next = ps.incoming + size_t(j + 1) * V * K;  // E_j, becoming S_{j+1}
      affine_step(V, K, ps.incoming + size_t(j) * V * K, ps.m + size_t(j) * K * K, next, next,
                  rows[size_t(worker)].data());
    }
  });

  run_parallel(all.size(), workers, [&](int64_t worker, size_t t) {
    const PairSegments& ps = pairs[all[t].pair];
    if (ps.padding) return;
    const int64_t j = all[t].index;
    const auto [begin, end] = segment_range(ps, j);
    ChunkRunner& runner = scratch[size_t(worker)];
    float* state = runner.state();
    const float* incoming = ps.incoming + size_t(j) * V * K;
    std::copy(incoming, incoming + size_t(V) * K, state);
    runner.advance(p, ps.pair, begin, end, ChunkMode::kOutput);
    if (j + 1 == ps.segments) write_final_state(p, ps.pair, state);
  });
}

}  // namespace fkda::cpu
