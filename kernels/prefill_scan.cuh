// SPDX-License-Identifier: MIT
// The scan of chunk-parallel prefill, and fkda_apply_transitions.
//
// A segment maps the state entering it affinely, S_out = S_in M + E
// (docs/ARCHITECTURE.md, "Chunk-parallel prefill"); the transition pass left
// E (and M) of each segment in its record of seg_e (seg_m), E of the first
// segment already from the sequence's true incoming state. Per (sequence,
// head), in order:
//   forward      X = E_s0;  X = X M_s + E_s, stored over E_s, for
//                s0 < s < s_last: the state each later segment starts from
//   transitions  both chains, X_E = X_E M_s + E_s and X_M = X_M M_s, from
//                the first segment (or the running transition that earlier
//                windows left in trans_e / trans_m) to the last, ending in
//                trans_e / trans_m
// in f32 FMAs: the scan is a chain of K x K products whose rounding adds up
// over the segments, and tensor-core formats would cost accuracy the state
// target leaves no room for.
//
// The rows of X are independent, so block (n, h, z) takes FKDA_SCAN_ROWS of
// them (z < 16: E rows, z >= 16: M rows) with all K columns. M_s of the
// current and the next segment sit in shared memory, filled by cp.async
// while the block works on the current one. The product X M is split along
// K over four warp pairs, so that each thread's chain of dependent FMAs is
// 32 long rather than 128 (one step is on the scan's critical path, and the
// scan is one block per SM: latency, not throughput, is what it costs);
// the four partial products meet in shared memory.
#pragma once

#include "device_common.cuh"

namespace fkda_dev {

constexpr int kScanMatrix = FKDA_HEAD_DIM * FKDA_HEAD_DIM;
constexpr int kScanSlice = FKDA_HEAD_DIM * FKDA_SCAN_ROWS;  // floats of X^T, and of one partial product
constexpr int kScanQuarters = 4;

// Element (row, col) of an f32 [N, H, 128, 128] output, stored transposed
// for KV plans.
__device__ __forceinline__ int64_t transition_at(const FkdaPrefillParams& p, int64_t n, int head, int row, int col) {
  const int64_t base = (n * p.call.num_heads + head) * int64_t(kScanMatrix);
  return base + (p.call.state_is_kv ? int64_t(col) * FKDA_HEAD_DIM + row : int64_t(row) * FKDA_HEAD_DIM + col);
}

__device__ __forceinline__ const float* segment_record(const float* base, int64_t index, int head, int num_heads) {
  return base + (index * num_heads + head) * int64_t(kScanMatrix);
}

__device__ __forceinline__ void stage_transition_m(float* buffer, const float* m) {
  const uint32_t to = smem_address(buffer);
  for (int i = threadIdx.x; i < kScanMatrix / 4; i += FKDA_SCAN_THREADS) cp_async_16(to + 16 * i, m + 4 * i, 16);
}

// Each thread owns, between products, row owner_row() and columns
// owner_col() .. + 3 of the block's rows of X.
__device__ __forceinline__ int owner_row() { return threadIdx.x >> 5; }
__device__ __forceinline__ int owner_col() { return 4 * (threadIdx.x & 31); }

__device__ __forceinline__ void put_transposed(float* xt, const float (&x)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) xt[(owner_col() + c) * FKDA_SCAN_ROWS + owner_row()] = x[c];
}

// x = X M + x at the owner's four elements, X^T in xt ([128][FKDA_SCAN_ROWS])
// and M row-major in m, both in shared memory, through `partial` (four
// slices). Warp w sums k in [32 (w / 2), + 32) for columns [64 (w % 2), + 64);
// lane l rows 2 (l / 8), + 1 and columns 4 (l % 8) + {0..3, 32..35} of them:
// per k one float2 of X^T and two float4 of M, one wavefront each.
__device__ __forceinline__ void multiply_add_transition(const float* xt, const float* m, float* partial,
                                                        float (&x)[4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quarter = warp >> 1;
  const int lr = 2 * (lane >> 3);
  const int col = 64 * (warp & 1) + 4 * (lane & 7);
  float acc[2][8] = {};
#pragma unroll 8
  for (int i = 32 * quarter; i < 32 * quarter + 32; ++i) {
    const float2 xi = *reinterpret_cast<const float2*>(xt + i * FKDA_SCAN_ROWS + lr);
    const float4 m0 = *reinterpret_cast<const float4*>(m + i * FKDA_HEAD_DIM + col);
    const float4 m1 = *reinterpret_cast<const float4*>(m + i * FKDA_HEAD_DIM + col + 32);
    const float mv[8] = {m0.x, m0.y, m0.z, m0.w, m1.x, m1.y, m1.z, m1.w};
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      acc[0][c] = fmaf(xi.x, mv[c], acc[0][c]);
      acc[1][c] = fmaf(xi.y, mv[c], acc[1][c]);
    }
  }
  float* mine = partial + quarter * kScanSlice;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    *reinterpret_cast<float4*>(mine + (lr + r) * FKDA_HEAD_DIM + col) =
        make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    *reinterpret_cast<float4*>(mine + (lr + r) * FKDA_HEAD_DIM + col + 32) =
        make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
  }
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kScanQuarters; ++q) {
    const float4 part = *reinterpret_cast<const float4*>(partial + q * kScanSlice + owner_row() * FKDA_HEAD_DIM +
                                                         owner_col());
    x[0] += part.x;
    x[1] += part.y;
    x[2] += part.z;
    x[3] += part.w;
  }
}

__device__ void segment_scan(const FkdaPrefillParams& p) {
  extern __shared__ __align__(16) float scan_smem[];
  // M of two segments in turn: stage (k & 1) at scan_smem + (k & 1) * kScanMatrix.
  auto m_stage = [&](int64_t k) { return scan_smem + (k & 1) * kScanMatrix; };
  float* xt = scan_smem + 2 * kScanMatrix;  // X^T: [128 columns][FKDA_SCAN_ROWS rows]
  float* partial = xt + kScanSlice;

  const int64_t n = blockIdx.x;
  const int head = blockIdx.y;
  const bool m_rows = blockIdx.z >= FKDA_HEAD_DIM / FKDA_SCAN_ROWS;
  const int row = int(blockIdx.z % (FKDA_HEAD_DIM / FKDA_SCAN_ROWS)) * FKDA_SCAN_ROWS + owner_row();
  const int col = owner_col();
  const bool transitions = p.transitions_only != 0;

  // The sequence's chunks in this window, as the recurrence finds them.
  const Sequence seq = sequence_of(p, n);
  const WindowChunks window = window_chunks(p, seq);
  const int64_t chunks = window.chunks, chunk_first = window.first, chunk_end = window.end;

  float* output = m_rows ? p.trans_m : p.trans_e;
  if (chunks == 0) {
    // Only fkda_transitions has work here: the empty transition (I, 0), once.
    if (!transitions || p.window_first != 0) return;
#pragma unroll
    for (int c = 0; c < 4; ++c) output[transition_at(p, n, head, row, col + c)] = (m_rows && row == col + c) ? 1.f : 0.f;
    return;
  }
  if (chunk_first >= chunk_end) return;

  const int64_t L = p.segment_chunks;
  const int64_t s0 = chunk_first / L;
  const int64_t s_last = (chunk_end - 1) / L;
  auto index_of = [&](int64_t s) { return fkda_segment_index(seq.slot_base + s * L, p.window_first, L, n); };
  if (index_of(s0) < 0 || index_of(s_last) >= p.segment_capacity) return;  // unsorted offsets only

  // The segments [s_begin, s_end) to fold into X, and X's starting value.
  const bool continues = transitions && chunk_first > 0;  // a running transition from earlier windows
  const int64_t s_begin = continues ? s0 : s0 + 1;
  const int64_t s_end = transitions ? s_last + 1 : s_last;
  if (!transitions && s_end <= s_begin) return;  // E_s0 already is the state after s0
  float x[4];
  const float* first = segment_record(m_rows ? p.seg_m : p.seg_e, index_of(s0), head, p.call.num_heads);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    x[c] = continues ? output[transition_at(p, n, head, row, col + c)] : first[row * FKDA_HEAD_DIM + col + c];
  }
  put_transposed(xt, x);

  if (s_begin < s_end) stage_transition_m(m_stage(0), segment_record(p.seg_m, index_of(s_begin), head, p.call.num_heads));
  cp_async_commit();
  for (int64_t s = s_begin; s < s_end; ++s) {
    const int64_t k = s - s_begin;
    // The stage this overwrites was last read before the previous step's final barrier.
    if (s + 1 < s_end) stage_transition_m(m_stage(k + 1), segment_record(p.seg_m, index_of(s + 1), head, p.call.num_heads));
    cp_async_commit();
    // E_s first (M rows add nothing): its latency hides behind the wait.
    if (m_rows) {
#pragma unroll
      for (int c = 0; c < 4; ++c) x[c] = 0.f;
    } else {
      const float4 e = *reinterpret_cast<const float4*>(segment_record(p.seg_e, index_of(s), head, p.call.num_heads) +
                                                        row * FKDA_HEAD_DIM + col);
      x[0] = e.x;
      x[1] = e.y;
      x[2] = e.z;
      x[3] = e.w;
    }
    cp_async_wait<1>();
    __syncthreads();  // M_s and X^T complete
    multiply_add_transition(xt, m_stage(k), partial, x);
    if (!transitions) {
      // The state after segment s, over E_s: where segment s + 1 starts.
      *reinterpret_cast<float4*>(p.seg_e + (index_of(s) * p.call.num_heads + head) * int64_t(kScanMatrix) +
                                 row * FKDA_HEAD_DIM + col) = make_float4(x[0], x[1], x[2], x[3]);
    }
    __syncthreads();  // every read of X^T, the partials and M_s is done
    put_transposed(xt, x);
  }
  cp_async_wait<0>();
  if (transitions) {
#pragma unroll
    for (int c = 0; c < 4; ++c) output[transition_at(p, n, head, row, col + c)] = x[c];
  }
}

// fkda_apply_transitions: the same fold over R transitions given by the
// caller in the plan's layout, from and to states of the plan's dtype.
__device__ void apply_transitions(const FkdaApplyParams& p) {
  extern __shared__ __align__(16) float apply_smem[];
  float* m_rows = apply_smem;            // M row-major, whatever the layout
  float* xt = apply_smem + kScanMatrix;  // X^T: [128 columns][FKDA_SCAN_ROWS rows]
  float* partial = xt + kScanSlice;
  const int64_t n = blockIdx.x;
  const int head = blockIdx.y;
  const int row = int(blockIdx.z) * FKDA_SCAN_ROWS + owner_row();
  const int col = owner_col();
  const bool kv = p.state_is_kv != 0;
  const int64_t matrix = (n * p.num_heads + head) * int64_t(kScanMatrix);
  // Element (r, c) of a V x K (or K x K) matrix stored in the plan's layout.
  auto at = [&](int r, int c) { return kv ? c * FKDA_HEAD_DIM + r : r * FKDA_HEAD_DIM + c; };

  float x[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int64_t i = matrix + at(row, col + c);
    float value = 0.f;
    if (p.initial_state != nullptr) {
      value = p.state_is_bf16 ? bf16_bits(static_cast<const uint16_t*>(p.initial_state)[i])
                              : static_cast<const float*>(p.initial_state)[i];
    }
    x[c] = value;
  }
  const int64_t step = p.num_seqs * p.num_heads * int64_t(kScanMatrix);
  for (int64_t t = 0; t < p.num_transitions; ++t) {
    put_transposed(xt, x);
    const float* m = p.m + t * step + matrix;
    for (int i = threadIdx.x; i < kScanMatrix; i += FKDA_SCAN_THREADS) {
      // Coalesced reads; KV plans hold M^T, transposed here on the way in.
      m_rows[kv ? (i % FKDA_HEAD_DIM) * FKDA_HEAD_DIM + i / FKDA_HEAD_DIM : i] = m[i];
    }
    const float* e = p.e + t * step + matrix;
#pragma unroll
    for (int c = 0; c < 4; ++c) x[c] = e[at(row, col + c)];
    __syncthreads();  // M and X^T complete
    multiply_add_transition(xt, m_rows, partial, x);
    __syncthreads();  // every read of M, X^T and the partials is done
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int64_t i = matrix + at(row, col + c);
    if (p.state_is_bf16) {
      static_cast<uint16_t*>(p.final_state)[i] = to_bf16(x[c]);
    } else {
      static_cast<float*>(p.final_state)[i] = x[c];
    }
  }
}

}  // namespace fkda_dev

// Grid (N, H, 16) for fkda_fwd, (N, H, 32) for fkda_transitions (the M rows
// too); FKDA_SCAN_THREADS threads, FKDA_SCAN_SMEM_BYTES of shared memory.
extern "C" __global__ void __launch_bounds__(FKDA_SCAN_THREADS) fkda_prefill_segment_scan(const FkdaPrefillParams p) {
  fkda_dev::segment_scan(p);
}

// Grid (N, H, 128 / FKDA_SCAN_ROWS), FKDA_SCAN_THREADS threads, FKDA_APPLY_SMEM_BYTES.
extern "C" __global__ void __launch_bounds__(FKDA_SCAN_THREADS) fkda_apply_transitions(const FkdaApplyParams p) {
  fkda_dev::apply_transitions(p);
}
